// Binary, scalar, comparison, selection and in-place kernels. Operands are promoted to a common
// dtype first (a copy at the operand's own size, never at the broadcast size), so every loop
// below sees one element type and the compiler can specialise and vectorise it.
#include <cmath>
#include <limits>
#include <type_traits>

#include "../portable/composite.h"
#include "../portable/element_checks.h"
#include "../portable/element_ops.h"
#include "../portable/launch.h"
#include "elementwise_loop.h"
#include "kernels.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/core/kernels/views.h"

namespace tessera::kernels::cpu {

namespace {

using cpu::broadcast_strides;
using cpu::check_cpu;
using cpu::map_runs;

using portable::binary_name;
using portable::check_binary_dtype;
using portable::compare_name;
using portable::scalar_as;

using portable::apply_binary;
using portable::apply_compare;

// Calls f.template operator()<kOp>() for the runtime op, for integer element types only with
// the ops integers support (the others are rejected before dispatch).
template <class C, class F>
void with_binary_op(BinaryOp op, F&& f) {
  switch (op) {
    case BinaryOp::Add:
      return f.template operator()<BinaryOp::Add>();
    case BinaryOp::Sub:
      return f.template operator()<BinaryOp::Sub>();
    case BinaryOp::Mul:
      return f.template operator()<BinaryOp::Mul>();
    case BinaryOp::Maximum:
      return f.template operator()<BinaryOp::Maximum>();
    case BinaryOp::Minimum:
      return f.template operator()<BinaryOp::Minimum>();
    case BinaryOp::Div:
      if constexpr (std::is_floating_point_v<C>) return f.template operator()<BinaryOp::Div>();
      break;
    case BinaryOp::Pow:
      if constexpr (std::is_floating_point_v<C>) return f.template operator()<BinaryOp::Pow>();
      break;
  }
  TESSERA_FAIL(binary_name(op), ": not defined for integer tensors");
}

template <class F>
void with_compare_op(CompareOp op, F&& f) {
  switch (op) {
    case CompareOp::Eq:
      return f.template operator()<CompareOp::Eq>();
    case CompareOp::Ne:
      return f.template operator()<CompareOp::Ne>();
    case CompareOp::Lt:
      return f.template operator()<CompareOp::Lt>();
    case CompareOp::Le:
      return f.template operator()<CompareOp::Le>();
    case CompareOp::Gt:
      return f.template operator()<CompareOp::Gt>();
    case CompareOp::Ge:
      return f.template operator()<CompareOp::Ge>();
  }
}

// Arithmetic element types: everything but bool.
template <class T>
constexpr bool kArithmetic = !std::is_same_v<T, bool>;

// a op s (or s op a when `reversed`), for a's dtype.
Tensor scalar_op(BinaryOp op, const Tensor& a, double s, bool reversed) {
  const char* name = binary_name(op);
  check_cpu(name, a);
  const DType dt = a.dtype();
  portable::check_scalar_dtype(name, op, a);
  Tensor out = empty(a.shape(), dt);
  dispatch_dtype(dt, [&]<class T>() {
    if constexpr (kArithmetic<T>) {
      using C = compute_t<T>;
      const C sv = scalar_as<C>(name, dt, s);
      with_binary_op<C>(op, [&]<BinaryOp kOp>() {
        if (reversed) {
          map_runs<T, T, 1>(out, {&a}, {a.strides()},
                            [sv](const std::array<const C*, 1>& in, C* o, int64_t n) {
                              const C* x = in[0];
                              for (int64_t i = 0; i < n; ++i)
                                o[i] = apply_binary<kOp>(sv, x[i]);
                            });
        } else {
          map_runs<T, T, 1>(out, {&a}, {a.strides()},
                            [sv](const std::array<const C*, 1>& in, C* o, int64_t n) {
                              const C* x = in[0];
                              for (int64_t i = 0; i < n; ++i)
                                o[i] = apply_binary<kOp>(x[i], sv);
                            });
        }
      });
    }
  });
  return out;
}

}  // namespace

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* name = binary_name(op);
  check_cpu(name, a);
  check_cpu(name, b);
  const DType dt = result_type(a, b);
  check_binary_dtype(name, op, dt, a, b);
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  const Tensor ac = a.to(dt), bc = b.to(dt);
  Tensor out = empty(shape, dt);
  dispatch_dtype(dt, [&]<class T>() {
    if constexpr (kArithmetic<T>) {
      using C = compute_t<T>;
      with_binary_op<C>(op, [&]<BinaryOp kOp>() {
        map_runs<T, T, 2>(out, {&ac, &bc},
                          {broadcast_strides(ac, shape), broadcast_strides(bc, shape)},
                          [](const std::array<const C*, 2>& in, C* o, int64_t n) {
                            const C* x = in[0];
                            const C* y = in[1];
                            for (int64_t i = 0; i < n; ++i)
                              o[i] = apply_binary<kOp>(x[i], y[i]);
                          });
      });
    }
  });
  return out;
}

