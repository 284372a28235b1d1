// Softmax and log-softmax over any dim, with their backward kernels. The input is viewed as
// [outer, n, inner] with the reduced dim in the middle. When inner == 1 each row is contiguous
// and is handled on its own; otherwise the inner index is the fastest one, so the per-column
// maxima and sums are kept in small buffers and every pass walks memory sequentially.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../portable/nn_checks.h"
#include "kernels.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/nn.h"

namespace tessera::kernels::cpu {

namespace {

using portable::Geometry;
using portable::geometry;

// y = softmax(x) or log_softmax(x) along n, for x and y contiguous [outer, n, inner].
template <class T, bool kLog>
void softmax_forward(const T* x, T* y, const Geometry& g) {
  using C = compute_t<T>;
  // Float types keep exp(x - max) in y and rescale it; 16-bit types recompute it instead, so
  // that rounding to T happens once.
  constexpr bool kStoreExp = std::is_same_v<T, C> && !kLog;
  const C kNegInf = -std::numeric_limits<C>::infinity();
  std::vector<C> mx(size_t(g.inner)), sum(size_t(g.inner));
  for (int64_t o = 0; o < g.outer; ++o) {
    const T* xo = x + o * g.n * g.inner;
    T* yo = y + o * g.n * g.inner;
    if (g.inner == 1) {
      C m = kNegInf;
      for (int64_t j = 0; j < g.n; ++j)
        m = std::max(m, C(xo[j]));
      C s = 0;
      for (int64_t j = 0; j < g.n; ++j) {
        C e = std::exp(C(xo[j]) - m);
        if constexpr (kStoreExp) yo[j] = e;
        s += e;
      }
      if constexpr (kLog) {
        C lse = m + std::log(s);
        for (int64_t j = 0; j < g.n; ++j)
          yo[j] = T(C(xo[j]) - lse);
      } else if constexpr (kStoreExp) {
        C inv = C(1) / s;
        for (int64_t j = 0; j < g.n; ++j)
          yo[j] *= inv;
      } else {
        C inv = C(1) / s;
        for (int64_t j = 0; j < g.n; ++j)
          yo[j] = T(std::exp(C(xo[j]) - m) * inv);
      }
      continue;
    }
    std::fill(mx.begin(), mx.end(), kNegInf);
    std::fill(sum.begin(), sum.end(), C(0));
    for (int64_t j = 0; j < g.n; ++j)
      for (int64_t i = 0; i < g.inner; ++i)
        mx[i] = std::max(mx[i], C(xo[j * g.inner + i]));
    for (int64_t j = 0; j < g.n; ++j) {
      for (int64_t i = 0; i < g.inner; ++i) {
        C e = std::exp(C(xo[j * g.inner + i]) - mx[i]);
        if constexpr (kStoreExp) yo[j * g.inner + i] = e;
        sum[i] += e;
      }
    }
    if constexpr (kLog) {
      for (int64_t i = 0; i < g.inner; ++i)
        mx[i] += std::log(sum[i]);  // now the logsumexp
      for (int64_t j = 0; j < g.n; ++j)
        for (int64_t i = 0; i < g.inner; ++i)
          yo[j * g.inner + i] = T(C(xo[j * g.inner + i]) - mx[i]);
    } else {
      for (int64_t i = 0; i < g.inner; ++i)
        sum[i] = C(1) / sum[i];
      for (int64_t j = 0; j < g.n; ++j) {
        for (int64_t i = 0; i < g.inner; ++i) {
          if constexpr (kStoreExp)
            yo[j * g.inner + i] *= sum[i];
          else
            yo[j * g.inner + i] = T(std::exp(C(xo[j * g.inner + i]) - mx[i]) * sum[i]);
        }
      }
    }
  }
}

// softmax:     gx = y * (g - sum(g * y))
// log_softmax: gx = g - exp(y) * sum(g)
template <class T, bool kLog>
void softmax_backward_impl(const T* gy, const T* y, T* gx, const Geometry& g) {
  using C = compute_t<T>;
  std::vector<C> acc(size_t(g.inner));
  for (int64_t o = 0; o < g.outer; ++o) {
    const int64_t base = o * g.n * g.inner;
    std::fill(acc.begin(), acc.end(), C(0));
    for (int64_t j = 0; j < g.n; ++j) {
      for (int64_t i = 0; i < g.inner; ++i) {
        int64_t p = base + j * g.inner + i;
        if constexpr (kLog)
          acc[i] += C(gy[p]);
        else
          acc[i] += C(gy[p]) * C(y[p]);
      }
    }
    for (int64_t j = 0; j < g.n; ++j) {
      for (int64_t i = 0; i < g.inner; ++i) {
        int64_t p = base + j * g.inner + i;
        if constexpr (kLog)
          gx[p] = T(C(gy[p]) - std::exp(C(y[p])) * acc[i]);
        else
          gx[p] = T(C(y[p]) * (C(gy[p]) - acc[i]));
      }
    }
  }
}

template <bool kLog>
Tensor softmax_common(const char* op, const Tensor& x, int64_t dim) {
  portable::check_softmax_input(op, x);
  dim = wrap_dim(dim, x.dim(), op);
  Tensor xc = x.contiguous();
  Tensor out = empty(x.shape(), x.dtype());
  if (out.numel() == 0) return out;
  Geometry g = geometry(x.shape(), dim);
  dispatch_dtype(x.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>)
      softmax_forward<T, kLog>(xc.data<T>(), out.data<T>(), g);
  });
  return out;
}

template <bool kLog>
Tensor softmax_backward_common(const char* op, const Tensor& grad_out, const Tensor& out,
                               int64_t dim) {
  portable::check_softmax_input(op, out);
  TESSERA_CHECK(grad_out.defined() && grad_out.shape() == out.shape(), op, ": grad_out ",
                grad_out.defined() ? shape_str(grad_out.shape()) : "undefined",
                " does not match the forward output ", shape_str(out.shape()));
  dim = wrap_dim(dim, out.dim(), op);
  Tensor yc = out.contiguous();
  Tensor gc = grad_out.dtype() == out.dtype() ? grad_out.contiguous() : grad_out.to(out.dtype());
  Tensor gx = empty(out.shape(), out.dtype());
  if (gx.numel() == 0) return gx;
  Geometry g = geometry(out.shape(), dim);
  dispatch_dtype(out.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>)
      softmax_backward_impl<T, kLog>(gc.data<T>(), yc.data<T>(), gx.data<T>(), g);
  });
  return gx;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  return softmax_common<false>("softmax", x, dim);
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  return softmax_common<true>("log_softmax", x, dim);
}

Tensor softmax_backward(const Tensor& grad_out, const Tensor& out, int64_t dim) {
  return softmax_backward_common<false>("softmax_backward", grad_out, out, dim);
}

Tensor log_softmax_backward(const Tensor& grad_out, const Tensor& out, int64_t dim) {
  return softmax_backward_common<true>("log_softmax_backward", grad_out, out, dim);
}

}  // namespace tessera::kernels::cpu
