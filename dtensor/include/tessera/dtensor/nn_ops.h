#pragma once
// DTensor versions of the layer ops (embedding, RMSNorm, LayerNorm), with their sharding rules.
// Like the ops in ops.h, inputs are redistributed to what the rule asks and gradients come back
// in the inputs' grad placements; a replicated weight used by sharded activations receives the
// sum of every rank's contribution.
#include "tessera/autograd/ops.h"
#include "tessera/dtensor/dtensor.h"

namespace tessera {

// ids: integer DTensor of any shape; weight [V, D]. Rules per mesh dim:
//   weight R                      -> output placed like ids (R, or sharded on a batch/sequence
//                                    dim of ids, which shards the same output dim)
//   weight S(1)                   -> output S(-1) (ids gathered to R on that mesh dim)
//   weight S(0) (vocab parallel)  -> output Partial(sum): each rank looks up the ids in its own
//                                    row range and gives zero rows for the others
//   weight P(sum)                 -> output P(sum) (the lookup is linear in the weight)
// An id outside [0, V) is an error on every rank.
DTensor embedding(const DTensor& ids, const DTensor& weight);

// Normalise the last dim, which must be whole on every rank: a shard of it (or a Partial input)
// is gathered (reduced) to Replicate first. Other dims keep their shards (sequence parallel).
// weight [D] and bias [D] (either may be undefined) are used replicated.
// Without eps: rms_norm_default_eps of the input's dtype, as F.rms_norm's eps=None.
DTensor rms_norm(const DTensor& x, const DTensor& weight, double eps);
inline DTensor rms_norm(const DTensor& x, const DTensor& weight) {
  return rms_norm(x, weight, rms_norm_default_eps(x.dtype()));
}
DTensor layer_norm(const DTensor& x, const DTensor& weight, const DTensor& bias, double eps = 1e-5);

}  // namespace tessera
