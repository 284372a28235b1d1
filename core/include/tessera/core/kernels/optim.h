#pragma once
// The fused optimizer updates and the squared norm clip_grad_norm_ needs, as kernels so that
// each device runs its own. Every tensor is contiguous, of one shape and of one dtype, float32 or
// float64 (the optimizers convert 16-bit parameters to a float32 copy first).
#include "tessera/core/tensor.h"

namespace tessera::kernels {

// One Adam or AdamW step with PyTorch's formulas; the scalars are what the optimizer derives
// from its hyperparameters and the parameter's step count. g = maximize ? -grad : grad, plus
// l2_weight_decay * param (Adam's L2 term); param *= decay (AdamW's decoupled decay). With
// amsgrad (max_exp_avg_sq defined) the denominator uses the running maximum of exp_avg_sq.
struct AdamWStep {
  double decay = 1.0;                  // 1 - lr * weight_decay (AdamW), else 1
  double beta1 = 0.9;                  // exp_avg += (1 - beta1) * (g - exp_avg)
  double beta2 = 0.999;                // exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g^2
  double step_size = 0.0;              // lr / (1 - beta1^t)
  double bias_correction2_sqrt = 1.0;  // sqrt(1 - beta2^t)
  double eps = 1e-8;
  double l2_weight_decay = 0.0;  // Adam's weight_decay, added to the gradient
  bool maximize = false;
};
void adamw_update_(Tensor& param, Tensor& exp_avg, Tensor& exp_avg_sq, Tensor& max_exp_avg_sq,
                   const Tensor& grad, const AdamWStep& step);

// d = (maximize ? -grad : grad) + weight_decay * param; with momentum, buf = first ? d :
// momentum * buf + (1 - dampening) * d and d = nesterov ? d + momentum * buf : buf; param -= lr *
// d. `momentum_buffer` is undefined when momentum is 0.
struct SgdStep {
  double lr = 0.0;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool first = false;  // the buffer's first step copies d into it
  double dampening = 0.0;
  bool nesterov = false;
  bool maximize = false;
};
void sgd_update_(Tensor& param, Tensor& momentum_buffer, const Tensor& grad, const SgdStep& step);

// sum(x^2) accumulated in float64, as a float64 tensor of shape [] on x's device.
Tensor sum_of_squares(const Tensor& x);

}  // namespace tessera::kernels
