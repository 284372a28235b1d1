// The class-weight check of every cross-entropy (the kernels, the differentiable loss, the
// loss-parallel one), in one place.
#include <string>

#include "tessera/core/kernels/nn.h"

namespace tessera::kernels {

std::string class_weight_problem(const Tensor& weight, const Shape& logits_shape,
                                 DType logits_dtype, const Device& logits_device,
                                 std::string_view logits_name, std::string_view classes) {
  if (!weight.defined()) return {};
  const int64_t c = logits_shape.empty() ? 0 : logits_shape.back();
  if (weight.shape() != Shape{c})
    return "weight of shape " + shape_str(weight.shape()) + " must hold one weight per class of " +
           std::string(logits_name) + " " + shape_str(logits_shape) + " (expected [" +
           std::to_string(c) + "], " + std::string(classes) + ")";
  if (weight.dtype() != logits_dtype)
    return "weight " + weight.str() + " must have the logits' dtype " +
           std::string(dtype_name(logits_dtype));
  if (weight.device() != logits_device)
    return "weight " + weight.str() + " is not on the logits' device " + logits_device.str();
  return {};
}

}  // namespace tessera::kernels
