#pragma once
// Private to core: the elementwise device kernels, copies, fills, Philox draws and optimizer
// updates (see kernels.h for how devices run them). Each is host code (checks, result allocation
// on the inputs' device, dtype promotion, strides) plus an element functor whose body is
// TESSERA_HOST_DEVICE. The checks are the CPU kernels' (element_checks.h) and the element
// formulas the CPU's (element_ops.h), so a device refuses and computes what the CPU does.
//
// Invariant: the host code never reads or writes tensor data; only functors do, inside for_each.
#include <cstring>
#include <type_traits>

#include "../kernel_table.h"
#include "copy_checks.h"
#include "element_checks.h"
#include "element_ops.h"
#include "float_dispatch.h"
#include "launch.h"
#include "strided_index.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"

namespace tessera::kernels::portable {

template <class T>
TESSERA_HOST_DEVICE inline compute_t<T> load(const T* p, int64_t i) {
  return compute_t<T>(p[i]);
}

// Strides that read `t` as broadcast to `shape` (0 along broadcast dims).
inline Shape broadcast_strides(const Tensor& t, const Shape& shape) {
  Shape st(shape.size(), 0);
  const size_t lead = shape.size() - size_t(t.dim());
  for (size_t i = 0; i < size_t(t.dim()); ++i)
    if (t.sizes()[i] != 1) st[lead + i] = t.strides()[i];
  return st;
}

// ---- element functors -------------------------------------------------------------------------

template <class T>
struct UnaryFn {
  UnaryOp op;
  TESSERA_HOST_DEVICE compute_t<T> operator()(compute_t<T> x) const {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      return unary_float(op, x);
    } else {
      return unary_int(op, x);
    }
  }
};

template <class T>
struct ScalarFn {
  BinaryOp op;
  compute_t<T> s;
  bool reversed;
  TESSERA_HOST_DEVICE compute_t<T> operator()(compute_t<T> x) const {
    return reversed ? binary_value(op, s, x) : binary_value(op, x, s);
  }
};

template <class T, class S>
struct CompareScalarFn {
  CompareOp op;
  S s;
  TESSERA_HOST_DEVICE bool operator()(compute_t<T> x) const { return compare_value(op, S(x), s); }
};

template <class T>
struct BinaryFn {
  BinaryOp op;
  TESSERA_HOST_DEVICE compute_t<T> operator()(compute_t<T> a, compute_t<T> b) const {
    return binary_value(op, a, b);
  }
};

template <class T>
struct CompareFn {
  CompareOp op;
  TESSERA_HOST_DEVICE bool operator()(compute_t<T> a, compute_t<T> b) const {
    return compare_value(op, a, b);
  }
};

template <class T>
struct UnaryGradFn {
  UnaryOp op;
  TESSERA_HOST_DEVICE compute_t<T> operator()(compute_t<T> g, compute_t<T> x) const {
    return unary_grad(op, g, x);
  }
};

// out = fn(in) elementwise; out of type TO, input of type T.
template <class T, class TO, class Fn>
struct Map1 {
  StridedIndex<2> ix;
  TO* out;
  const T* in;
  Fn fn;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    int64_t off[2];
    ix.offsets(i, off);
    out[off[0]] = TO(fn(load(in, off[1])));
  }
};

template <class T, class TO, class Fn>
struct Map2 {
  StridedIndex<3> ix;
  TO* out;
  const T* a;
  const T* b;
  Fn fn;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    int64_t off[3];
    ix.offsets(i, off);
    out[off[0]] = TO(fn(load(a, off[1]), load(b, off[2])));
  }
};

// A copy within one dtype moves the element's bits (a 16-bit NaN keeps its payload); across
// dtypes it converts through the compute type, as the CPU does.
template <class D, class S>
struct CopyFn {
  StridedIndex<2> ix;
  D* dst;
  const S* src;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    int64_t off[2];
    ix.offsets(i, off);
    if constexpr (std::is_same_v<D, S>) {
      dst[off[0]] = src[off[1]];
    } else {
      dst[off[0]] = D(load(src, off[1]));
    }
  }
};

// Run r of a copy_runs_ table (src, dst, length per run), shared by a team's lanes; elements move
// as words of their width.
template <class W>
struct CopyRunsFn {
  W* dst;
  const W* src;
  const int64_t* runs;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t r, Team& team) const {
    const int64_t* run = runs + 3 * r;
    const W* from = src + run[0];
    W* to = dst + run[1];
    for (int64_t i = team.lane(); i < run[2]; i += team.size())
      to[i] = from[i];
  }
};

