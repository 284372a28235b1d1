#pragma once
// Private to core: RMSNorm and LayerNorm and their backward on devices (see kernels.h for
// executors). Each row is shared among the lanes of a team (launch.h: launch_rows); the weight
// gradients run a thread per feature and chunk of rows, adding the chunks in order. Formulas and
// precision are the CPU's (16-bit inputs compute in float32, weight gradients accumulate in
// float64), and so are the checks (nn_checks.h).
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

template <class Exec>
struct Norm {
  using L = NnLaunch<Exec>;

  static NormResult rms_norm(const Tensor& x, const Tensor& weight, double eps) {
    const RowLayout r = check_norm_input("rms_norm", x, weight, Tensor());
    TESSERA_CHECK(eps >= 0, "rms_norm: eps must be >= 0, got ", eps);
    const DType cdt = compute_dtype(x.dtype());
    const Tensor xc = in_compute(x, cdt), wc = in_compute(weight, cdt);
    Tensor out = L::on(x, x.shape(), cdt), rstd = L::on(x, r.lead, cdt);
    on_compute(cdt, [&]<class C>() {
      L::run_rows("rms_norm", x.device(), r.rows,
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
    Tensor partial = L::on(g, {chunks * r.d}, DType::Float64);
    L::run(op, g.device(), chunks * r.d,
           NormColumnFn<C>{data_of<C>(g), x.defined() ? data_of<C>(x) : nullptr,
                           mean.defined() ? data_of<C>(mean) : nullptr,
                           rstd.defined() ? data_of<C>(rstd) : nullptr, data_of<double>(partial),
                           r.rows, r.d, kColumnChunk});
    if (chunks == 1) return partial.to(dtype);
    Tensor acc = L::on(g, {r.d}, DType::Float64);
    L::run(op, g.device(), r.d,
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
    Tensor grad_x = L::on(x, x.shape(), cdt);
    NormGrads grads;
    on_compute(cdt, [&]<class C>() {
      L::run_rows(op, x.device(), r.rows,
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
    Tensor out = L::on(x, x.shape(), cdt), mean = L::on(x, r.lead, cdt),
           rstd = L::on(x, r.lead, cdt);
    on_compute(cdt, [&]<class C>() {
      L::run_rows("layer_norm", x.device(), r.rows,
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
    Tensor grad_x = L::on(x, x.shape(), cdt);
    const DType param_dtype = weight.defined() ? weight.dtype() : x.dtype();
    NormGrads grads;
    on_compute(cdt, [&]<class C>() {
      L::run_rows(op, x.device(), r.rows,
                  LayerNormBackwardFn<C>{data_of<C>(gc), data_of<C>(xc),
                                         wc.defined() ? data_of<C>(wc) : nullptr, data_of<C>(mc),
                                         data_of<C>(rc), data_of<C>(grad_x), r.d});
      if (weight.defined()) grads.grad_weight = norm_column<C>(op, gc, xc, mc, rc, r, param_dtype);
      grads.grad_bias = norm_column<C>(op, gc, Tensor(), Tensor(), Tensor(), r, param_dtype);
    });
    grads.grad_x = grad_x.to(x.dtype());
    return grads;
  }

  static void fill_table(registry::KernelTable& table) {
    table.rms_norm = &rms_norm;
    table.rms_norm_backward = &rms_norm_backward;
    table.layer_norm = &layer_norm;
    table.layer_norm_backward = &layer_norm_backward;
  }
};

}  // namespace tessera::kernels::portable
