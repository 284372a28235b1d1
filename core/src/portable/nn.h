#pragma once
// Private to core: the nn kernels on devices (see kernels.h for executors): softmax and
// log-softmax, RMSNorm and LayerNorm, cross-entropy, rotary embedding, dropout, and the row
// gather/scatter under embedding. Row-wise kernels share each row (or [outer, inner] column of a
// softmax) among the lanes of a team (launch.h: launch_rows), which stride over it and combine
// their partial maxima and sums; the weight gradients of the norms run a thread per feature and
// chunk of rows, adding the chunks in order. The checks are the CPU's (nn_checks.h), and so is each
// formula and its precision: 16-bit inputs compute in float32, norm weight gradients accumulate in
// float64.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "../kernel_table.h"
#include "element_ops.h"
#include "elementwise.h"
#include "launch.h"
#include "nn_checks.h"
#include "reduce.h"
#include "strided_index.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/core/kernels/views.h"
#include "tessera/core/random.h"

namespace tessera::kernels::portable {

// ---- softmax --------------------------------------------------------------------------------

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

// ---- norms ----------------------------------------------------------------------------------

template <class C>
struct RmsNormFn {
  const C* x;
  const C* w;  // null without weight
  C* out;
  C* rstd;
  int64_t d;
  C eps;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t r, Team& team) const {
    const C* xi = x + r * d;
    C ss = 0;
    for (int64_t j = team.lane(); j < d; j += team.size())
      ss += xi[j] * xi[j];
    ss = team.sum(ss);
    const C rs = C(1) / std::sqrt(ss / C(d) + eps);
    if (team.lane() == 0) rstd[r] = rs;
    for (int64_t j = team.lane(); j < d; j += team.size())
      out[r * d + j] = w ? xi[j] * rs * w[j] : xi[j] * rs;
  }
};

template <class C>
struct RmsNormBackwardFn {
  const C* g;
  const C* x;
  const C* w;
  const C* rstd;
  C* gx;
  int64_t d;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t r, Team& team) const {
    const C* gi = g + r * d;
    const C* xi = x + r * d;
    const C rs = rstd[r];
    C dot = 0;
    for (int64_t j = team.lane(); j < d; j += team.size())
      dot += (w ? gi[j] * w[j] : gi[j]) * xi[j];
    dot = team.sum(dot);
    const C k = rs * rs * rs * dot / C(d);
    for (int64_t j = team.lane(); j < d; j += team.size())
      gx[r * d + j] = rs * (w ? gi[j] * w[j] : gi[j]) - k * xi[j];
  }
};

template <class C>
struct LayerNormFn {
  const C* x;
  const C* w;
  const C* b;
  C* out;
  C* mean;
  C* rstd;
  int64_t d;
  C eps;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t r, Team& team) const {
    const C* xi = x + r * d;
    C s = 0;
    for (int64_t j = team.lane(); j < d; j += team.size())
      s += xi[j];
    const C mu = team.sum(s) / C(d);
    C ss = 0;
    for (int64_t j = team.lane(); j < d; j += team.size())
      ss += (xi[j] - mu) * (xi[j] - mu);
    ss = team.sum(ss);
    const C rs = C(1) / std::sqrt(ss / C(d) + eps);
    if (team.lane() == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    for (int64_t j = team.lane(); j < d; j += team.size()) {
      C v = (xi[j] - mu) * rs;
      if (w) v *= w[j];
      if (b) v += b[j];
      out[r * d + j] = v;
    }
  }
};

template <class C>
struct LayerNormBackwardFn {
  const C* g;
  const C* x;
  const C* w;
  const C* mean;
  const C* rstd;
  C* gx;
  int64_t d;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t r, Team& team) const {
    const C* gi = g + r * d;
    const C* xi = x + r * d;
    const C rs = rstd[r], mu = mean[r];
    C sum_g = 0, sum_gx = 0;
    for (int64_t j = team.lane(); j < d; j += team.size()) {
      const C gh = w ? gi[j] * w[j] : gi[j];
      sum_g += gh;
      sum_gx += gh * (xi[j] - mu) * rs;
    }
    const C mean_g = team.sum(sum_g) / C(d), mean_gx = team.sum(sum_gx) / C(d);
    for (int64_t j = team.lane(); j < d; j += team.size()) {
      const C gh = w ? gi[j] * w[j] : gi[j];
      gx[r * d + j] = rs * (gh - mean_g - (xi[j] - mu) * rs * mean_gx);
    }
  }
};

