#pragma once
#include "tessera/autograd/ops.h"
#include "tessera/dtensor/dtensor.h"

namespace tessera {

// Loss-parallel cross-entropy: logits sharded on the vocabulary (last) dim, never gathered; each
// rank reduces its slice and the row statistics (max, sum of exponentials, target logit) are
// combined with all-reduces. target int64 [...] (Replicate). Returns the mean loss (Replicate).
DTensor vocab_parallel_cross_entropy(const DTensor& logits, const Tensor& target,
                                     int64_t ignore_index = -100);

}  // namespace tessera
