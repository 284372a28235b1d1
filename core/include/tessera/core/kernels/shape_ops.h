#pragma once
// Kernels that move data between tensors: concatenation and indexing. Pure views (narrow,
// transpose, ...) are Tensor::as_strided plus the helpers in views.h.
#include "tessera/core/tensor.h"

namespace tessera::kernels {

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
// out = zeros(shape); out.index_select(dim, index) += src (repeated indices accumulate).
Tensor index_add(const Shape& shape, int64_t dim, const Tensor& index, const Tensor& src);

}  // namespace tessera::kernels
