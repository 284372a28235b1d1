// Sharding rules of the routed low-rank products (a mixed batch's adapters), per mesh dim. They
// are linear's rules for the layouts LoRA's adapters take: the contraction split on both sides
// gives Partial, an output-split matrix takes its input replicated, a replicated matrix follows
// the input's sequence shards or partial sums. The samples stay whole: the routing names them.
#include "dispatch.h"
#include "tessera/autograd/ops.h"
#include "tessera/dtensor/ops.h"

namespace tessera {

namespace {

using dtensor_ops::ShardingDecision;

void check_samples_whole(const char* op, const DTensor& x) {
  if (x.dim() < 2) return;
  for (const Placement& p : x.placements())
    if (p.is_shard(0))
      dtensor_ops::no_rule(op, {x},
                           "a mixed batch's samples (dim 0) must be whole on every rank: the "
                           "routing names this rank's samples");
}

// What a matrix that leaves x's last dim alone (replicated) lets x keep on one mesh dim.
Placement kept(const Placement& px, int64_t last) {
  if (px.is_shard() && !px.is_strided_shard() && px.dim() > 0 && px.dim() != last) return px;
  if (dtensor_ops::sum_partial(px)) return px;
  return Replicate();
}

// x [..., in] against a [k*width, in] (down), or h [..., k*width] against b [out, k*width].
ShardingDecision routed_decision(const DTensor& x, const DTensor& m, bool down) {
  const int64_t last = x.dim() - 1;
  ShardingDecision dec{{{}, {}}, {}};
  for (int64_t i = 0; i < x.mesh().ndim(); ++i) {
    const Placement pm = m.placements()[size_t(i)];
    Placement xi, mi, out;
    if (down && pm.is_shard(1) && !pm.is_strided_shard()) {
      xi = Shard(last), mi = pm, out = Partial();
    } else if (!down && pm.is_shard(0) && !pm.is_strided_shard()) {
      xi = Replicate(), mi = pm, out = Shard(last);
    } else {
      xi = kept(x.placements()[size_t(i)], last), mi = Replicate(), out = xi;
    }
    dec.inputs[0].push_back(xi);
    dec.inputs[1].push_back(mi);
    dec.output.push_back(out);
  }
  return dec;
}

}  // namespace

DTensor lowrank_down(const DTensor& x, const DTensor& a, const LowRankRouting& routing) {
  dtensor_ops::check_same_mesh("lowrank_down", {x, a});
  TESSERA_CHECK(a.dim() == 2 && x.dim() >= 1 && x.size(-1) == a.size(1), "lowrank_down: input ",
                x.str(), " and a ", a.str(), " do not fit (a [k*width, in])");
  check_samples_whole("lowrank_down", x);
  Shape out = x.shape();
  out.back() = a.size(0);
  return dtensor_ops::run(
      "lowrank_down", {x, a}, routed_decision(x, a, /*down=*/true), out,
      [routing](const std::vector<Tensor>& l) { return lowrank_down(l[0], l[1], routing); });
}

DTensor lowrank_up(const DTensor& h, const DTensor& b, const LowRankRouting& routing) {
  dtensor_ops::check_same_mesh("lowrank_up", {h, b});
  TESSERA_CHECK(b.dim() == 2 && h.dim() >= 1 && h.size(-1) == b.size(1), "lowrank_up: activations ",
                h.str(), " and b ", b.str(), " do not fit (b [out, k*width])");
  check_samples_whole("lowrank_up", h);
  Shape out = h.shape();
  out.back() = b.size(0);
  return dtensor_ops::run(
      "lowrank_up", {h, b}, routed_decision(h, b, /*down=*/false), out,
      [routing](const std::vector<Tensor>& l) { return lowrank_up(l[0], l[1], routing); });
}

}  // namespace tessera
