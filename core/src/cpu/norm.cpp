// RMSNorm and LayerNorm over the last dim. Inputs of any float dtype and strides are converted
// once to their compute dtype (float32, or float64 for float64 input), so statistics never
// accumulate in 16 bits and the output is rounded to x's dtype exactly once.
// GCC 12 reports false maybe-uninitialized warnings inside its own AVX-512 intrinsics once
// Eigen's reductions are inlined here (GCC bug 105593); the location is the intrinsic header, so
// the pragma must precede every include.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <Eigen/Core>
#include <cmath>

#include "../portable/nn_checks.h"
#include "kernels.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/nn.h"

namespace tessera::kernels::cpu {

namespace {

template <class C>
using Vec = Eigen::Array<C, Eigen::Dynamic, 1>;
template <class C>
using VecMap = Eigen::Map<Vec<C>>;
template <class C>
using ConstVecMap = Eigen::Map<const Vec<C>>;

template <class F>
void dispatch_compute(DType cdt, F&& f) {
  if (cdt == DType::Float64) {
    f.template operator()<double>();
  } else {
    f.template operator()<float>();
  }
}

// Contiguous copy (or x itself) in the compute dtype; undefined stays undefined.
Tensor in_compute(const Tensor& t, DType cdt) {
  return t.defined() ? t.to(cdt).contiguous() : Tensor();
}

// Parameter gradients are sums over every row, so they accumulate in float64 whatever the
// compute dtype: a float32 running sum over thousands of tokens drifts visibly.
Tensor from_accumulator(const Vec<double>& acc, DType dtype) {
  Tensor t = empty({int64_t(acc.size())}, DType::Float64);
  VecMap<double>(t.data<double>(), acc.size()) = acc;
  return t.to(dtype);
}

}  // namespace

NormResult rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  portable::RowLayout r = portable::check_norm_input("rms_norm", x, weight, Tensor());
  TESSERA_CHECK(eps >= 0, "rms_norm: eps must be >= 0, got ", eps);
  DType cdt = compute_dtype(x.dtype());
  Tensor xc = in_compute(x, cdt), wc = in_compute(weight, cdt);
  Tensor out = empty(x.shape(), cdt), rstd = empty(r.lead, cdt);
  dispatch_compute(cdt, [&]<class C>() {
    const C* xp = xc.data<C>();
    C* op = out.data<C>();
    C* rp = rstd.data<C>();
    const int64_t d = r.d;
    for (int64_t i = 0; i < r.rows; ++i) {
      ConstVecMap<C> xi(xp + i * d, d);
      VecMap<C> oi(op + i * d, d);
      C rs = C(1) / std::sqrt(xi.square().mean() + C(eps));
      rp[i] = rs;
      if (wc.defined()) {
        oi = xi * rs * ConstVecMap<C>(wc.data<C>(), d);
      } else {
        oi = xi * rs;
      }
    }
  });
  return {out.to(x.dtype()), Tensor(), rstd};
}

NormGrads rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                            const Tensor& rstd) {
  portable::RowLayout r = portable::check_norm_input("rms_norm_backward", x, weight, Tensor());
  portable::check_norm_backward("rms_norm_backward", grad_out, x, rstd, "rstd", r);
  DType cdt = compute_dtype(x.dtype());
  Tensor gc = in_compute(grad_out, cdt), xc = in_compute(x, cdt), wc = in_compute(weight, cdt),
         rc = in_compute(rstd, cdt);
  Tensor grad_x = empty(x.shape(), cdt);
  Vec<double> grad_w = Vec<double>::Zero(weight.defined() ? r.d : 0);
  dispatch_compute(cdt, [&]<class C>() {
    const int64_t d = r.d;
    const C* gp = gc.data<C>();
    const C* xp = xc.data<C>();
    const C* rp = rc.data<C>();
    C* gxp = grad_x.data<C>();
    Vec<C> gw(d);  // grad of the normalised row: grad_out * weight
    for (int64_t i = 0; i < r.rows; ++i) {
      ConstVecMap<C> gi(gp + i * d, d), xi(xp + i * d, d);
      const C rs = rp[i];
      if (wc.defined()) {
        gw = gi * ConstVecMap<C>(wc.data<C>(), d);
        grad_w += (gi * xi * rs).template cast<double>();
      } else {
        gw = gi;
      }
      // y = x * rs with rs = (mean(x^2) + eps)^-1/2, so dy/dx = rs - rs^3 x x^T / d.
      const C dot = (gw * xi).sum();
      VecMap<C>(gxp + i * d, d) = rs * gw - (rs * rs * rs * dot / C(d)) * xi;
    }
  });
  NormGrads g;
  g.grad_x = grad_x.to(x.dtype());
  if (weight.defined()) g.grad_weight = from_accumulator(grad_w, weight.dtype());
  return g;
}

NormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  portable::RowLayout r = portable::check_norm_input("layer_norm", x, weight, bias);
  TESSERA_CHECK(eps >= 0, "layer_norm: eps must be >= 0, got ", eps);
  DType cdt = compute_dtype(x.dtype());
  Tensor xc = in_compute(x, cdt), wc = in_compute(weight, cdt), bc = in_compute(bias, cdt);
  Tensor out = empty(x.shape(), cdt), mean = empty(r.lead, cdt), rstd = empty(r.lead, cdt);
  dispatch_compute(cdt, [&]<class C>() {
    const int64_t d = r.d;
    const C* xp = xc.data<C>();
    C* op = out.data<C>();
    C* mp = mean.data<C>();
    C* rp = rstd.data<C>();
    for (int64_t i = 0; i < r.rows; ++i) {
      ConstVecMap<C> xi(xp + i * d, d);
      VecMap<C> oi(op + i * d, d);
      // Two passes (mean, then centred squares) instead of E[x^2] - E[x]^2, which cancels
      // catastrophically for rows with a large mean.
      const C mu = xi.mean();
      oi = xi - mu;
      const C rs = C(1) / std::sqrt(oi.square().mean() + C(eps));
      mp[i] = mu;
      rp[i] = rs;
      oi *= rs;
      if (wc.defined()) oi *= ConstVecMap<C>(wc.data<C>(), d);
      if (bc.defined()) oi += ConstVecMap<C>(bc.data<C>(), d);
    }
  });
  return {out.to(x.dtype()), mean, rstd};
}

NormGrads layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                              const Tensor& mean, const Tensor& rstd) {
  portable::RowLayout r = portable::check_norm_input("layer_norm_backward", x, weight, Tensor());
  portable::check_norm_backward("layer_norm_backward", grad_out, x, mean, "mean", r);
  portable::check_norm_backward("layer_norm_backward", grad_out, x, rstd, "rstd", r);
  DType cdt = compute_dtype(x.dtype());
  Tensor gc = in_compute(grad_out, cdt), xc = in_compute(x, cdt), wc = in_compute(weight, cdt),
         mc = in_compute(mean, cdt), rc = in_compute(rstd, cdt);
  Tensor grad_x = empty(x.shape(), cdt);
  Vec<double> grad_w = Vec<double>::Zero(weight.defined() ? r.d : 0);
  Vec<double> grad_b = Vec<double>::Zero(r.d);
  dispatch_compute(cdt, [&]<class C>() {
    const int64_t d = r.d;
    const C* gp = gc.data<C>();
    const C* xp = xc.data<C>();
    const C* mp = mc.data<C>();
    const C* rp = rc.data<C>();
    C* gxp = grad_x.data<C>();
    Vec<C> xhat(d), gxhat(d);
    for (int64_t i = 0; i < r.rows; ++i) {
      ConstVecMap<C> gi(gp + i * d, d), xi(xp + i * d, d);
      const C rs = rp[i];
      xhat = (xi - mp[i]) * rs;
      if (wc.defined()) {
        gxhat = gi * ConstVecMap<C>(wc.data<C>(), d);
        grad_w += (gi * xhat).template cast<double>();
      } else {
        gxhat = gi;
      }
      grad_b += gi.template cast<double>();
      // Projects out the two directions the normalisation removes: the mean and xhat itself.
      VecMap<C>(gxp + i * d, d) = rs * (gxhat - gxhat.mean() - xhat * (gxhat * xhat).mean());
    }
  });
  NormGrads g;
  g.grad_x = grad_x.to(x.dtype());
  // The bias's dtype is not known here; parameters normally share the weight's (or x's) dtype
  // and the caller casts otherwise.
  DType param_dtype = weight.defined() ? weight.dtype() : x.dtype();
  if (weight.defined()) g.grad_weight = from_accumulator(grad_w, param_dtype);
  g.grad_bias = from_accumulator(grad_b, param_dtype);
  return g;
}

}  // namespace tessera::kernels::cpu
