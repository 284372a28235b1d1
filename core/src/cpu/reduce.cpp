// Reductions. The dims of the input are visited in its memory order (largest stride outermost),
// so each inner run is either a contiguous stretch of one reduction ("horizontal": folded into a
// single accumulator) or a contiguous stretch of independent outputs ("vertical": an
// elementwise update of a row of accumulators). Both are unit-stride loops whatever the layout.
//
// Floating sums accumulate in double, including for float32: the result is then within one
// rounding of the exact sum whatever the length or layout, which keeps a sum over a sharded
// tensor equal to the same sum computed unsharded.
#include <algorithm>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>

#include "../portable/reduce.h"
#include "elementwise_loop.h"
#include "kernels.h"
#include "tessera/core/detail/strided_loop.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/reduce.h"

namespace tessera::kernels::cpu {

namespace {

template <class T>
constexpr bool is_nan(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    return v != v;
  } else {
    (void)v;
    return false;
  }
}

struct ReducePlan {
  Shape keep_shape;  // x's shape with the reduced dims set to 1
  Shape out_shape;   // keep_shape, or without the reduced dims
  // Iteration space in x's memory order; out strides are 0 along reduced dims.
  Shape sizes, x_strides, out_strides;
  int64_t count = 1;  // elements folded into each output
};

ReducePlan plan_reduce(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim,
                       const char* op) {
  const int64_t nd = x.dim();
  const std::vector<bool> reduced = portable::reduced_dims(x, dims, op);
  ReducePlan p;
  p.keep_shape = x.shape();
  for (int64_t d = 0; d < nd; ++d) {
    if (!reduced[size_t(d)]) {
      p.out_shape.push_back(x.size(d));
      continue;
    }
    p.count *= x.size(d);
    p.keep_shape[size_t(d)] = 1;
    if (keepdim) p.out_shape.push_back(1);
  }
  const Shape keep_strides = contiguous_strides(p.keep_shape);
  std::vector<int64_t> order(static_cast<size_t>(nd));
  std::iota(order.begin(), order.end(), 0);
  auto out_stride = [&](int64_t d) { return reduced[size_t(d)] ? 0 : keep_strides[size_t(d)]; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (x.stride(a) != x.stride(b)) return x.stride(a) > x.stride(b);
    return out_stride(a) > out_stride(b);
  });
  for (int64_t d : order) {
    p.sizes.push_back(x.size(d));
    p.x_strides.push_back(x.stride(d));
    p.out_strides.push_back(out_stride(d));
  }
  return p;
}

// The plan's iteration space with size-1 dims dropped and neighbours merged where both x and
// the accumulators are contiguous across them (the same rule as detail::for_each_run).
struct Collapsed {
  Shape sizes, x_strides, out_strides;
};
Collapsed collapse(const ReducePlan& p) {
  Collapsed c;
  for (size_t d = 0; d < p.sizes.size(); ++d) {
    if (p.sizes[d] == 1) continue;
    if (!c.sizes.empty() && c.x_strides.back() == p.x_strides[d] * p.sizes[d] &&
        c.out_strides.back() == p.out_strides[d] * p.sizes[d]) {
      c.sizes.back() *= p.sizes[d];
      c.x_strides.back() = p.x_strides[d];
      c.out_strides.back() = p.out_strides[d];
      continue;
    }
    c.sizes.push_back(p.sizes[d]);
    c.x_strides.push_back(p.x_strides[d]);
    c.out_strides.push_back(p.out_strides[d]);
  }
  return c;
}

