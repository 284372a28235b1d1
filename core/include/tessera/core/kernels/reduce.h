#pragma once
#include "tessera/core/tensor.h"

namespace tessera::kernels {

// Reductions over `dims` (empty = all dims). Floating sums accumulate in float64; 16-bit inputs
// return their own dtype. Integer and bool sums return int64 (as PyTorch); mean of integers is an
// error.
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor amax(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor amin(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// Max over one dim with the int64 index of the (first) maximum.
struct MaxResult {
  Tensor values;
  Tensor indices;
};
MaxResult max(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);

}  // namespace tessera::kernels
