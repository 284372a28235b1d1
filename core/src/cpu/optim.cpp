// The CPU optimizer updates: one pass over each parameter, in the order PyTorch's single-tensor
// implementations compute.
#include <cmath>
#include <utility>

#include "../portable/element_checks.h"
#include "../portable/element_ops.h"
#include "../portable/float_dispatch.h"
#include "kernels.h"
#include "tessera/core/factory.h"

namespace tessera::kernels::cpu {

namespace {

template <class F>
void float_dispatch(const char* op, const Tensor& param, F&& f) {
  TESSERA_CHECK(param.is_contiguous(), op, ": parameter ", param.str(), " must be contiguous");
  portable::dispatch_float32_or_64(op, "parameter", param, std::forward<F>(f));
}

}  // namespace

void adamw_update_(Tensor& param, Tensor& exp_avg, Tensor& exp_avg_sq, Tensor& max_exp_avg_sq,
                   const Tensor& grad, const AdamWStep& s) {
  portable::check_update_operand("adamw_update_", param, grad, "gradient");
  portable::check_update_operand("adamw_update_", param, exp_avg, "exp_avg");
  portable::check_update_operand("adamw_update_", param, exp_avg_sq, "exp_avg_sq");
  const bool amsgrad = max_exp_avg_sq.defined();
  if (amsgrad)
    portable::check_update_operand("adamw_update_", param, max_exp_avg_sq, "max_exp_avg_sq");
  float_dispatch("adamw_update_", param, [&]<class T>() {
    T* pw = param.data<T>();
    const T* pg = grad.data<T>();
    T* m = exp_avg.data<T>();
    T* v = exp_avg_sq.data<T>();
    T* vmax = amsgrad ? max_exp_avg_sq.data<T>() : nullptr;
    const portable::AdamWScalars<T> ts{
        T(s.decay),     T(1 - s.beta1),       T(s.beta2),
        T(1 - s.beta2), T(s.step_size),       T(s.bias_correction2_sqrt),
        T(s.eps),       T(s.l2_weight_decay), s.l2_weight_decay != 0,
        s.maximize};
    for (int64_t j = 0; j < param.numel(); ++j)
      portable::adamw_element(pw[j], m[j], v[j], vmax ? vmax + j : nullptr, pg[j], ts);
  });
}

void sgd_update_(Tensor& param, Tensor& momentum_buffer, const Tensor& grad, const SgdStep& s) {
  portable::check_update_operand("sgd_update_", param, grad, "gradient");
  if (s.momentum != 0)
    portable::check_update_operand("sgd_update_", param, momentum_buffer, "momentum buffer");
  float_dispatch("sgd_update_", param, [&]<class T>() {
    T* pw = param.data<T>();
    const T* pg = grad.data<T>();
    T* buf = s.momentum != 0 ? momentum_buffer.data<T>() : nullptr;
    const portable::SgdScalars<T> ts{
        T(s.lr), T(s.momentum), T(s.weight_decay), T(1 - s.dampening), s.weight_decay != 0,
        s.first, s.nesterov,    s.maximize};
    for (int64_t j = 0; j < param.numel(); ++j)
      portable::sgd_element(pw[j], buf ? buf + j : nullptr, pg[j], ts);
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