// Folds x into acc (one accumulator per output, row-major over keep_shape).
// horizontal(acc, ptr, stride, n) returns acc folded with n elements; vertical(acc, ptr, n)
// folds ptr[i] into acc[i] (both unit stride); update(acc&, value) folds one element.
// The two innermost dims are looped here rather than by for_each_run, so that short inner runs
// (a [N, 4] tensor) do not pay the N-d loop's bookkeeping once per run.
template <class T, class A, class Horizontal, class Vertical, class Update>
void reduce_runs(const Tensor& x, const ReducePlan& p, A* acc, Horizontal&& horizontal,
                 Vertical&& vertical, Update&& update) {
  if (shape_numel(p.sizes) == 0) return;
  Collapsed c = collapse(p);
  while (c.sizes.size() < 2) {
    c.sizes.insert(c.sizes.begin(), 1);
    c.x_strides.insert(c.x_strides.begin(), 0);
    c.out_strides.insert(c.out_strides.begin(), 0);
  }
  const size_t nd = c.sizes.size();
  const int64_t rows = c.sizes[nd - 2], len = c.sizes[nd - 1];
  const int64_t xr = c.x_strides[nd - 2], ar = c.out_strides[nd - 2];
  const int64_t xs = c.x_strides[nd - 1], as = c.out_strides[nd - 1];
  const Shape outer(c.sizes.begin(), c.sizes.end() - 2);
  const Shape outer_xs(c.x_strides.begin(), c.x_strides.end() - 2);
  const Shape outer_as(c.out_strides.begin(), c.out_strides.end() - 2);
  const T* base = static_cast<const T*>(x.raw_data());
  detail::for_each_run<2>(outer, {&outer_xs, &outer_as}, [&](const detail::Run<2>& r) {
    for (int64_t o = 0; o < r.length; ++o) {
      const T* xo = base + r.offset[0] + o * r.stride[0];
      A* ao = acc + r.offset[1] + o * r.stride[1];
      for (int64_t row = 0; row < rows; ++row) {
        const T* xp = xo + row * xr;
        A* ap = ao + row * ar;
        if (as == 0) {
          *ap = horizontal(*ap, xp, xs, len);
        } else if (xs == 1 && as == 1) {
          vertical(ap, xp, len);
        } else {
          for (int64_t i = 0; i < len; ++i)
            update(ap[i * as], xp[i * xs]);
        }
      }
    }
  });
}

// Sums in accumulator type A with independent lanes, which the compiler maps onto vector
// registers (a single running sum would serialise on the add latency).
template <class A, class T>
A sum_run(A acc, const T* p, int64_t s, int64_t n) {
  if (s != 1) {
    for (int64_t i = 0; i < n; ++i)
      acc += A(to_compute(p[i * s]));
    return acc;
  }
  constexpr int kLanes = 16;
  if (n < kLanes) {
    for (int64_t i = 0; i < n; ++i)
      acc += A(to_compute(p[i]));
    return acc;
  }
  A lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k)
      lane[k] += A(to_compute(p[i + k]));
  for (; i < n; ++i)
    acc += A(to_compute(p[i]));
  A total = 0;
  for (int k = 0; k < kLanes; ++k)
    total += lane[k];
  return acc + total;
}

template <bool kMax, class C>
inline C pick(C best, C v) {
  // NaN wins, as in torch.amax. Bitwise | keeps the select branch-free (and vectorisable).
  if constexpr (kMax) {
    return ((v > best) | is_nan(v)) ? v : best;
  } else {
    return ((v < best) | is_nan(v)) ? v : best;
  }
}

template <bool kMax, class C, class T>
C extreme_run(C acc, const T* p, int64_t s, int64_t n) {
  constexpr int kLanes = 32;
  if (s != 1 || n < kLanes) {
    for (int64_t i = 0; i < n; ++i)
      acc = pick<kMax>(acc, C(to_compute(p[i * s])));
    return acc;
  }
  // The lanes use the plain compare-select (one vector max/min instruction) and track NaNs in
  // separate flags: folding the NaN test into the select defeats the vectoriser.
  C lane[kLanes];
  uint32_t nan[kLanes] = {};
  std::fill(lane, lane + kLanes, acc);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const C v = C(to_compute(p[i + k]));
      if constexpr (kMax) {
        lane[k] = v > lane[k] ? v : lane[k];
      } else {
        lane[k] = v < lane[k] ? v : lane[k];
      }
      nan[k] |= uint32_t(is_nan(v));
    }
  }
  for (; i < n; ++i)
    acc = pick<kMax>(acc, C(to_compute(p[i])));
  bool any_nan = false;
  for (int k = 0; k < kLanes; ++k) {
    acc = pick<kMax>(acc, lane[k]);
    any_nan = any_nan || nan[k] != 0;
  }
  if constexpr (std::numeric_limits<C>::has_quiet_NaN) {
    if (any_nan) return std::numeric_limits<C>::quiet_NaN();
  }
  return acc;
}

