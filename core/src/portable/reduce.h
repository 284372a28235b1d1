#pragma once
// Private to core: reductions on devices (see kernels.h for executors). One thread per output
// element walks its reduced elements in row-major order, except for the float maxima, minima and
// sums of long rows, which a team of lanes shares (launch.h: launch_rows). Sums accumulate as the
// CPU's do (float64 for floating inputs, wrapping int64 for integers and bools), so results agree
// within one rounding of the exact sum. A few outputs over many elements (a loss, a squared norm)
// would leave all but a few threads idle; there each output's elements are cut into chunks summed
// by separate threads, and a second pass adds the chunks in order, so the result does not depend on
// timing.
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "../kernel_table.h"
#include "element_checks.h"
#include "launch.h"
#include "strided_index.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/core/kernels/views.h"

namespace tessera::kernels::portable {

// Where each output's elements are: `kept` maps an output number (row-major over keep_shape) to
// the output's offset (operand 0) and its first input element (operand 1); `reduced` maps a
// number in [0, count) to the offset of one reduced element from there.
struct ReduceGeometry {
  Shape keep_shape, out_shape;
  int64_t count = 1;
  StridedIndex<2> kept;
  StridedIndex<1> reduced;
};

// Which of x's dims a reduction over `dims` folds (all of them when `dims` is empty); a dim
// named twice is an error. Shared with the CPU's reduction plan.
inline std::vector<bool> reduced_dims(const Tensor& x, const std::vector<int64_t>& dims,
                                      const char* op) {
  const int64_t nd = x.dim();
  std::vector<bool> is_reduced(size_t(nd), dims.empty());
  for (int64_t d : dims) {
    const int64_t w = wrap_dim(d, nd, op);
    if (nd == 0) continue;  // a 0-d tensor accepts dim 0/-1 and has nothing to reduce
    TESSERA_CHECK(!is_reduced[size_t(w)], op, ": dim ", d, " appears more than once in dims ",
                  shape_str(dims));
    is_reduced[size_t(w)] = true;
  }
  return is_reduced;
}

inline ReduceGeometry reduce_geometry(const Tensor& x, const std::vector<int64_t>& dims,
                                      bool keepdim, const char* op) {
  const int64_t nd = x.dim();
  const std::vector<bool> is_reduced = reduced_dims(x, dims, op);
  ReduceGeometry g;
  g.keep_shape = x.shape();
  Shape reduced_shape(size_t(nd), 1);
  for (int64_t d = 0; d < nd; ++d) {
    if (!is_reduced[size_t(d)]) {
      g.out_shape.push_back(x.size(d));
      continue;
    }
    g.count *= x.size(d);
    g.keep_shape[size_t(d)] = 1;
    reduced_shape[size_t(d)] = x.size(d);
    if (keepdim) g.out_shape.push_back(1);
  }
  const Shape out_strides = contiguous_strides(g.keep_shape);
  g.kept = make_index<2>(op, g.keep_shape, {&out_strides, &x.strides()});
  g.reduced = make_index<1>(op, reduced_shape, {&x.strides()});
  return g;
}

// Floating inputs sum in double, integers and bools in uint64 read back as int64: an int64 total
// past its range wraps around as PyTorch's does, where signed overflow would be undefined.
template <class T>
using SumAcc = std::conditional_t<std::is_floating_point_v<compute_t<T>>, double, uint64_t>;

// Partial sums: thread t sums chunk t % chunks of output t / chunks into partial[t].
template <class T>
struct PartialSumFn {
  StridedIndex<2> kept;
  StridedIndex<1> reduced;
  const T* x;
  SumAcc<T>* partial;
  int64_t count, chunks, chunk;
  bool squares;
  TESSERA_HOST_DEVICE void operator()(int64_t t) const {
    const int64_t o = t / chunks, c = t - o * chunks;
    int64_t off[2], roff[1];
    kept.offsets(o, off);
    SumAcc<T> acc = 0;
    const int64_t end = (c + 1) * chunk < count ? (c + 1) * chunk : count;
    for (int64_t r = c * chunk; r < end; ++r) {
      reduced.offsets(r, roff);
      const SumAcc<T> v = SumAcc<T>(x[off[1] + roff[0]]);
      acc += squares ? v * v : v;
    }
    partial[t] = acc;
  }
};

// out[o] = (sum of output o's elements) * scale, the elements shared by a team of lanes that
// each add theirs in float64, then combine (floating inputs only: teams combine floats).
template <class T, class TO>
struct SumRowFn {
  StridedIndex<2> kept;
  StridedIndex<1> reduced;
  const T* x;
  TO* out;
  int64_t count;
  double scale;
  bool squares;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t o, Team& team) const {
    int64_t off[2], roff[1];
    kept.offsets(o, off);
    double acc = 0;
    for (int64_t r = team.lane(); r < count; r += team.size()) {
      reduced.offsets(r, roff);
      const double v = double(x[off[1] + roff[0]]);
      acc += squares ? v * v : v;
    }
    acc = team.sum(acc);
    if (team.lane() == 0) out[o] = TO(compute_t<TO>(acc * scale));
  }
};