template <class T>
struct FillFn {
  StridedIndex<1> ix;
  T* p;
  T value;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    int64_t off[1];
    ix.offsets(i, off);
    p[off[0]] = value;
  }
};

// dst += alpha * src in dst's compute type C; integers wrap.
template <class D, class S>
struct AddFn {
  StridedIndex<2> ix;
  D* dst;
  const S* src;
  compute_t<D> alpha;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    using C = compute_t<D>;
    int64_t off[2];
    ix.offsets(i, off);
    D& d = dst[off[0]];
    const C s = C(load(src, off[1]));
    if constexpr (std::is_integral_v<C>) {
      using U = std::make_unsigned_t<C>;
      d = D(C(U(d) + U(alpha) * U(s)));
    } else {
      d = D(C(d) + alpha * s);
    }
  }
};

template <class T>
struct MulScalarFn {
  StridedIndex<1> ix;
  T* p;
  compute_t<T> s;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    int64_t off[1];
    ix.offsets(i, off);
    p[off[0]] = T(apply_binary<BinaryOp::Mul>(load(p, off[0]), s));
  }
};

// Selection moves bits: W is an unsigned word of the element's size, masks are read as bytes.
template <class W>
struct WhereFn {
  StridedIndex<4> ix;
  W* out;
  const uint8_t* cond;
  const W* a;
  const W* b;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    int64_t off[4];
    ix.offsets(i, off);
    out[off[0]] = cond[off[1]] != 0 ? a[off[2]] : b[off[3]];
  }
};

template <class W>
struct MaskedFillFn {
  StridedIndex<3> ix;
  W* out;
  const W* x;
  const uint8_t* mask;
  W value;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    int64_t off[3];
    ix.offsets(i, off);
    out[off[0]] = mask[off[2]] != 0 ? value : x[off[1]];
  }
};

// Operand 0: the output's strides; operand 1: the element's place in the global tensor.
template <class T>
struct PhiloxFn {
  StridedIndex<2> ix;
  T* out;
  RandomKind kind;
  double a, b;
  uint64_t seed;
  uint64_t first;  // stream position of the local tensor's first element
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    int64_t off[2];
    ix.offsets(i, off);
    out[off[0]] = philox_element<T>(seed, kind, a, b, first + uint64_t(off[1]));
  }
};

template <class T>
struct AdamWFn {
  T* w;
  T* m;
  T* v;
  T* vmax;  // null without amsgrad
  const T* g;
  AdamWScalars<T> s;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    adamw_element(w[i], m[i], v[i], vmax ? vmax + i : nullptr, g[i], s);
  }
};

template <class T>
struct SgdFn {
  T* w;
  T* buf;  // null without momentum
  const T* g;
  SgdScalars<T> s;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    sgd_element(w[i], buf ? buf + i : nullptr, g[i], s);
  }
};

// ---- dispatch helpers -------------------------------------------------------------------------

template <class T>
constexpr bool kArithmetic = !std::is_same_v<T, bool>;

// ---- kernels ----------------------------------------------------------------------------------

template <class Exec>
struct Elementwise {
  template <class F>
  static void run(const char* op, const Tensor& where, int64_t n, const F& f) {
    launch<Exec>(op, where.device(), n, f);
  }

  template <class T, class TO, class Fn>
  static void map1(const char* op, const Tensor& out, const Tensor& in, const Shape& in_strides,
                   Fn fn) {
    Map1<T, TO, Fn> f{make_index<2>(op, out.shape(), {&out.strides(), &in_strides}),
                      data_of<TO>(out), data_of<T>(in), fn};
    run(op, out, out.numel(), f);
  }

  template <class T, class TO, class Fn>
  static void map2(const char* op, const Tensor& out, const Tensor& a, const Tensor& b, Fn fn) {
    const Shape as = broadcast_strides(a, out.shape()), bs = broadcast_strides(b, out.shape());
    Map2<T, TO, Fn> f{make_index<3>(op, out.shape(), {&out.strides(), &as, &bs}), data_of<TO>(out),
                      data_of<T>(a), data_of<T>(b), fn};
    run(op, out, out.numel(), f);
  }

  static void copy_(Tensor& dst, const Tensor& src) {
    dispatch_dtype(dst.dtype(), [&]<class D>() {
      dispatch_dtype(src.dtype(), [&]<class S>() {
        CopyFn<D, S> f{make_index<2>("copy_", dst.shape(), {&dst.strides(), &src.strides()}),
                       data_of<D>(dst), data_of<S>(src)};
        run("copy_", dst, dst.numel(), f);
      });
    });
  }