// The result tensor for a plan, filled from the accumulators with `finish`.
template <class TO, class A, class F>
Tensor finish_output(const ReducePlan& p, DType dt, const A* acc, F&& finish) {
  Tensor out = empty(p.out_shape, dt);
  TO* o = static_cast<TO*>(out.raw_data());
  const int64_t n = out.numel();
  for (int64_t i = 0; i < n; ++i)
    o[i] = TO(finish(acc[i]));
  return out;
}

// Accumulators are plain arrays: std::vector<bool> has no data().
template <class A>
std::unique_ptr<A[]> filled(int64_t n, A value) {
  std::unique_ptr<A[]> a(new A[size_t(n)]);
  std::fill(a.get(), a.get() + n, value);
  return a;
}

// Sum (or mean when `mean`) of x over the plan's dims.
Tensor sum_impl(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, bool mean) {
  const char* op = mean ? "mean" : "sum";
  check_cpu(op, x);
  const DType dt = x.dtype();
  if (mean) {
    TESSERA_CHECK(is_floating(dt), "mean: unsupported dtype ", dtype_name(dt),
                  " for input of shape ", shape_str(x.shape()),
                  " (expected a floating dtype; cast integers first)");
  }
  const ReducePlan p = plan_reduce(x, dims, keepdim, op);
  const int64_t n_out = shape_numel(p.keep_shape);
  Tensor out;
  dispatch_dtype(dt, [&]<class T>() {
    // Integers add in uint64: a total past int64's range wraps around as PyTorch's does, where
    // signed overflow would be undefined.
    using A = std::conditional_t<std::is_floating_point_v<compute_t<T>>, double, uint64_t>;
    const std::unique_ptr<A[]> acc = filled(n_out, A(0));
    reduce_runs<T>(
        x, p, acc.get(),
        [](A a, const T* xp, int64_t s, int64_t n) { return sum_run<A>(a, xp, s, n); },
        [](A* ap, const T* xp, int64_t n) {
          for (int64_t i = 0; i < n; ++i)
            ap[i] += A(to_compute(xp[i]));
        },
        [](A& a, T v) { a += A(to_compute(v)); });
    if constexpr (std::is_floating_point_v<A>) {
      // 0/0 = NaN for the mean of nothing, as in torch.
      const double scale = mean ? 1.0 / double(p.count) : 1.0;
      if (mean && p.count == 0) {
        out = finish_output<T>(p, dt, acc.get(), [](double) {
          return compute_t<T>(std::numeric_limits<double>::quiet_NaN());
        });
      } else {
        out = finish_output<T>(p, dt, acc.get(),
                               [scale](double a) { return compute_t<T>(a * scale); });
      }
    } else {
      // Integer and bool sums are int64, like torch.sum: int32 totals overflow too easily.
      // uint64 to int64 is modulo 2^64 (C++20).
      out =
          finish_output<int64_t>(p, DType::Int64, acc.get(), [](uint64_t a) { return int64_t(a); });
    }
  });
  return out;
}

template <bool kMax>
Tensor extreme_impl(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  const char* op = kMax ? "amax" : "amin";
  check_cpu(op, x);
  const ReducePlan p = plan_reduce(x, dims, keepdim, op);
  // As PyTorch, an empty reduced dim is an error even when no output would read it.
  TESSERA_CHECK(p.count > 0, op, ": expected reduction dims ", shape_str(dims),
                " of a tensor of shape ", shape_str(x.shape()),
                " to have non-zero size; the result would be undefined");
  Tensor out;
  dispatch_dtype(x.dtype(), [&]<class T>() {
    using C = compute_t<T>;
    const C init =
        std::numeric_limits<C>::has_infinity
            ? (kMax ? -std::numeric_limits<C>::infinity() : std::numeric_limits<C>::infinity())
            : (kMax ? std::numeric_limits<C>::lowest() : std::numeric_limits<C>::max());
    const std::unique_ptr<C[]> acc = filled(shape_numel(p.keep_shape), init);
    reduce_runs<T>(
        x, p, acc.get(),
        [](C a, const T* xp, int64_t s, int64_t n) { return extreme_run<kMax>(a, xp, s, n); },
        [](C* ap, const T* xp, int64_t n) {
          for (int64_t i = 0; i < n; ++i)
            ap[i] = pick<kMax>(ap[i], C(to_compute(xp[i])));
        },
        [](C& a, T v) { a = pick<kMax>(a, C(to_compute(v))); });
    out = finish_output<T>(p, x.dtype(), acc.get(), [](C a) { return a; });
  });
  return out;
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return sum_impl(x, dims, keepdim, false);
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return sum_impl(x, dims, keepdim, true);
}