Tensor binary_scalar(BinaryOp op, const Tensor& a, double s) {
  if (op == BinaryOp::Pow && s == 2.0) return cpu::unary(UnaryOp::Square, a);
  return scalar_op(op, a, s, false);
}

Tensor rbinary_scalar(BinaryOp op, double s, const Tensor& a) {
  return scalar_op(op, a, s, true);
}

Tensor compare(CompareOp op, const Tensor& a, const Tensor& b) {
  const char* name = compare_name(op);
  check_cpu(name, a);
  check_cpu(name, b);
  const DType dt = result_type(a, b);
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  const Tensor ac = a.to(dt), bc = b.to(dt);
  Tensor out = empty(shape, DType::Bool);
  dispatch_dtype(dt, [&]<class T>() {
    using C = compute_t<T>;
    with_compare_op(op, [&]<CompareOp kOp>() {
      map_runs<T, bool, 2>(out, {&ac, &bc},
                           {broadcast_strides(ac, shape), broadcast_strides(bc, shape)},
                           [](const std::array<const C*, 2>& in, bool* o, int64_t n) {
                             const C* x = in[0];
                             const C* y = in[1];
                             for (int64_t i = 0; i < n; ++i)
                               o[i] = apply_compare<kOp>(x[i], y[i]);
                           });
    });
  });
  return out;
}

Tensor compare_scalar(CompareOp op, const Tensor& a, double s) {
  const char* name = compare_name(op);
  check_cpu(name, a);
  Tensor out = empty(a.shape(), DType::Bool);
  dispatch_dtype(a.dtype(), [&]<class T>() {
    using C = compute_t<T>;
    // Floating tensors compare against the scalar rounded to their own dtype (torch converts it
    // to the tensor's dtype: bfloat16(0.1) == 0.1 holds); integers and bools compare exactly
    // against the double, unless the scalar is an integer they can hold, which keeps the loop in
    // the tensor's own type.
    auto run = [&]<class S>(S sv) {
      with_compare_op(op, [&]<CompareOp kOp>() {
        map_runs<T, bool, 1>(out, {&a}, {a.strides()},
                             [sv](const std::array<const C*, 1>& in, bool* o, int64_t n) {
                               const C* x = in[0];
                               for (int64_t i = 0; i < n; ++i)
                                 o[i] = apply_compare<kOp>(S(x[i]), sv);
                             });
      });
    };
    if constexpr (std::is_floating_point_v<C>) {
      run(C(T(C(s))));
    } else if constexpr (std::is_same_v<C, bool>) {
      run(double(s));
    } else {
      const bool fits = portable::holds_integer<C>(s);
      if (fits) {
        run(C(s));
      } else {
        run(double(s));
      }
    }
  });
  return out;
}

