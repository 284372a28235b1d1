#pragma once
// What the LoRA layers' forwards share: the per-row shape of a mixed batch's dropout rates, and
// the reduction of partial base outputs together with partial adapter activations.
#include <vector>

#include "tessera/autograd/ops.h"
#include "tessera/dtensor/ops.h"

namespace tessera::lora_detail {

// [rows, 1, ..., width]: broadcasts a per-row tensor over activations of rank `ndim`. Rank 1 is
// one row, whose activations [width] keep their rank, as a Linear's output for a 1-D input does.
inline Shape per_row_shape(int64_t rows, int64_t width, int64_t ndim) {
  if (ndim <= 1) return {width};
  Shape s(size_t(ndim), 1);
  s.front() = rows;
  s.back() = width;
  return s;
}

// g z in g's dtype (the adapters' float32), rounded once to z's (a bfloat16 base's): g is not
// rounded to bfloat16, nor is the gradient DoRA's magnitude gets through it.
template <class T>
T scaled(const T& z, const T& g) {
  if (z.dtype() == g.dtype()) return mul(z, g);
  return cast(mul(cast(z, g.dtype()), g), z.dtype());
}

// Inverted dropout's multiplier, from the uniform draw `u`: 1/(1-p) where u >= p, else 0; p one
// value, or one per row ([rows]: `p_rows`) when defined.
Tensor keep_scale(const Tensor& u, const Tensor& p_rows, double p);

// yp + scale * hp B^T, where yp (the base output [..., out]) and hp (the adapter activations
// [..., rank]) are partial sums over some mesh dims: both travel in one reduction to Replicate,
// after which B (replicated) applies to replicated activations, so that B's gradient needs no
// sum. The reduction runs in the wider of their dtypes (h, and A's gradient through it, stay
// float32 under a bfloat16 base, as on one rank). With a routing (a mixed batch) B applies
// through lowrank_up: each sample's activations under its own adapter's columns of B.
DTensor reduce_with_activations(const DTensor& yp, const DTensor& hp, const DTensor& b,
                                double scale, const LowRankRouting& routing);

}  // namespace tessera::lora_detail