  // One team per run; the table of runs travels to the device once per call.
  static void copy_runs_(Tensor& dst, const Tensor& src, const std::vector<CopyRun>& runs) {
    check_copy_runs(dst, src, runs);
    std::vector<int64_t> table;
    for (const CopyRun& r : runs) {
      if (r.length == 0) continue;
      table.insert(table.end(), {r.src, r.dst, r.length});
    }
    if (table.empty()) return;
    const int64_t k = int64_t(table.size() / 3);
    const Tensor on_device = from_vector<int64_t>(table, {k, 3}).to(dst.device());
    dispatch_width(dst.element_size(), [&]<class W>() {
      CopyRunsFn<W> f{data_of<W>(dst), data_of<W>(src), data_of<int64_t>(on_device)};
      launch_rows<Exec>("copy_runs_", dst.device(), k, f);
    });
  }

  static void fill_(Tensor& t, double value) {
    dispatch_dtype(t.dtype(), [&]<class T>() {
      FillFn<T> f{make_index<1>("fill_", t.shape(), {&t.strides()}), data_of<T>(t),
                  T(static_cast<compute_t<T>>(value))};
      run("fill_", t, t.numel(), f);
    });
  }

  static Tensor unary(UnaryOp op, const Tensor& x) {
    const char* name = unary_name(op);
    check_unary_dtype(name, op, x);
    Tensor out = empty_on(x.shape(), x.dtype(), x.device());
    dispatch_dtype(x.dtype(), [&]<class T>() {
      if constexpr (kArithmetic<T>) map1<T, T>(name, out, x, x.strides(), UnaryFn<T>{op});
    });
    return out;
  }