namespace {

template <class D, class S>
void add_runs(Tensor& dst, const Tensor& src, const Shape& src_strides, double alpha) {
  using C = compute_t<D>;
  const C a = scalar_as<C>("add_", dst.dtype(), alpha);
  D* d = static_cast<D*>(dst.raw_data());
  const S* s = static_cast<const S*>(src.raw_data());
  auto combine = [a](D dv, S sv) {
    if constexpr (std::is_integral_v<C>) {
      using U = std::make_unsigned_t<C>;
      return D(C(U(dv) + U(a) * U(C(sv))));
    } else {
      return D(C(dv) + a * C(sv));
    }
  };
  detail::for_each_run<2>(dst.shape(), {&dst.strides(), &src_strides},
                          [&](const detail::Run<2>& r) {
                            D* dp = d + r.offset[0];
                            const S* sp = s + r.offset[1];
                            if (r.stride[0] == 1 && r.stride[1] == 1) {
                              for (int64_t i = 0; i < r.length; ++i)
                                dp[i] = combine(dp[i], sp[i]);
                            } else if (r.stride[0] == 1 && r.stride[1] == 0) {
                              const S v = sp[0];
                              for (int64_t i = 0; i < r.length; ++i)
                                dp[i] = combine(dp[i], v);
                            } else {
                              for (int64_t i = 0; i < r.length; ++i) {
                                D& x = dp[i * r.stride[0]];
                                x = combine(x, sp[i * r.stride[1]]);
                              }
                            }
                          });
}

}  // namespace

void add_(Tensor& dst, const Tensor& in, double alpha) {
  check_cpu("add_", dst);
  check_cpu("add_", in);
  const DType dt = dst.dtype();
  const Shape shape = broadcast_shapes(dst.shape(), in.shape(), "add_");
  portable::check_add_(dst, in, shape);
  if (dst.numel() == 0) return;
  const Tensor src = portable::add_source(dst, in);
  dispatch_dtype(dt, [&]<class D>() {
    if constexpr (kArithmetic<D>) {
      using C = compute_t<D>;
      if (compute_dtype(src.dtype()) == DTypeOf<C>::value) {
        // Same arithmetic type (e.g. a bfloat16 gradient into a float32 buffer): read the
        // source as it is, converting element by element inside the loop.
        dispatch_dtype(src.dtype(), [&]<class S>() {
          if constexpr (std::is_same_v<compute_t<S>, C>) {
            add_runs<D, S>(dst, src, broadcast_strides(src, shape), alpha);
          }
        });
      } else {
        // Converting to the compute type (not to a 16-bit destination type) keeps the source's
        // precision until the single rounding of the sum.
        const Tensor sc = src.to(DTypeOf<C>::value);
        add_runs<D, C>(dst, sc, broadcast_strides(sc, shape), alpha);
      }
    }
  });
}

void mul_scalar_(Tensor& dst, double s) {
  check_cpu("mul_scalar_", dst);
  const DType dt = dst.dtype();
  portable::check_mul_scalar_(dst);
  dispatch_dtype(dt, [&]<class T>() {
    if constexpr (kArithmetic<T>) {
      using C = compute_t<T>;
      const C sv = scalar_as<C>("mul_scalar_", dt, s);
      T* p = static_cast<T*>(dst.raw_data());
      detail::for_each_run<1>(dst.shape(), {&dst.strides()}, [&](const detail::Run<1>& r) {
        T* q = p + r.offset[0];
        const int64_t st = r.stride[0];
        if (st == 1) {
          for (int64_t i = 0; i < r.length; ++i)
            q[i] = T(apply_binary<BinaryOp::Mul>(C(q[i]), sv));
        } else {
          for (int64_t i = 0; i < r.length; ++i)
            q[i * st] = T(apply_binary<BinaryOp::Mul>(C(q[i * st]), sv));
        }
      });
    }
  });
}

