#pragma once
// View arithmetic: each returns a tensor sharing storage (no copy, no autograd), or throws when
// the request is impossible as a view (view of non-viewable strides).
#include "tessera/core/tensor.h"

namespace tessera::kernels {

// `shape` may contain one -1.
Shape infer_shape(const Shape& shape, int64_t numel, const char* op);
Tensor view(const Tensor& x, const Shape& shape);
// A view when the strides allow it, else a contiguous copy.
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
// Python-style slice with step > 0; start/end clamp like x[start:end:step].
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor select(const Tensor& x, int64_t dim, int64_t index);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor expand(const Tensor& x, const Shape& shape);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor squeeze(const Tensor& x);
// The shape flatten gives: dims start_dim..end_dim merged into one ([1] for a 0-d shape).
Shape flatten_shape(const Shape& shape, int64_t start_dim, int64_t end_dim);
Tensor flatten(const Tensor& x, int64_t start_dim = 0, int64_t end_dim = -1);
// torch.chunk: ceil(n / chunks) per piece; fewer pieces when n is small, `chunks` empty ones
// when n is 0.
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim);
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);

}  // namespace tessera::kernels