  static Tensor unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x) {
    const char* name = unary_name(op);
    check_unary_backward(name, grad, x);
    const DType dt = promote_types(grad.dtype(), x.dtype());
    const Tensor g = grad.to(dt), xc = x.to(dt);
    Tensor out = empty_on(x.shape(), dt, x.device());
    dispatch_dtype(dt, [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>)
        map2<T, T>(name, out, g, xc, UnaryGradFn<T>{op});
    });
    return out;
  }

  static Tensor scalar_op(BinaryOp op, const Tensor& a, double s, bool reversed) {
    const char* name = binary_name(op);
    check_scalar_dtype(name, op, a);
    Tensor out = empty_on(a.shape(), a.dtype(), a.device());
    dispatch_dtype(a.dtype(), [&]<class T>() {
      if constexpr (kArithmetic<T>) {
        using C = compute_t<T>;
        map1<T, T>(name, out, a, a.strides(),
                   ScalarFn<T>{op, scalar_as<C>(name, a.dtype(), s), reversed});
      }
    });
    return out;
  }

  static Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
    const char* name = binary_name(op);
    const DType dt = result_type(a, b);
    check_binary_dtype(name, op, dt, a, b);
    const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
    const Tensor ac = a.to(dt), bc = b.to(dt);
    Tensor out = empty_on(shape, dt, a.device());
    dispatch_dtype(dt, [&]<class T>() {
      if constexpr (kArithmetic<T>) map2<T, T>(name, out, ac, bc, BinaryFn<T>{op});
    });
    return out;
  }

  static Tensor binary_scalar(BinaryOp op, const Tensor& a, double s) {
    if (op == BinaryOp::Pow && s == 2.0) return unary(UnaryOp::Square, a);
    return scalar_op(op, a, s, false);
  }

  static Tensor rbinary_scalar(BinaryOp op, double s, const Tensor& a) {
    return scalar_op(op, a, s, true);
  }

  static Tensor compare(CompareOp op, const Tensor& a, const Tensor& b) {
    const char* name = compare_name(op);
    const DType dt = result_type(a, b);
    const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
    const Tensor ac = a.to(dt), bc = b.to(dt);
    Tensor out = empty_on(shape, DType::Bool, a.device());
    dispatch_dtype(dt, [&]<class T>() { map2<T, bool>(name, out, ac, bc, CompareFn<T>{op}); });
    return out;
  }

  static Tensor compare_scalar(CompareOp op, const Tensor& a, double s) {
    const char* name = compare_name(op);
    Tensor out = empty_on(a.shape(), DType::Bool, a.device());
    dispatch_dtype(a.dtype(), [&]<class T>() {
      using C = compute_t<T>;
      // As the CPU: floating tensors compare against the scalar rounded to their own dtype;
      // integers in their own type when the scalar is an integer they hold, else as doubles.
      auto go = [&]<class S>(S sv) {
        map1<T, bool>(name, out, a, a.strides(), CompareScalarFn<T, S>{op, sv});
      };
      if constexpr (std::is_floating_point_v<C>) {
        go(C(T(C(s))));
      } else if constexpr (std::is_same_v<C, bool>) {
        go(double(s));
      } else {
        const bool fits = holds_integer<C>(s);
        if (fits) {
          go(C(s));
        } else {
          go(double(s));
        }
      }
    });
    return out;
  }

  static void add_(Tensor& dst, const Tensor& in, double alpha) {
    const Shape shape = broadcast_shapes(dst.shape(), in.shape(), "add_");
    check_add_(dst, in, shape);
    if (dst.numel() == 0) return;
    const Tensor src = add_source(dst, in);
    dispatch_dtype(dst.dtype(), [&]<class D>() {
      if constexpr (kArithmetic<D>) {
        using C = compute_t<D>;
        const C a = scalar_as<C>("add_", dst.dtype(), alpha);
        // A source of another arithmetic type is converted to the compute type first (never to
        // a 16-bit destination type), so it keeps its precision until the sum's one rounding.
        auto go = [&]<class S>(const Tensor& s) {
          const Shape ss = broadcast_strides(s, shape);
          AddFn<D, S> f{make_index<2>("add_", shape, {&dst.strides(), &ss}), data_of<D>(dst),
                        data_of<S>(s), a};
          run("add_", dst, dst.numel(), f);
        };
        if (compute_dtype(src.dtype()) == DTypeOf<C>::value) {
          dispatch_dtype(src.dtype(), [&]<class S>() {
            if constexpr (std::is_same_v<compute_t<S>, C>) go.template operator()<S>(src);
          });
        } else {
          go.template operator()<C>(src.to(DTypeOf<C>::value));
        }
      }
    });
  }

  static void mul_scalar_(Tensor& dst, double s) {
    check_mul_scalar_(dst);
    dispatch_dtype(dst.dtype(), [&]<class T>() {
      if constexpr (kArithmetic<T>) {
        MulScalarFn<T> f{make_index<1>("mul_scalar_", dst.shape(), {&dst.strides()}),
                         data_of<T>(dst), scalar_as<compute_t<T>>("mul_scalar_", dst.dtype(), s)};
        run("mul_scalar_", dst, dst.numel(), f);
      }
    });
  }

  static Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
    check_bool_mask("where", "condition", cond);
    const DType dt = result_type(a, b);
    const Shape shape =
        broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
    const Tensor ac = a.to(dt), bc = b.to(dt);
    Tensor out = empty_on(shape, dt, a.device());
    const Shape cs = broadcast_strides(cond, shape), as = broadcast_strides(ac, shape),
                bs = broadcast_strides(bc, shape);
    dispatch_width(element_size(dt), [&]<class W>() {
      WhereFn<W> f{make_index<4>("where", shape, {&out.strides(), &cs, &as, &bs}), data_of<W>(out),
                   data_of<uint8_t>(cond), data_of<W>(ac), data_of<W>(bc)};
      run("where", out, out.numel(), f);
    });
    return out;
  }

  static Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
    check_bool_mask("masked_fill", "mask", mask);
    const Shape shape = broadcast_shapes(x.shape(), mask.shape(), "masked_fill");
    TESSERA_CHECK(shape == x.shape(), "masked_fill: mask shape ", shape_str(mask.shape()),
                  " does not broadcast to input shape ", shape_str(x.shape()));
    check_float_fill("masked_fill", x.dtype(), value);
    // The fill value's bits in x's dtype, made on the host and passed by value.
    uint64_t bits = 0;
    dispatch_dtype(x.dtype(), [&]<class T>() {
      T v;
      if constexpr (std::is_same_v<T, bool>) {
        v = value != 0;
      } else {
        v = T(scalar_as<compute_t<T>>("masked_fill", x.dtype(), value));
      }
      std::memcpy(&bits, &v, sizeof(T));
    });
    Tensor out = empty_on(x.shape(), x.dtype(), x.device());
    const Shape ms = broadcast_strides(mask, shape);
    dispatch_width(x.element_size(), [&]<class W>() {
      W v;
      std::memcpy(&v, &bits, sizeof(W));
      MaskedFillFn<W> f{make_index<3>("masked_fill", shape, {&out.strides(), &x.strides(), &ms}),
                        data_of<W>(out), data_of<W>(x), data_of<uint8_t>(mask), v};
      run("masked_fill", out, out.numel(), f);
    });
    return out;
  }

  static void philox_fill(Tensor& out, RandomKind kind, double a, double b, uint64_t seed,
                          uint64_t base, const RandomWindow& window) {
    // Global linear index of local element idx: sum_d (offset_d + idx_d) * gstride_d.
    const Shape gstrides = contiguous_strides(window.global_shape);
    int64_t gbase = 0;
    for (size_t d = 0; d < out.shape().size(); ++d)
      gbase += window.global_offset[d] * gstrides[d];
    dispatch_dtype(out.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>) {
        PhiloxFn<T> f{make_index<2>("philox_fill", out.shape(), {&out.strides(), &gstrides}),
                      data_of<T>(out),
                      kind,
                      a,
                      b,
                      seed,
                      base + uint64_t(gbase)};
        run("philox_fill", out, out.numel(), f);
      }
    });
  }

  static void adamw_update_(Tensor& param, Tensor& exp_avg, Tensor& exp_avg_sq,
                            Tensor& max_exp_avg_sq, const Tensor& grad, const AdamWStep& s) {
    check_update_operand("adamw_update_", param, grad, "gradient");
    check_update_operand("adamw_update_", param, exp_avg, "exp_avg");
    check_update_operand("adamw_update_", param, exp_avg_sq, "exp_avg_sq");
    const bool amsgrad = max_exp_avg_sq.defined();
    if (amsgrad) check_update_operand("adamw_update_", param, max_exp_avg_sq, "max_exp_avg_sq");
    TESSERA_CHECK(param.is_contiguous(), "adamw_update_: parameter ", param.str(),
                  " must be contiguous");
    dispatch_float32_or_64("adamw_update_", "parameter", param, [&]<class T>() {
      const AdamWScalars<T> ts{T(s.decay),     T(1 - s.beta1),       T(s.beta2),
                               T(1 - s.beta2), T(s.step_size),       T(s.bias_correction2_sqrt),
                               T(s.eps),       T(s.l2_weight_decay), s.l2_weight_decay != 0,
                               s.maximize};
      AdamWFn<T> f{data_of<T>(param),      data_of<T>(exp_avg),
                   data_of<T>(exp_avg_sq), amsgrad ? data_of<T>(max_exp_avg_sq) : nullptr,
                   data_of<T>(grad),       ts};
      run("adamw_update_", param, param.numel(), f);
    });
  }

  static void sgd_update_(Tensor& param, Tensor& momentum_buffer, const Tensor& grad,
                          const SgdStep& s) {
    check_update_operand("sgd_update_", param, grad, "gradient");
    if (s.momentum != 0)
      check_update_operand("sgd_update_", param, momentum_buffer, "momentum buffer");
    TESSERA_CHECK(param.is_contiguous(), "sgd_update_: parameter ", param.str(),
                  " must be contiguous");
    dispatch_float32_or_64("sgd_update_", "parameter", param, [&]<class T>() {
      SgdFn<T> f{data_of<T>(param), s.momentum != 0 ? data_of<T>(momentum_buffer) : nullptr,
                 data_of<T>(grad),
                 SgdScalars<T>{T(s.lr), T(s.momentum), T(s.weight_decay), T(1 - s.dampening),
                               s.weight_decay != 0, s.first, s.nesterov, s.maximize}};
      run("sgd_update_", param, param.numel(), f);
    });
  }

  // The kernels above in `table`'s slots; the others stay as they were.
  static void fill_table(registry::KernelTable& table) {
    table.copy_ = &copy_;
    table.fill_ = &fill_;
    table.copy_runs_ = &copy_runs_;
    table.unary = &unary;
    table.unary_backward = &unary_backward;
    table.binary = &binary;
    table.binary_scalar = &binary_scalar;
    table.rbinary_scalar = &rbinary_scalar;
    table.compare = &compare;
    table.compare_scalar = &compare_scalar;
    table.add_ = &add_;
    table.mul_scalar_ = &mul_scalar_;
    table.where = &where;
    table.masked_fill = &masked_fill;
    table.philox_fill = &philox_fill;
    table.adamw_update_ = &adamw_update_;
    table.sgd_update_ = &sgd_update_;
  }
};

}  // namespace tessera::kernels::portable
