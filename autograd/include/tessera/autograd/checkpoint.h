#pragma once
// Activation checkpointing: PyTorch's torch.utils.checkpoint.checkpoint(fn, x,
// use_reentrant=False). The region's operations record their backward graph as usual, but the
// tensors they would keep for backward are dropped; when the first backward node of the region
// needs them, fn(x) runs again (recording, with every random generator the region advanced put
// back where it stood, so dropout draws the same masks) and the nodes take what that run kept.
// Memory for compute: one more forward of the region in each backward.
//
// fn must run the same operations on the recomputation (checked: how many tensors it keeps, their
// shapes, dtypes and devices, and the same parameters where the forward saved one), must not
// change state outside itself that the recomputation would change again, and may communicate
// (tensor-parallel collectives run again inside the backward, on every rank alike). A tensor the
// region read from outside and that is modified in place before the backward (a parameter
// stepped by an optimizer, the input) is an error. Regions nest: an inner region's nodes
// recompute from the inner region's input, which the outer recomputation makes again.
// docs/autograd.md.
#include <functional>

#include "tessera/core/tensor.h"

namespace tessera {

// y = fn(x), x kept for the recomputation. Without grad mode, just fn(x).
Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x);

namespace autograd {
// Whether this thread is running the forward of a checkpointed region (not its recomputation):
// fully_shard refuses to gather there, since the recomputation inside the backward would run its
// hooks again.
bool in_checkpoint_region();
// Whether this thread is recomputing a checkpointed region inside a backward.
bool in_checkpoint_recompute();
}  // namespace autograd

}  // namespace tessera
