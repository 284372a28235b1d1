#pragma once
// The fused optimizer updates and the squared norm clip_grad_norm_ needs, as kernels so that
// each device runs its own. Every tensor is contiguous, of one shape and of one dtype, float32 or
// float64 (the optimizers convert 16-bit parameters to a float32 copy first).
#include "tessera/core/tensor.h"

namespace tessera::kernels {

// One AdamW step with PyTorch's formulas; the scalars are what the optimizer derives from its
// hyperparameters and the parameter's step count.
struct AdamWStep {
  double decay = 1.0;                  // 1 - lr * weight_decay
  double beta1 = 0.9;                  // exp_avg += (1 - beta1) * (grad - exp_avg)
  double beta2 = 0.999;                // exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad^2
  double step_size = 0.0;              // lr / (1 - beta1^t)
  double bias_correction2_sqrt = 1.0;  // sqrt(1 - beta2^t)
  double eps = 1e-8;
};
void adamw_update_(Tensor& param, Tensor& exp_avg, Tensor& exp_avg_sq, const Tensor& grad,
                   const AdamWStep& step);

// d = grad + weight_decay * param; with momentum, buf = first ? d : momentum * buf + d and d =
// buf; param -= lr * d. `momentum_buffer` is undefined when momentum is 0.
struct SgdStep {
  double lr = 0.0;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool first = false;  // the buffer's first step copies d into it
};
void sgd_update_(Tensor& param, Tensor& momentum_buffer, const Tensor& grad, const SgdStep& step);

// sum(x^2) accumulated in float64, as a float64 tensor of shape [] on x's device.
Tensor sum_of_squares(const Tensor& x);

}  // namespace tessera::kernels
