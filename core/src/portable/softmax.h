#pragma once
// Private to core: softmax and log-softmax and their backward on devices (see kernels.h for
// executors). Each row (or [outer, inner] column) is shared among the lanes of a team (launch.h:
// launch_rows), which stride over it and combine their partial maxima and sums; formulas and
// precision are the CPU's (16-bit inputs compute in float32), and so are the checks (nn_checks.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "../kernel_table.h"
#include "element_ops.h"
#include "launch.h"
#include "nn_checks.h"
#include "nn_launch.h"
#include "strided_index.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/core/kernels/views.h"

namespace tessera::kernels::portable {

template <class T>
struct SoftmaxFn {
  const T* x;
  T* y;
  Geometry g;
  bool log;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t t, Team& team) const {
    using C = compute_t<T>;
    const int64_t o = t / g.inner, i = t - o * g.inner, base = o * g.n * g.inner + i;
    C m = -infinity<C>();
    for (int64_t j = team.lane(); j < g.n; j += team.size()) {
      const C v = C(x[base + j * g.inner]);
      m = v > m ? v : m;
    }
    m = team.max(m);
    C s = 0;
    for (int64_t j = team.lane(); j < g.n; j += team.size())
      s += std::exp(C(x[base + j * g.inner]) - m);
    s = team.sum(s);
    if (log) {
      const C lse = m + std::log(s);
      for (int64_t j = team.lane(); j < g.n; j += team.size())
        y[base + j * g.inner] = T(C(x[base + j * g.inner]) - lse);
    } else {
      const C inv = C(1) / s;
      for (int64_t j = team.lane(); j < g.n; j += team.size())
        y[base + j * g.inner] = T(std::exp(C(x[base + j * g.inner]) - m) * inv);
    }
  }
};

// softmax: gx = y * (g - sum(g * y)); log_softmax: gx = g - exp(y) * sum(g).
template <class T>
struct SoftmaxBackwardFn {
  const T* gy;
  const T* y;
  T* gx;
  Geometry g;
  bool log;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t t, Team& team) const {
    using C = compute_t<T>;
    const int64_t o = t / g.inner, i = t - o * g.inner, base = o * g.n * g.inner + i;
    C acc = 0;
    for (int64_t j = team.lane(); j < g.n; j += team.size()) {
      const int64_t p = base + j * g.inner;
      acc += log ? C(gy[p]) : C(gy[p]) * C(y[p]);
    }
    acc = team.sum(acc);
    for (int64_t j = team.lane(); j < g.n; j += team.size()) {
      const int64_t p = base + j * g.inner;
      gx[p] = log ? T(C(gy[p]) - std::exp(C(y[p])) * acc) : T(C(y[p]) * (C(gy[p]) - acc));
    }
  }
};

template <class Exec>
struct Softmax {
  using L = NnLaunch<Exec>;

  static Tensor softmax_common(const char* op, const Tensor& x, int64_t dim, bool log) {
    check_softmax_input(op, x);
    dim = wrap_dim(dim, x.dim(), op);
    const Tensor xc = x.contiguous();
    Tensor out = L::on(x, x.shape(), x.dtype());
    if (out.numel() == 0) return out;
    const Geometry g = geometry(x.shape(), dim);
    dispatch_dtype(x.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>)
        L::run_rows(op, x.device(), g.outer * g.inner,
                    SoftmaxFn<T>{data_of<T>(xc), data_of<T>(out), g, log});
    });
    return out;
  }
  static Tensor softmax(const Tensor& x, int64_t dim) {
    return softmax_common("softmax", x, dim, false);
  }
  static Tensor log_softmax(const Tensor& x, int64_t dim) {
    return softmax_common("log_softmax", x, dim, true);
  }

  static Tensor softmax_backward_common(const char* op, const Tensor& grad_out, const Tensor& out,
                                        int64_t dim, bool log) {
    check_softmax_input(op, out);
    TESSERA_CHECK(grad_out.defined() && grad_out.shape() == out.shape(), op, ": grad_out ",
                  grad_out.defined() ? shape_str(grad_out.shape()) : "undefined",
                  " does not match the forward output ", shape_str(out.shape()));
    dim = wrap_dim(dim, out.dim(), op);
    const Tensor yc = out.contiguous();
    const Tensor gc =
        grad_out.dtype() == out.dtype() ? grad_out.contiguous() : grad_out.to(out.dtype());
    Tensor gx = L::on(out, out.shape(), out.dtype());
    if (gx.numel() == 0) return gx;
    const Geometry g = geometry(out.shape(), dim);
    dispatch_dtype(out.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>)
        L::run_rows(op, out.device(), g.outer * g.inner,
                    SoftmaxBackwardFn<T>{data_of<T>(gc), data_of<T>(yc), data_of<T>(gx), g, log});
    });
    return gx;
  }
  static Tensor softmax_backward(const Tensor& grad_out, const Tensor& out, int64_t dim) {
    return softmax_backward_common("softmax_backward", grad_out, out, dim, false);
  }
  static Tensor log_softmax_backward(const Tensor& grad_out, const Tensor& out, int64_t dim) {
    return softmax_backward_common("log_softmax_backward", grad_out, out, dim, true);
  }

  static void fill_table(registry::KernelTable& table) {
    table.softmax = &softmax;
    table.log_softmax = &log_softmax;
    table.softmax_backward = &softmax_backward;
    table.log_softmax_backward = &log_softmax_backward;
  }
};

}  // namespace tessera::kernels::portable
