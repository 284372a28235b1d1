#pragma once
// Operators on DTensors (sharding propagation). Each op looks up its sharding rule: from the
// inputs' specs, the placements its inputs must have (they are redistributed first, by the
// cheapest plan) and the placements of its output. The local op then runs on the local pieces.
//
// Backward follows the same rules: gradients come back in the inputs' grad placements. Where an
// input is Replicate on a mesh dim but the output is not, each rank's local gradient is only its
// share, and the ranks' shares are summed (all-reduce) — which is how a replicated weight used
// by tensor-parallel ranks receives the sum of their contributions.
#include <vector>

#include "tessera/autograd/ops.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/dtensor/dtensor.h"

namespace tessera {

// --- elementwise (broadcasting) ---
DTensor add(const DTensor& a, const DTensor& b);
DTensor sub(const DTensor& a, const DTensor& b);
DTensor mul(const DTensor& a, const DTensor& b);
DTensor div(const DTensor& a, const DTensor& b);
DTensor maximum(const DTensor& a, const DTensor& b);
DTensor minimum(const DTensor& a, const DTensor& b);
DTensor where(const DTensor& cond, const DTensor& a, const DTensor& b);
DTensor masked_fill(const DTensor& x, const DTensor& mask, double value);
DTensor add(const DTensor& a, double s);
DTensor sub(const DTensor& a, double s);
DTensor mul(const DTensor& a, double s);
DTensor div(const DTensor& a, double s);
DTensor pow(const DTensor& a, double exponent);
DTensor abs(const DTensor& x);
DTensor neg(const DTensor& x);
DTensor exp(const DTensor& x);
DTensor log(const DTensor& x);
DTensor sqrt(const DTensor& x);
DTensor rsqrt(const DTensor& x);
DTensor tanh(const DTensor& x);
DTensor sigmoid(const DTensor& x);
DTensor relu(const DTensor& x);
DTensor gelu(const DTensor& x, bool approximate = false);
DTensor silu(const DTensor& x);
DTensor square(const DTensor& x);
DTensor cast(const DTensor& x, DType dtype);
// Python's operators on DTensors, as on Tensor.
inline DTensor operator+(const DTensor& a, const DTensor& b) {
  return add(a, b);
}
inline DTensor operator-(const DTensor& a, const DTensor& b) {
  return sub(a, b);
}
inline DTensor operator*(const DTensor& a, const DTensor& b) {
  return mul(a, b);
}
inline DTensor operator/(const DTensor& a, const DTensor& b) {
  return div(a, b);
}
inline DTensor operator+(const DTensor& a, double s) {
  return add(a, s);
}
inline DTensor operator-(const DTensor& a, double s) {
  return sub(a, s);
}
inline DTensor operator*(const DTensor& a, double s) {
  return mul(a, s);
}
inline DTensor operator*(double s, const DTensor& a) {
  return mul(a, s);
}
inline DTensor operator/(const DTensor& a, double s) {
  return div(a, s);
}
inline DTensor operator-(const DTensor& x) {
  return neg(x);
}

// --- linear algebra ---
// [..., m, k] x [k, n] or batched [..., m, k] x [..., k, n].
DTensor matmul(const DTensor& a, const DTensor& b);
// x [..., in], weight [out, in], bias [out] (optional): column parallel (weight S(0)) gives
// S(-1), row parallel (x S(-1), weight S(1)) gives Partial.
DTensor linear(const DTensor& x, const DTensor& weight, const DTensor& bias = {});
// y = linear(x, weight, bias) + scale * linear(linear(x_lowrank, a), b), with a [r, in] and
// b [out, r]: a linear layer with a low-rank update (LoRA) as one op. x_lowrank (default: x) is
// what the update reads (x after dropout); with a routing (a mixed batch of adapters stacked in
// a and b) the update is lowrank_up(scale * lowrank_down(x_lowrank, a), b), each sample's from
// its own adapter. Rules per mesh dim, from the weight's placement: S(0) (column parallel) ->
// x, x_lowrank and a replicated, b S(0), output S(-1), and the gradients of these replicated
// inputs of one op summed in one all-reduce — the one collective linear alone has; S(1) (row
// parallel) -> x S(-1), a S(1), b replicated, output Partial; replicated -> everything follows
// x's batch or sequence shards.
DTensor linear_lowrank(const DTensor& x, const DTensor& weight, const DTensor& bias,
                       const DTensor& a, const DTensor& b, double scale,
                       const DTensor& x_lowrank = {}, const LowRankRouting& routing = {});
// The routed products of autograd's lowrank_down / lowrank_up (a mixed batch: each sample's
// activations from its own adapter). The samples (dim 0) must not be split over the mesh: the
// routing names this rank's. Rules per mesh dim: lowrank_down as linear(x, a) (a S(1) with x
// S(-1) gives Partial; a replicated keeps x's sequence shards or Partial), lowrank_up as
// linear(h, b) (b S(0) takes h replicated and gives S(-1); b replicated keeps h's sequence
// shards or Partial).
DTensor lowrank_down(const DTensor& x, const DTensor& a, const LowRankRouting& routing);
DTensor lowrank_up(const DTensor& h, const DTensor& b, const LowRankRouting& routing);

// --- reductions (a reduced sharded dim becomes Partial) ---
DTensor sum(const DTensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
DTensor mean(const DTensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// amax gathers a shard (or reduces a Partial) of the dims it reduces first: the gradient goes to
// the maxima of the whole dim, shared among ties as PyTorch's.
DTensor amax(const DTensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);

// --- normalisation over a dim (that dim is gathered first if sharded) ---
DTensor softmax(const DTensor& x, int64_t dim);
DTensor log_softmax(const DTensor& x, int64_t dim);

// --- views: a sharded dim survives when it leads the dims it is merged with or split into and its
// shard count divides the sizes involved. view allows nothing else (an error names the op and
// spec); reshape, as PyTorch's, gathers the tensor dims whose shards would not survive first ---
DTensor view(const DTensor& x, const Shape& shape);
DTensor reshape(const DTensor& x, const Shape& shape);
DTensor transpose(const DTensor& x, int64_t d0, int64_t d1);
// Always keep their shards (dims are only renumbered), except squeeze of a sharded dim of size
// 1, which is gathered.
DTensor permute(const DTensor& x, const std::vector<int64_t>& dims);
DTensor unsqueeze(const DTensor& x, int64_t dim);
DTensor squeeze(const DTensor& x, int64_t dim);
// reshape to the merged shape.
DTensor flatten(const DTensor& x, int64_t start_dim = 0, int64_t end_dim = -1);

// --- along one dim: a shard of that dim is gathered first; other placements (Partial
// included) are kept, every input of cat taking the first one's ---
DTensor cat(const std::vector<DTensor>& xs, int64_t dim);
DTensor narrow(const DTensor& x, int64_t dim, int64_t start, int64_t length);

}  // namespace tessera