namespace {

// Selection only moves bits, so it runs on unsigned words of the element's size (one
// instantiation per width, portable::dispatch_width), reading masks as bytes: that form compiles
// to vector blends, where a data-dependent branch would mispredict on random masks.
using portable::dispatch_width;

template <class W>
inline W blend(uint8_t take_x, W x, W y) {
  return take_x != 0 ? x : y;
}

}  // namespace

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_cpu("where", cond);
  check_cpu("where", a);
  check_cpu("where", b);
  portable::check_bool_mask("where", "condition", cond);
  const DType dt = result_type(a, b);
  const Shape shape =
      broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  const Tensor ac = a.to(dt), bc = b.to(dt);
  Tensor out = empty(shape, dt);
  const Shape cs = broadcast_strides(cond, shape), as = broadcast_strides(ac, shape),
              bs = broadcast_strides(bc, shape);
  dispatch_width(element_size(dt), [&]<class W>() {
    W* o = static_cast<W*>(out.raw_data());
    const uint8_t* c = static_cast<const uint8_t*>(cond.raw_data());
    const W* x = static_cast<const W*>(ac.raw_data());
    const W* y = static_cast<const W*>(bc.raw_data());
    detail::for_each_run<4>(shape, {&out.strides(), &cs, &as, &bs}, [&](const detail::Run<4>& r) {
      W* op = o + r.offset[0];
      const uint8_t* cp = c + r.offset[1];
      const W* xp = x + r.offset[2];
      const W* yp = y + r.offset[3];
      if (r.stride[1] == 1 && r.stride[2] == 1 && r.stride[3] == 1) {
        for (int64_t i = 0; i < r.length; ++i)
          op[i] = blend(cp[i], xp[i], yp[i]);
        return;
      }
      for (int64_t i = 0; i < r.length; ++i)
        op[i] = blend(cp[i * r.stride[1]], xp[i * r.stride[2]], yp[i * r.stride[3]]);
    });
  });
  return out;
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  check_cpu("masked_fill", x);
  check_cpu("masked_fill", mask);
  portable::check_bool_mask("masked_fill", "mask", mask);
  const Shape shape = broadcast_shapes(x.shape(), mask.shape(), "masked_fill");
  TESSERA_CHECK(shape == x.shape(), "masked_fill: mask shape ", shape_str(mask.shape()),
                " does not broadcast to input shape ", shape_str(x.shape()));
  portable::check_float_fill("masked_fill", x.dtype(), value);
  // The fill value as a one-element tensor of x's dtype, whose bits the loop below copies.
  Tensor fill = empty({}, x.dtype());
  dispatch_dtype(x.dtype(), [&]<class T>() {
    if constexpr (std::is_same_v<T, bool>) {
      *fill.data<T>() = value != 0;
    } else {
      *fill.data<T>() = T(scalar_as<compute_t<T>>("masked_fill", x.dtype(), value));
    }
  });
  Tensor out = empty(x.shape(), x.dtype());
  const Shape ms = broadcast_strides(mask, shape);
  dispatch_width(x.element_size(), [&]<class W>() {
    const W v = *static_cast<const W*>(fill.raw_data());
    W* o = static_cast<W*>(out.raw_data());
    const W* xp = static_cast<const W*>(x.raw_data());
    const uint8_t* m = static_cast<const uint8_t*>(mask.raw_data());
    detail::for_each_run<3>(shape, {&out.strides(), &x.strides(), &ms},
                            [&](const detail::Run<3>& r) {
                              W* op = o + r.offset[0];
                              const W* ip = xp + r.offset[1];
                              const uint8_t* mp = m + r.offset[2];
                              if (r.stride[1] == 1 && r.stride[2] == 1) {
                                for (int64_t i = 0; i < r.length; ++i)
                                  op[i] = blend(mp[i], v, ip[i]);
                                return;
                              }
                              for (int64_t i = 0; i < r.length; ++i)
                                op[i] = blend(mp[i * r.stride[2]], v, ip[i * r.stride[1]]);
                            });
  });
  return out;
}

Tensor sum_to_shape(const Tensor& x, const Shape& shape) {
  check_cpu("sum_to_shape", x);
  return portable::sum_to_shape(x, shape);
}

}  // namespace tessera::kernels::cpu