// out[o] = (sum of its chunks) * scale, in the output's type.
template <class A, class TO>
struct FinishSumFn {
  const A* partial;
  TO* out;
  int64_t chunks;
  double scale;
  TESSERA_HOST_DEVICE void operator()(int64_t o) const {
    A acc = 0;
    for (int64_t c = 0; c < chunks; ++c)
      acc += partial[o * chunks + c];
    if constexpr (std::is_floating_point_v<A>) {
      out[o] = TO(compute_t<TO>(acc * scale));
    } else {
      out[o] = TO(int64_t(acc));  // modulo 2^64 (C++20)
    }
  }
};

// The better of two candidates for a maximum (kMax) or minimum, NaN winning: associative, so
// the lanes of a team may combine their bests in any grouping.
template <bool kMax>
struct PickExtreme {
  template <class C>
  TESSERA_HOST_DEVICE C operator()(C a, C b) const {
    return (kMax ? b > a : b < a) || b != b ? b : a;
  }
};

// The largest (or smallest) element, NaN winning as in torch.amax, of each output's elements
// shared by a team: each lane keeps the best of the elements it strides over (a lane beyond the
// count starts from element 0, which repeats it harmlessly), then the team combines them.
template <class T, bool kMax>
struct ExtremeRowFn {
  StridedIndex<2> kept;
  StridedIndex<1> reduced;
  const T* x;
  T* out;
  int64_t count;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t o, Team& team) const {
    using C = compute_t<T>;
    int64_t off[2], roff[1];
    kept.offsets(o, off);
    const int64_t first = team.lane() < count ? team.lane() : 0;
    reduced.offsets(first, roff);
    C best = C(x[off[1] + roff[0]]);
    for (int64_t r = first + team.size(); r < count; r += team.size()) {
      reduced.offsets(r, roff);
      best = PickExtreme<kMax>{}(best, C(x[off[1] + roff[0]]));
    }
    best = team.reduce(best, PickExtreme<kMax>{});
    if (team.lane() == 0) out[off[0]] = T(best);
  }
};

// Max along one dim with the index of its first occurrence (NaN counts as the largest).
template <class T>
struct MaxFn {
  StridedIndex<2> kept;  // operand 0: values/indices (contiguous over keep_shape), 1: x
  const T* x;
  T* values;
  int64_t* indices;
  int64_t n, stride;
  TESSERA_HOST_DEVICE void operator()(int64_t o) const {
    using C = compute_t<T>;
    int64_t off[2];
    kept.offsets(o, off);
    C best = C(x[off[1]]);
    int64_t bi = 0;
    for (int64_t k = 1; k < n; ++k) {
      const C v = C(x[off[1] + k * stride]);
      if (v > best || (v != v && best == best)) {
        best = v;
        bi = k;
      }
    }
    values[off[0]] = T(best);
    indices[off[0]] = bi;
  }
};

template <class Exec>
struct Reduce {
  template <class F>
  static void run(const char* op, Device device, int64_t n, const F& f) {
    launch<Exec>(op, device, n, f);
  }

  // Elements per output from which a team shares each float maximum, minimum or sum.
  static constexpr int64_t kTeamCount = 1024;
  // Elements a chunk covers when outputs are too few to keep a device busy.
  static constexpr int64_t kChunk = 4096;
  static constexpr int64_t kBusyThreads = int64_t(1) << 14;

  // sum (or sum of squares) of x over g, times scale, as a tensor of dtype `out_dtype`.
  template <class T>
  static Tensor sum_over(const char* op, const Tensor& x, const ReduceGeometry& g, DType out_dtype,
                         double scale, bool squares) {
    using A = SumAcc<T>;
    Tensor out = empty(g.out_shape, TensorOptions(out_dtype, x.device()));
    const int64_t n_out = shape_numel(g.keep_shape);
    if (n_out == 0) return out;
    int64_t chunks = 1;
    if (n_out < kBusyThreads && g.count > kChunk) {
      chunks = std::min((g.count + kChunk - 1) / kChunk, kBusyThreads / n_out + 1);
    } else if (g.count >= kTeamCount) {
      // Outputs enough to fill a device, or too few elements each to cut into chunks: a team
      // per output instead of one thread walking them all (floats: teams combine floats).
      if constexpr (std::is_floating_point_v<A>) {
        dispatch_dtype(out_dtype, [&]<class TO>() {
          launch_rows<Exec>(op, x.device(), n_out,
                            SumRowFn<T, TO>{g.kept, g.reduced, data_of<T>(x), data_of<TO>(out),
                                            g.count, scale, squares});
        });
        return out;
      }
    }
    const int64_t chunk = std::max<int64_t>((g.count + chunks - 1) / chunks, 1);
    const DType partial_dtype = std::is_floating_point_v<A> ? DType::Float64 : DType::Int64;
    Tensor partial = empty({n_out * chunks}, TensorOptions(partial_dtype, x.device()));
    run(op, x.device(), n_out * chunks,
        PartialSumFn<T>{g.kept, g.reduced, data_of<T>(x), data_of<A>(partial), g.count, chunks,
                        chunk, squares});
    dispatch_dtype(out_dtype, [&]<class TO>() {
      run(op, x.device(), n_out,
          FinishSumFn<A, TO>{data_of<A>(partial), data_of<TO>(out), chunks, scale});
    });
    return out;
  }

