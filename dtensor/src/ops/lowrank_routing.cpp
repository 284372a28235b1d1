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

// Both products: x [..., c] against m [n, c], giving [..., n]; `down` picks the rules and the
// local op, `shape` names m's layout in errors.
DTensor run_routed(const char* op, const DTensor& x, const DTensor& m, bool down,
                   const LowRankRouting& routing, const char* shape) {
  dtensor_ops::check_same_mesh(op, {x, m});
  TESSERA_CHECK(m.dim() == 2 && x.dim() >= 1 && x.size(-1) == m.size(1), op, ": ", x.str(), " and ",
                m.str(), " do not fit (", shape, ")");
  check_samples_whole(op, x);
  Shape out = x.shape();
  out.back() = m.size(0);
  return dtensor_ops::run(
      op, {x, m}, routed_decision(x, m, down), out, [routing, down](const std::vector<Tensor>& l) {
        return down ? lowrank_down(l[0], l[1], routing) : lowrank_up(l[0], l[1], routing);
      });
}

}  // namespace

DTensor lowrank_down(const DTensor& x, const DTensor& a, const LowRankRouting& routing) {
  return run_routed("lowrank_down", x, a, /*down=*/true, routing, "a [k*width, in]");
}

DTensor lowrank_up(const DTensor& h, const DTensor& b, const LowRankRouting& routing) {
  return run_routed("lowrank_up", h, b, /*down=*/false, routing, "b [out, k*width]");
}

}  // namespace tessera