Tensor amax(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return extreme_impl<true>(x, dims, keepdim);
}

Tensor amin(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return extreme_impl<false>(x, dims, keepdim);
}

MaxResult max(const Tensor& x, int64_t dim, bool keepdim) {
  check_cpu("max", x);
  const int64_t nd = x.dim();
  const int64_t d = wrap_dim(dim, nd, "max");
  if (nd == 0) return {x.clone(), zeros({}, DType::Int64)};
  const int64_t n = x.size(d);
  TESSERA_CHECK(n > 0, "max: dim ", dim, " of a tensor of shape ", shape_str(x.shape()),
                " has no elements to take the maximum of");
  // Outer space: every dim but `d`, in logical order (outputs are contiguous over it).
  Shape outer, xs;
  for (int64_t i = 0; i < nd; ++i) {
    if (i == d) continue;
    outer.push_back(x.size(i));
    xs.push_back(x.stride(i));
  }
  Shape keep_shape = x.shape();
  keep_shape[size_t(d)] = 1;
  Tensor values = empty(keep_shape, x.dtype());
  Tensor indices = empty(keep_shape, DType::Int64);
  const Shape os = contiguous_strides(outer);
  const int64_t sd = x.stride(d);
  // The scan along `d` is unit-stride when `d` has the smallest stride; otherwise sweeping whole
  // slices x[..., k, ...] one k at a time keeps the accesses sequential.
  bool d_innermost = true;
  for (int64_t i = 0; i < nd; ++i)
    if (i != d && x.size(i) > 1 && x.stride(i) < sd) d_innermost = false;
  dispatch_dtype(x.dtype(), [&]<class T>() {
    using C = compute_t<T>;
    const T* xb = static_cast<const T*>(x.raw_data());
    T* vb = values.data<T>();
    int64_t* ib = indices.data<int64_t>();
    // First maximum wins; a NaN beats every number and the first NaN wins among NaNs.
    auto better = [](C v, C best) { return v > best || (is_nan(v) && !is_nan(best)); };
    if (d_innermost) {
      detail::for_each_run<2>(outer, {&xs, &os}, [&](const detail::Run<2>& r) {
        for (int64_t j = 0; j < r.length; ++j) {
          const T* p = xb + r.offset[0] + j * r.stride[0];
          C best = C(to_compute(p[0]));
          int64_t bi = 0;
          for (int64_t k = 1; k < n; ++k) {
            const C v = C(to_compute(p[k * sd]));
            if (better(v, best)) {
              best = v;
              bi = k;
            }
          }
          vb[r.offset[1] + j * r.stride[1]] = T(best);
          ib[r.offset[1] + j * r.stride[1]] = bi;
        }
      });
      return;
    }
    const int64_t n_out = shape_numel(outer);
    const std::unique_ptr<C[]> best = filled(n_out, C(0));
    std::fill(ib, ib + n_out, int64_t(0));
    for (int64_t k = 0; k < n; ++k) {
      detail::for_each_run<2>(outer, {&xs, &os}, [&](const detail::Run<2>& r) {
        const T* p = xb + k * sd + r.offset[0];
        C* bp = best.get() + r.offset[1];
        int64_t* ip = ib + r.offset[1];
        for (int64_t j = 0; j < r.length; ++j) {
          const C v = C(to_compute(p[j * r.stride[0]]));
          if (k == 0 || better(v, bp[j * r.stride[1]])) {
            bp[j * r.stride[1]] = v;
            ip[j * r.stride[1]] = k;
          }
        }
      });
    }
    for (int64_t j = 0; j < n_out; ++j)
      vb[j] = T(best[j]);
  });
  if (!keepdim) {
    values = values.as_strided(outer, os, 0);
    indices = indices.as_strided(outer, os, 0);
  }
  return {values, indices};
}

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  return max(x, dim, keepdim).indices;
}

}  // namespace tessera::kernels::cpu