// A norm weight's (or bias's) gradient: column j summed over the rows in order, in float64, by
// chunks of rows: thread t sums chunk t / d of column t % d into out[t] (with one chunk, the
// gradient itself), so that many rows keep many threads busy; ColumnChunksFn adds the chunks.
template <class C>
struct NormColumnFn {
  const C* g;
  const C* x;
  const C* mean;  // null for RMSNorm and for the bias
  const C* rstd;  // null for the bias
  double* out;
  int64_t rows, d, chunk;
  TESSERA_HOST_DEVICE void operator()(int64_t t) const {
    const int64_t c = t / d, j = t - c * d;
    const int64_t end = (c + 1) * chunk < rows ? (c + 1) * chunk : rows;
    double acc = 0;
    for (int64_t r = c * chunk; r < end; ++r) {
      const C gv = g[r * d + j];
      if (!rstd) {
        acc += double(gv);
      } else {
        // The CPU's products: g * xhat for LayerNorm, g * x * rstd for RMSNorm.
        acc += mean ? double(gv * ((x[r * d + j] - mean[r]) * rstd[r]))
                    : double(gv * x[r * d + j] * rstd[r]);
      }
    }
    out[t] = acc;
  }
};

// out[j] = the chunks of column j added in order.
struct ColumnChunksFn {
  const double* partial;  // [chunks, d]
  double* out;
  int64_t chunks, d;
  TESSERA_HOST_DEVICE void operator()(int64_t j) const {
    double acc = 0;
    for (int64_t c = 0; c < chunks; ++c)
      acc += partial[c * d + j];
    out[j] = acc;
  }
};

// ---- cross-entropy --------------------------------------------------------------------------

// Every lane of the row's team returns the same value.
template <class C, class T, class Team>
TESSERA_HOST_DEVICE inline C row_logsumexp(const T* row, int64_t c, Team& team) {
  C m = -infinity<C>();
  for (int64_t j = team.lane(); j < c; j += team.size())
    m = C(row[j]) > m ? C(row[j]) : m;
  m = team.max(m);
  if (std::isinf(m) && m < 0) return m;  // as the CPU: all -inf; +inf gives NaN below
  C s = 0;
  for (int64_t j = team.lane(); j < c; j += team.size())
    s += std::exp(C(row[j]) - m);
  return m + std::log(team.sum(s));
}

// Per row: the loss (0 for ignored rows, target -1) as T, or as float64 for a reduction.
template <class T>
struct CrossEntropyRowFn {
  const T* x;
  const int64_t* target;
  T* loss;          // reduction none
  double* partial;  // reductions sum and mean
  int64_t c;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t i, Team& team) const {
    using C = compute_t<T>;
    C l = 0;
    if (target[i] >= 0) l = row_logsumexp<C>(x + i * c, c, team) - C(x[i * c + target[i]]);
    if (team.lane() != 0) return;
    if (loss) {
      loss[i] = T(l);
    } else {
      partial[i] = double(l);
    }
  }
};

template <class T>
struct DivideTotalFn {
  const double* total;
  T* out;
  double divisor;  // 1 for a sum, the kept rows for a mean (0/0 = NaN when none is kept)
  TESSERA_HOST_DEVICE void operator()(int64_t) const {
    out[0] = T(compute_t<T>(total[0] / divisor));
  }
};

template <class T>
struct CrossEntropyBackwardFn {
  const T* x;
  const int64_t* target;
  const double* grad_loss;  // per row (reduction none) or one value
  T* gx;
  int64_t c;
  bool per_row;
  double divisor;  // 1, or the kept rows for a mean
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t i, Team& team) const {
    using C = compute_t<T>;
    T* grow = gx + i * c;
    const int64_t ti = target[i];
    if (ti < 0) {
      for (int64_t j = team.lane(); j < c; j += team.size())
        grow[j] = T(C(0));
      return;
    }
    const double w = per_row ? grad_loss[i] : grad_loss[0] / divisor;
    const T* row = x + i * c;
    const C lse = row_logsumexp<C>(row, c, team);
    const C scale = C(w);
    for (int64_t j = team.lane(); j < c; j += team.size()) {
      const C p = std::exp(C(row[j]) - lse) - (j == ti ? C(1) : C(0));
      grow[j] = T(p * scale);
    }
  }
};

// ---- rope, dropout --------------------------------------------------------------------------

