#pragma once
// The window of a parameter's global value that this rank holds, for code that works window by
// window (init draws, merges) without gathering the parameter.
#include "tessera/autograd/grad_mode.h"
#include "tessera/core/kernels/views.h"
#include "tessera/nn/parameter.h"

namespace tessera::lora_detail {

// [offset, offset + shape) of the global value.
inline LocalLayout window_of(const Parameter& p) {
  if (!p.is_dtensor()) return {p.stored().shape(), Shape(p.stored().dim(), 0)};
  return p.stored_dtensor().spec().local_layout();
}

// This rank's window of `full`, the parameter's global value, written into the piece it holds.
inline void write_window(Parameter& p, const Tensor& full) {
  NoGradGuard no_grad;
  const LocalLayout l = window_of(p);
  Tensor piece = full;
  for (size_t d = 0; d < l.local_shape.size(); ++d)
    piece = kernels::narrow(piece, int64_t(d), l.global_offset[d], l.local_shape[d]);
  p.stored().detach().copy_(piece);
}

}  // namespace tessera::lora_detail
