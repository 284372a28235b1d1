#pragma once
// Kernels of tensor parallelism over a vocabulary split into row ranges [start, start + rows):
// the lookup of ids in a shard of an embedding table, and the stages of Megatron's
// vocab-parallel cross-entropy between which the ranks exchange per-row statistics.
#include "tessera/core/tensor.h"

namespace tessera::kernels {

// For int64 ids of any shape: each id's row in the shard (0 for ids another shard owns) and a
// Bool mask [..., 1] that is true for those. An id outside [0, vocab) is an error.
struct VocabShardIds {
  Tensor local;
  Tensor foreign;
};
VocabShardIds vocab_shard_ids(const Tensor& ids, int64_t start, int64_t rows, int64_t vocab);

// The cross-entropy stages over this rank's logits x [N, n] (float32 or float64, contiguous),
// the columns [start, start + n) of the vocabulary; target int64 [N] holds class ids, -1 for
// ignored rows. A row's shift is its global max, or 0 when that is not finite (an all -inf row).
// Stage 1 is amax over dim 1, all-reduced with max.
// Stage 2: [N, 2] of (sum over the row of exp(x - shift), the target's logit when this rank
// holds the target column, else 0), to be all-reduced with sum.
Tensor vocab_ce_stats(const Tensor& x, const Tensor& row_max, const Tensor& target, int64_t start);
// Stage 3: lse [N] = log(sum) + shift, and the mean over the `kept` rows of lse - target logit
// (a scalar of x's dtype; NaN when kept is 0, as PyTorch's mean over nothing).
struct VocabCrossEntropy {
  Tensor lse;
  Tensor loss;
};
VocabCrossEntropy vocab_ce_loss(const Tensor& stats, const Tensor& row_max, const Tensor& target,
                                int64_t kept);
// The gradient of the logits: (softmax(x) - onehot(target)) * scale on kept rows, 0 on ignored.
Tensor vocab_ce_backward(const Tensor& x, const Tensor& lse, const Tensor& target, int64_t start,
                         double scale);

}  // namespace tessera::kernels
