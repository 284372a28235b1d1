#pragma once
#include "tessera/autograd/ops.h"
#include "tessera/dtensor/dtensor.h"

namespace tessera {

// Loss-parallel cross-entropy: logits sharded on the vocabulary (last) dim, never gathered; each
// rank reduces its slice and the row statistics (max, sum of exponentials, target logit) are
// combined with all-reduces. target int64 or int32 [...] (Replicate), as cross_entropy's. Returns
// the loss (Replicate) as PyTorch's cross_entropy under loss_parallel: the mean over the rows whose
// target is not ignore_index (NaN when there are none), their sum, or with Reduction::None one loss
// per row of the target's shape (0 on ignored rows). label_smoothing as cross_entropy's: each row's
// sum of logits over the vocabulary rides in the statistics' all-reduce (no collective more).
// weight as cross_entropy's (PyTorch's): one per class of the whole vocabulary, a plain Tensor
// [V] of the logits' dtype and device, the same on every rank (each weighs its own slice). Each
// row's loss is scaled by weight[target], a mean divides by the sum of the kept rows' weights, and
// with label_smoothing the uniform term weighs each class by its weight; the weighted sum of
// logits rides in the same all-reduce.
// Before its first collective every rank of the logits' mesh (along Replicate mesh dims too, as
// the loss is Replicate over them) agrees on the vocabulary size, the target, ignore_index,
// reduction, label_smoothing and the weight, so that one rank's bad or different value fails
// every rank, naming it, instead of leaving the others waiting or computing another loss. That
// is one all-reduce: over the mesh's group on a 1-D mesh, over the world on a mesh that spans
// it; a mesh of several dims that does not span the world agrees one mesh dim at a time. Then
// two all-reduces per vocabulary mesh dim (row max, row statistics), with or without a weight or
// smoothing: three in all on a 1-D mesh. Logits with no vocabulary-sharded mesh dim give the
// plain cross_entropy on every rank, after the same agreement.
DTensor vocab_parallel_cross_entropy(const DTensor& logits, const Tensor& target,
                                     int64_t ignore_index = -100,
                                     kernels::Reduction reduction = kernels::Reduction::Mean,
                                     double label_smoothing = 0.0, const Tensor& weight = {});

}  // namespace tessera
