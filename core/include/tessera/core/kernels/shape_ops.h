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

// `length` elements from flat index `src` of a source to flat index `dst` of a destination.
struct CopyRun {
  int64_t src = 0;
  int64_t dst = 0;
  int64_t length = 0;
};
// Copies every run of `src` into `dst` (both contiguous, of one dtype and device, not sharing
// storage; the runs' destinations must not overlap) as one kernel: the packing and unpacking of
// scattered pieces around a gather (FSDP's) is then one launch on a device, not one per run.
void copy_runs_(Tensor& dst, const Tensor& src, const std::vector<CopyRun>& runs);

}  // namespace tessera::kernels