template <class C>
struct RopeFn {
  const C* x;
  const C* cos;
  const C* sin;
  C* out;
  int64_t seq, heads, half;
  C sign;
  TESSERA_HOST_DEVICE void operator()(int64_t t) const {
    const int64_t pair = t / half, i = t - pair * half;  // pair: ((b * seq + s) * heads + h)
    const int64_t s = (pair / heads) % seq;
    const C c = cos[s * half + i], sn = sign * sin[s * half + i];
    const int64_t base = pair * 2 * half;
    const C x0 = x[base + 2 * i], x1 = x[base + 2 * i + 1];
    out[base + 2 * i] = x0 * c - x1 * sn;
    out[base + 2 * i + 1] = x0 * sn + x1 * c;
  }
};

template <class T>
struct DropoutFn {
  const T* x;
  T* mask;  // Bernoulli draws in, the scaled keep mask out
  T* out;
  T keep;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    using C = compute_t<T>;
    const T m = C(mask[i]) != C(0) ? keep : T(C(0));
    mask[i] = m;
    out[i] = T(C(x[i]) * C(m));
  }
};

// ---- gather and scatter along one dim ---------------------------------------------------------

// out[..., k, ...] = x[..., idx[k], ...]: operand 0 walks out, operand 1 walks x with 0 along dim.
template <class W>
struct IndexSelectFn {
  StridedIndex<2> ix;
  const W* x;
  W* out;
  const int64_t* idx;
  int64_t inner, n, x_dim_stride;
  TESSERA_HOST_DEVICE void operator()(int64_t t) const {
    int64_t off[2];
    ix.offsets(t, off);
    const int64_t k = (t / inner) % n;
    out[off[0]] = x[off[1] + idx[k] * x_dim_stride];
  }
};

// One thread per (outer, inner) column adds src's rows into acc in index order, so repeated
// indices add in the CPU's order and the result does not depend on timing.
template <class T>
struct IndexAddFn {
  const T* src;
  compute_t<T>* acc;
  const int64_t* idx;
  int64_t inner, n, size;
  TESSERA_HOST_DEVICE void operator()(int64_t t) const {
    const int64_t o = t / inner, i = t - o * inner;
    for (int64_t k = 0; k < n; ++k)
      acc[(o * size + idx[k]) * inner + i] += compute_t<T>(src[(o * n + k) * inner + i]);
  }
};

// ---- kernels --------------------------------------------------------------------------------

template <class Exec>
struct Nn {
  template <class F>
  static void run(const char* op, Device device, int64_t n, const F& f) {
    launch<Exec>(op, device, n, f);
  }
  template <class F>
  static void run_rows(const char* op, Device device, int64_t rows, const F& f) {
    launch_rows<Exec>(op, device, rows, f);
  }

  static Tensor on(const Tensor& like, const Shape& shape, DType dt) {
    return empty(shape, TensorOptions(dt, like.device()));
  }
  // A host vector of int64 as a tensor on `like`'s device.
  static Tensor to_device(const std::vector<int64_t>& v, const Tensor& like) {
    return from_vector<int64_t>(v, {int64_t(v.size())}).to(like.device());
  }