  static Tensor sum_impl(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim,
                         bool mean) {
    const char* op = mean ? "mean" : "sum";
    const DType dt = x.dtype();
    if (mean) {
      TESSERA_CHECK(is_floating(dt), "mean: unsupported dtype ", dtype_name(dt),
                    " for input of shape ", shape_str(x.shape()),
                    " (expected a floating dtype; cast integers first)");
    }
    const ReduceGeometry g = reduce_geometry(x, dims, keepdim, op);
    Tensor out;
    dispatch_dtype(dt, [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>) {
        const double scale = !mean          ? 1.0
                             : g.count == 0 ? std::numeric_limits<double>::quiet_NaN()
                                            : 1.0 / double(g.count);
        out = sum_over<T>(op, x, g, dt, scale, false);
      } else {
        out = sum_over<T>(op, x, g, DType::Int64, 1.0, false);
      }
    });
    return out;
  }

  static Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
    return sum_impl(x, dims, keepdim, false);
  }
  static Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
    return sum_impl(x, dims, keepdim, true);
  }

  template <bool kMax>
  static Tensor extreme(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
    const char* op = kMax ? "amax" : "amin";
    const ReduceGeometry g = reduce_geometry(x, dims, keepdim, op);
    const int64_t n_out = shape_numel(g.keep_shape);
    TESSERA_CHECK(g.count > 0, op, ": expected reduction dims ", shape_str(dims),
                  " of a tensor of shape ", shape_str(x.shape()),
                  " to have non-zero size; the result would be undefined");
    Tensor out = empty(g.out_shape, TensorOptions(x.dtype(), x.device()));
    dispatch_dtype(x.dtype(), [&]<class T>() {
      // Teams combine through float slots (and warp shuffles on CUDA): floats only.
      if constexpr (std::is_floating_point_v<compute_t<T>>) {
        if (g.count >= kTeamCount) {
          launch_rows<Exec>(
              op, x.device(), n_out,
              ExtremeRowFn<T, kMax>{g.kept, g.reduced, data_of<T>(x), data_of<T>(out), g.count});
          return;
        }
      }
      run(op, x.device(), n_out,
          OneLaneRows<ExtremeRowFn<T, kMax>>{
              {g.kept, g.reduced, data_of<T>(x), data_of<T>(out), g.count}});
    });
    return out;
  }
  static Tensor amax(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
    return extreme<true>(x, dims, keepdim);
  }
  static Tensor amin(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
    return extreme<false>(x, dims, keepdim);
  }

  static MaxResult max(const Tensor& x, int64_t dim, bool keepdim) {
    const int64_t nd = x.dim();
    const int64_t d = wrap_dim(dim, nd, "max");
    if (nd == 0) return {x.clone(), zeros({}, TensorOptions(DType::Int64, x.device()))};
    const int64_t n = x.size(d);
    TESSERA_CHECK(n > 0, "max: dim ", dim, " of a tensor of shape ", shape_str(x.shape()),
                  " has no elements to take the maximum of");
    Shape keep_shape = x.shape();
    keep_shape[size_t(d)] = 1;
    Tensor values = empty(keep_shape, TensorOptions(x.dtype(), x.device()));
    Tensor indices = empty(keep_shape, TensorOptions(DType::Int64, x.device()));
    const Shape out_strides = contiguous_strides(keep_shape);
    const StridedIndex<2> kept = make_index<2>("max", keep_shape, {&out_strides, &x.strides()});
    dispatch_dtype(x.dtype(), [&]<class T>() {
      run("max", x.device(), values.numel(),
          MaxFn<T>{kept, data_of<T>(x), data_of<T>(values), data_of<int64_t>(indices), n,
                   x.stride(d)});
    });
    if (!keepdim) {
      Shape outer = x.shape();
      outer.erase(outer.begin() + d);
      values = reshape(values, outer);
      indices = reshape(indices, outer);
    }
    return {values, indices};
  }

  static Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
    return max(x, dim, keepdim).indices;
  }

  static Tensor sum_of_squares(const Tensor& x) {
    const ReduceGeometry g = reduce_geometry(x, {}, false, "sum_of_squares");
    Tensor out;
    dispatch_dtype(x.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>)
        out = sum_over<T>("sum_of_squares", x, g, DType::Float64, 1.0, true);
      else
        TESSERA_FAIL("sum_of_squares: needs a floating tensor, got ", x.str());
    });
    return out;
  }

  static void fill_table(registry::KernelTable& table) {
    table.sum = &sum;
    table.mean = &mean;
    table.amax = &amax;
    table.amin = &amin;
    table.max = &max;
    table.argmax = &argmax;
    table.sum_of_squares = &sum_of_squares;
  }
};

}  // namespace tessera::kernels::portable
