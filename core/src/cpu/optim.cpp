// The CPU optimizer updates: one pass over each parameter, in the order PyTorch's single-tensor
// implementations compute.
#include <cmath>
#include <utility>

#include "float_dispatch.h"
#include "kernels.h"
#include "tessera/core/factory.h"

namespace tessera::kernels::cpu {

namespace {

void check_update(const char* op, const Tensor& param, const Tensor& t, const char* what) {
  TESSERA_CHECK(
      t.defined() && t.shape() == param.shape() && t.dtype() == param.dtype() && t.is_contiguous(),
      op, ": ", what, " ", t.defined() ? t.str() : std::string("(undefined)"),
      " must be contiguous with the parameter's shape and dtype ", param.str());
}

template <class F>
void float_dispatch(const char* op, const Tensor& param, F&& f) {
  TESSERA_CHECK(param.is_contiguous(), op, ": parameter ", param.str(), " must be contiguous");
  dispatch_float32_or_64(op, "parameter", param, std::forward<F>(f));
}

}  // namespace

void adamw_update_(Tensor& param, Tensor& exp_avg, Tensor& exp_avg_sq, const Tensor& grad,
                   const AdamWStep& s) {
  check_update("adamw_update_", param, grad, "gradient");
  check_update("adamw_update_", param, exp_avg, "exp_avg");
  check_update("adamw_update_", param, exp_avg_sq, "exp_avg_sq");
  float_dispatch("adamw_update_", param, [&]<class T>() {
    T* pw = param.data<T>();
    const T* pg = grad.data<T>();
    T* m = exp_avg.data<T>();
    T* v = exp_avg_sq.data<T>();
    const T tdecay = T(s.decay), one_b1 = T(1 - s.beta1), tb2 = T(s.beta2), one_b2 = T(1 - s.beta2);
    const T tstep = T(s.step_size), tbc2 = T(s.bias_correction2_sqrt), teps = T(s.eps);
    for (int64_t j = 0; j < param.numel(); ++j) {
      const T gj = pg[j];
      pw[j] *= tdecay;
      m[j] += one_b1 * (gj - m[j]);  // PyTorch's lerp
      v[j] = tb2 * v[j] + one_b2 * gj * gj;
      const T denom = std::sqrt(v[j]) / tbc2 + teps;
      pw[j] -= tstep * (m[j] / denom);
    }
  });
}

void sgd_update_(Tensor& param, Tensor& momentum_buffer, const Tensor& grad, const SgdStep& s) {
  check_update("sgd_update_", param, grad, "gradient");
  if (s.momentum != 0) check_update("sgd_update_", param, momentum_buffer, "momentum buffer");
  float_dispatch("sgd_update_", param, [&]<class T>() {
    T* pw = param.data<T>();
    const T* pg = grad.data<T>();
    T* buf = s.momentum != 0 ? momentum_buffer.data<T>() : nullptr;
    const T tlr = T(s.lr), tmom = T(s.momentum), twd = T(s.weight_decay);
    for (int64_t j = 0; j < param.numel(); ++j) {
      T d = pg[j];
      if (s.weight_decay != 0) d += twd * pw[j];
      if (buf) {
        buf[j] = s.first ? d : tmom * buf[j] + d;
        d = buf[j];
      }
      pw[j] -= tlr * d;
    }
  });
}

Tensor sum_of_squares(const Tensor& x) {
  // Float32 and float64 are read in place; other dtypes through a float32 copy (exact for the
  // 16-bit ones).
  const Tensor c = x.dtype() == DType::Float64 || x.dtype() == DType::Float32
                       ? x.contiguous()
                       : x.to(DType::Float32);
  double s = 0;
  auto accumulate = [&]<class T>() {
    const T* p = c.data<T>();
    for (int64_t j = 0; j < c.numel(); ++j)
      s += double(p[j]) * double(p[j]);
  };
  if (c.dtype() == DType::Float64)
    accumulate.template operator()<double>();
  else
    accumulate.template operator()<float>();
  return full({}, s, DType::Float64);
}

}  // namespace tessera::kernels::cpu