  static Tensor softmax_common(const char* op, const Tensor& x, int64_t dim, bool log) {
    check_softmax_input(op, x);
    dim = wrap_dim(dim, x.dim(), op);
    const Tensor xc = x.contiguous();
    Tensor out = on(x, x.shape(), x.dtype());
    if (out.numel() == 0) return out;
    const Geometry g = geometry(x.shape(), dim);
    dispatch_dtype(x.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>)
        run_rows(op, x.device(), g.outer * g.inner,
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
    Tensor gx = on(out, out.shape(), out.dtype());
    if (gx.numel() == 0) return gx;
    const Geometry g = geometry(out.shape(), dim);
    dispatch_dtype(out.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>)
        run_rows(op, out.device(), g.outer * g.inner,
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

  static NormResult rms_norm(const Tensor& x, const Tensor& weight, double eps) {
    const RowLayout r = check_norm_input("rms_norm", x, weight, Tensor());
    TESSERA_CHECK(eps >= 0, "rms_norm: eps must be >= 0, got ", eps);
    const DType cdt = compute_dtype(x.dtype());
    const Tensor xc = in_compute(x, cdt), wc = in_compute(weight, cdt);
    Tensor out = on(x, x.shape(), cdt), rstd = on(x, r.lead, cdt);
    on_compute(cdt, [&]<class C>() {
      run_rows("rms_norm", x.device(), r.rows,
               RmsNormFn<C>{data_of<C>(xc), wc.defined() ? data_of<C>(wc) : nullptr,
                            data_of<C>(out), data_of<C>(rstd), r.d, C(eps)});
    });
    return {out.to(x.dtype()), Tensor(), rstd};
  }

  // Rows a thread adds into one column of a norm's weight gradient.
  static constexpr int64_t kColumnChunk = 256;

  // Column sums of a norm's weight (or bias) gradient, as `dtype`.
  template <class C>
  static Tensor norm_column(const char* op, const Tensor& g, const Tensor& x, const Tensor& mean,
                            const Tensor& rstd, const RowLayout& r, DType dtype) {
    const int64_t chunks = std::max<int64_t>((r.rows + kColumnChunk - 1) / kColumnChunk, 1);
    Tensor partial = on(g, {chunks * r.d}, DType::Float64);
    run(op, g.device(), chunks * r.d,
        NormColumnFn<C>{data_of<C>(g), x.defined() ? data_of<C>(x) : nullptr,
                        mean.defined() ? data_of<C>(mean) : nullptr,
                        rstd.defined() ? data_of<C>(rstd) : nullptr, data_of<double>(partial),
                        r.rows, r.d, kColumnChunk});
    if (chunks == 1) return partial.to(dtype);
    Tensor acc = on(g, {r.d}, DType::Float64);
    run(op, g.device(), r.d,
        ColumnChunksFn{data_of<double>(partial), data_of<double>(acc), chunks, r.d});
    return acc.to(dtype);
  }

  static NormGrads rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                     const Tensor& rstd) {
    const char* op = "rms_norm_backward";
    const RowLayout r = check_norm_input(op, x, weight, Tensor());
    check_norm_backward(op, grad_out, x, rstd, "rstd", r);
    const DType cdt = compute_dtype(x.dtype());
    const Tensor gc = in_compute(grad_out, cdt), xc = in_compute(x, cdt),
                 wc = in_compute(weight, cdt), rc = in_compute(rstd, cdt);
    Tensor grad_x = on(x, x.shape(), cdt);
    NormGrads grads;
    on_compute(cdt, [&]<class C>() {
      run_rows(op, x.device(), r.rows,
               RmsNormBackwardFn<C>{data_of<C>(gc), data_of<C>(xc),
                                    wc.defined() ? data_of<C>(wc) : nullptr, data_of<C>(rc),
                                    data_of<C>(grad_x), r.d});
      if (weight.defined())
        grads.grad_weight = norm_column<C>(op, gc, xc, Tensor(), rc, r, weight.dtype());
    });
    grads.grad_x = grad_x.to(x.dtype());
    return grads;
  }

  static NormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                               double eps) {
    const RowLayout r = check_norm_input("layer_norm", x, weight, bias);
    TESSERA_CHECK(eps >= 0, "layer_norm: eps must be >= 0, got ", eps);
    const DType cdt = compute_dtype(x.dtype());
    const Tensor xc = in_compute(x, cdt), wc = in_compute(weight, cdt), bc = in_compute(bias, cdt);
    Tensor out = on(x, x.shape(), cdt), mean = on(x, r.lead, cdt), rstd = on(x, r.lead, cdt);
    on_compute(cdt, [&]<class C>() {
      run_rows("layer_norm", x.device(), r.rows,
               LayerNormFn<C>{data_of<C>(xc), wc.defined() ? data_of<C>(wc) : nullptr,
                              bc.defined() ? data_of<C>(bc) : nullptr, data_of<C>(out),
                              data_of<C>(mean), data_of<C>(rstd), r.d, C(eps)});
    });
    return {out.to(x.dtype()), mean, rstd};
  }

  static NormGrads layer_norm_backward(const Tensor& grad_out, const Tensor& x,
                                       const Tensor& weight, const Tensor& mean,
                                       const Tensor& rstd) {
    const char* op = "layer_norm_backward";
    const RowLayout r = check_norm_input(op, x, weight, Tensor());
    check_norm_backward(op, grad_out, x, mean, "mean", r);
    check_norm_backward(op, grad_out, x, rstd, "rstd", r);
    const DType cdt = compute_dtype(x.dtype());
    const Tensor gc = in_compute(grad_out, cdt), xc = in_compute(x, cdt),
                 wc = in_compute(weight, cdt), mc = in_compute(mean, cdt),
                 rc = in_compute(rstd, cdt);
    Tensor grad_x = on(x, x.shape(), cdt);
    const DType param_dtype = weight.defined() ? weight.dtype() : x.dtype();
    NormGrads grads;
    on_compute(cdt, [&]<class C>() {
      run_rows(op, x.device(), r.rows,
               LayerNormBackwardFn<C>{data_of<C>(gc), data_of<C>(xc),
                                      wc.defined() ? data_of<C>(wc) : nullptr, data_of<C>(mc),
                                      data_of<C>(rc), data_of<C>(grad_x), r.d});
      if (weight.defined()) grads.grad_weight = norm_column<C>(op, gc, xc, mc, rc, r, param_dtype);
      grads.grad_bias = norm_column<C>(op, gc, Tensor(), Tensor(), Tensor(), r, param_dtype);
    });
    grads.grad_x = grad_x.to(x.dtype());
    return grads;
  }

  static Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                              Reduction reduction) {
    const char* op = "cross_entropy";
    check_cross_entropy_args(op, logits, target);
    const int64_t n = logits.size(0), c = logits.size(1);
    int64_t kept = 0;
    const Tensor t = to_device(class_indices(op, target, c, ignore_index, kept), logits);
    const Tensor x = logits.contiguous();
    const bool none = reduction == Reduction::None;
    Tensor out = on(logits, none ? Shape{n} : Shape{}, logits.dtype());
    dispatch_dtype(logits.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>) {
        if (none) {
          run_rows(op, x.device(), n,
                   CrossEntropyRowFn<T>{data_of<T>(x), data_of<int64_t>(t), data_of<T>(out),
                                        nullptr, c});
          return;
        }
        const Tensor losses = on(logits, {n}, DType::Float64);
        run_rows(op, x.device(), n,
                 CrossEntropyRowFn<T>{data_of<T>(x), data_of<int64_t>(t), nullptr,
                                      data_of<double>(losses), c});
        const Tensor total = Reduce<Exec>::sum(losses, {}, false);
        const double divisor = reduction == Reduction::Sum ? 1.0 : double(kept);
        run(op, x.device(), 1, DivideTotalFn<T>{data_of<double>(total), data_of<T>(out), divisor});
      }
    });
    return out;
  }

  static Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits,
                                       const Tensor& target, int64_t ignore_index,
                                       Reduction reduction) {
    const char* op = "cross_entropy_backward";
    check_cross_entropy_args(op, logits, target);
    const int64_t n = logits.size(0), c = logits.size(1);
    check_cross_entropy_grad(op, grad_loss, n, reduction);
    int64_t kept = 0;
    const Tensor t = to_device(class_indices(op, target, c, ignore_index, kept), logits);
    const Tensor gl = grad_loss.to(DType::Float64).contiguous();
    const Tensor x = logits.contiguous();
    Tensor gx = on(logits, logits.shape(), logits.dtype());
    const double divisor = reduction == Reduction::Mean ? double(kept) : 1.0;
    dispatch_dtype(logits.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>)
        run_rows(
            op, x.device(), n,
            CrossEntropyBackwardFn<T>{data_of<T>(x), data_of<int64_t>(t), data_of<double>(gl),
                                      data_of<T>(gx), c, reduction == Reduction::None, divisor});
    });
    return gx;
  }

  static Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse) {
    const RopeDims r = check_rope(x, cos, sin);
    const DType cdt = compute_dtype(x.dtype());
    auto rows = [&](const Tensor& table) {
      return table.as_strided({r.seq, r.half}, table.strides(), table.storage_offset())
          .to(cdt)
          .contiguous();
    };
    const Tensor xc = x.to(cdt).contiguous(), cc = rows(cos), sc = rows(sin);
    Tensor out = on(x, x.shape(), cdt);
    on_compute(cdt, [&]<class C>() {
      run("rope", x.device(), r.batch * r.seq * r.heads * r.half,
          RopeFn<C>{data_of<C>(xc), data_of<C>(cc), data_of<C>(sc), data_of<C>(out), r.seq, r.heads,
                    r.half, inverse ? C(-1) : C(1)});
    });
    return out.to(x.dtype());
  }

  static DropoutResult dropout(const Tensor& x, double p, Generator& gen) {
    check_dropout(x, p);
    Tensor mask = on(x, x.shape(), x.dtype());
    const uint64_t base = gen.advance(uint64_t(x.numel()));
    tessera::philox_fill(mask, RandomKind::Bernoulli, 1.0 - p, 0.0, gen.seed(), base,
                         {x.shape(), Shape(size_t(x.dim()), 0)});
    const Tensor xc = x.contiguous();
    Tensor out = on(x, x.shape(), x.dtype());
    dispatch_dtype(x.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>) {
        using C = compute_t<T>;
        run("dropout", x.device(), x.numel(),
            DropoutFn<T>{data_of<T>(xc), data_of<T>(mask), data_of<T>(out), T(C(1.0 / (1.0 - p)))});
      }
    });
    return {out, mask};
  }

  static Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
    TESSERA_CHECK(x.defined(), "index_select: undefined input");
    if (x.dim() == 0) {
      check_zero_dim_index_select(x, dim, index);
      return view(index_select(view(x, {1}), 0, index), {});
    }
    dim = wrap_dim(dim, x.dim(), "index_select");
    const std::vector<int64_t> idx = checked_indices("index_select", index, x.size(dim), dim);
    Shape out_shape = x.shape();
    out_shape[size_t(dim)] = int64_t(idx.size());
    Tensor out = on(x, out_shape, x.dtype());
    if (out.numel() == 0) return out;
    const Tensor id = to_device(idx, x);
    Shape xs = x.strides();
    xs[size_t(dim)] = 0;
    int64_t inner = 1;
    for (size_t i = size_t(dim) + 1; i < out_shape.size(); ++i)
      inner *= out_shape[i];
    const StridedIndex<2> ix = make_index<2>("index_select", out_shape, {&out.strides(), &xs});
    dispatch_width(x.element_size(), [&]<class W>() {
      run("index_select", x.device(), out.numel(),
          IndexSelectFn<W>{ix, data_of<W>(x), data_of<W>(out), data_of<int64_t>(id), inner,
                           int64_t(idx.size()), x.stride(dim)});
    });
    return out;
  }

  static Tensor index_add(const Shape& shape, int64_t dim, const Tensor& index, const Tensor& src) {
    TESSERA_CHECK(src.defined(), "index_add: undefined source");
    TESSERA_CHECK(src.dtype() != DType::Bool, "index_add: bool tensors cannot be added");
    if (shape.empty())
      return view(index_add({1}, 0, index, src.dim() == 0 ? view(src, {1}) : src), {});
    dim = wrap_dim(dim, int64_t(shape.size()), "index_add");
    const std::vector<int64_t> idx = checked_indices("index_add", index, shape[size_t(dim)], dim);
    Shape expected = shape;
    expected[size_t(dim)] = int64_t(idx.size());
    TESSERA_CHECK(src.shape() == expected, "index_add: source ", shape_str(src.shape()),
                  " does not match destination ", shape_str(shape), " with ", idx.size(),
                  " indices along dim ", dim, " (expected ", shape_str(expected), ")");
    Tensor acc = zeros(shape, TensorOptions(compute_dtype(src.dtype()), src.device()));
    if (src.numel() == 0) return acc.to(src.dtype());
    const Tensor s = src.contiguous(), id = to_device(idx, src);
    int64_t outer = 1, inner = 1;
    for (int64_t i = 0; i < dim; ++i)
      outer *= shape[size_t(i)];
    for (size_t i = size_t(dim) + 1; i < shape.size(); ++i)
      inner *= shape[i];
    dispatch_dtype(src.dtype(), [&]<class T>() {
      if constexpr (!std::is_same_v<T, bool>)
        run("index_add", src.device(), outer * inner,
            IndexAddFn<T>{data_of<T>(s), data_of<compute_t<T>>(acc), data_of<int64_t>(id), inner,
                          int64_t(idx.size()), shape[size_t(dim)]});
    });
    return acc.to(src.dtype());
  }

  static void fill_table(registry::KernelTable& table) {
    table.softmax = &softmax;
    table.log_softmax = &log_softmax;
    table.softmax_backward = &softmax_backward;
    table.log_softmax_backward = &log_softmax_backward;
    table.rms_norm = &rms_norm;
    table.rms_norm_backward = &rms_norm_backward;
    table.layer_norm = &layer_norm;
    table.layer_norm_backward = &layer_norm_backward;
    table.cross_entropy = &cross_entropy;
    table.cross_entropy_backward = &cross_entropy_backward;
    table.rope = &rope;
    table.dropout = &dropout;
    table.index_select = &index_select;
    table.index_add = &index_add;
  }
};

}  // namespace tessera::kernels::portable
