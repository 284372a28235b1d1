// Sharding rules of matmul and linear, decided per mesh dim:
//   a S(batch|m), b R          -> out S(batch|m)     (b's gradient summed over the mesh dim)
//   a R,          b S(n)       -> out S(n)           (column parallel; a's gradient summed)
//   a S(k),       b S(k)       -> out P              (row parallel)
//   a P / b P with the other R -> out P
//   a R,          b R          -> out R
// Other combinations are redistributed to the nearest of these: a free local chunk where
// possible (R -> S(k)), otherwise the smaller operand is gathered.
#include "dispatch.h"
#include "tessera/autograd/ops.h"
#include "tessera/dtensor/ops.h"

namespace tessera {

namespace {

using dtensor_ops::ShardingDecision;

// Dims of one matmul problem: a [..., M, K] and b either [K, N] (2-D) or [..., K, N].
struct MatmulDims {
  int64_t a_nd, b_nd;
  bool b_batched() const { return b_nd > 2; }
  int64_t a_m() const { return a_nd - 2; }
  int64_t a_k() const { return a_nd - 1; }
  int64_t b_k() const { return b_nd - 2; }
  int64_t b_n() const { return b_nd - 1; }
};

struct PerDim {
  Placement a, b, out;
};

// The choice for one mesh dim given the current placements there.
PerDim decide(const MatmulDims& d, Placement pa, Placement pb, int64_t a_numel, int64_t b_numel) {
  // Strided shards and non-sum partials take the plain route through Replicate.
  auto plain = [](Placement p) {
    if (p.is_strided_shard() || (p.is_partial() && p.reduce_op() != ReduceOp::Sum))
      return Replicate();
    return p;
  };
  pa = plain(pa);
  pb = plain(pb);
  const bool a_batch = pa.is_shard() && pa.dim() < d.a_m();
  const bool a_m = pa.is_shard(d.a_m()), a_k = pa.is_shard(d.a_k());
  const bool b_k = pb.is_shard(d.b_k()), b_n = pb.is_shard(d.b_n());
  const bool b_batch = pb.is_shard() && d.b_batched() && pb.dim() < d.b_k();

  if (pa.is_partial() && pb.is_partial()) pb = Replicate();  // reduce one side
  if (pa.is_partial()) return {pa, Replicate(), Partial()};
  if (pb.is_partial()) return {Replicate(), pb, Partial()};

  if (a_k || b_k) {
    // Contraction sharded on one side: cut the other side locally when it is replicated.
    if ((a_k || pa.is_replicate()) && (b_k || pb.is_replicate()))
      return {Shard(d.a_k()), Shard(d.b_k()), Partial()};
  }
  if (a_batch) {
    const int64_t bd = pa.dim() - (d.a_nd - d.b_nd);  // the matching batch dim of b, if any
    if (!d.b_batched() || bd < 0) return {pa, Replicate(), pa};
    // A batched b must be cut on the same batches as a; when b is the larger operand and cut
    // elsewhere, the rules below gather a instead.
    if (pb.is_replicate() || pb.is_shard(bd) || a_numel >= b_numel) return {pa, Shard(bd), pa};
  }
  if (b_batch && pa.is_replicate()) {
    int64_t ad = pb.dim() + (d.a_nd - d.b_nd);
    return {Shard(ad), pb, Shard(ad)};
  }
  if (a_m && (pb.is_replicate() || !b_n)) return {pa, Replicate(), Shard(d.a_m())};
  if (b_n && pa.is_replicate()) return {Replicate(), pb, Shard(d.a_nd - 1)};
  if (pa.is_replicate() && pb.is_replicate()) return {pa, pb, Replicate()};
  // Both sharded in ways that cannot combine: keep the larger operand's shard, gather the other.
  if (a_numel >= b_numel && pa.is_shard() && !a_k && !a_batch)
    return {pa, Replicate(), Shard(d.a_m())};
  if (b_n) return {Replicate(), pb, Shard(d.a_nd - 1)};
  return {Replicate(), Replicate(), Replicate()};
}

ShardingDecision matmul_decision(const DTensor& a, const DTensor& b, const MatmulDims& d) {
  ShardingDecision dec{{{}, {}}, {}};
  for (int64_t m = 0; m < a.mesh().ndim(); ++m) {
    PerDim p =
        decide(d, a.placements()[size_t(m)], b.placements()[size_t(m)], a.numel(), b.numel());
    dec.inputs[0].push_back(p.a);
    dec.inputs[1].push_back(p.b);
    dec.output.push_back(p.out);
  }
  return dec;
}

}  // namespace

DTensor matmul(const DTensor& a, const DTensor& b) {
  dtensor_ops::check_same_mesh("matmul", {a, b});
  if (a.dim() < 2 || b.dim() < 2 || (b.dim() > 2 && b.dim() != a.dim()))
    dtensor_ops::no_rule("matmul", {a, b},
                         "operands must be [..., m, k] with [k, n] or a batch of equal rank");
  TESSERA_CHECK(a.size(-1) == b.size(-2), "matmul: inner dims differ: a ", shape_str(a.shape()),
                " and b ", shape_str(b.shape()));
  MatmulDims d{a.dim(), b.dim()};
  if (d.b_batched())
    for (int64_t i = 0; i < a.dim() - 2; ++i)
      TESSERA_CHECK(a.size(i) == b.size(i), "matmul: batch dims differ: a ", shape_str(a.shape()),
                    " and b ", shape_str(b.shape()));
  Shape out = a.shape();
  out.back() = b.size(-1);
  return dtensor_ops::run("matmul", {a, b}, matmul_decision(a, b, d), out,
                          [](const std::vector<Tensor>& l) { return matmul(l[0], l[1]); });
}

DTensor linear(const DTensor& x, const DTensor& weight, const DTensor& bias) {
  dtensor_ops::check_same_mesh("linear", {x, weight, bias});
  TESSERA_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1), "linear: input ",
                shape_str(x.shape()), " and weight ", shape_str(weight.shape()),
                " do not match (weight must be [out, in] with in = the input's last dim)");
  if (bias.defined())
    TESSERA_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), "linear: bias ",
                  shape_str(bias.shape()), " for weight ", shape_str(weight.shape()));
  // linear(x, W) = x @ W^T: W's placements seen as those of b = W^T ([in, out]).
  const int64_t nd = std::max<int64_t>(x.dim(), 2);
  MatmulDims d{nd, 2};
  auto to_b = [](const Placement& p) {
    return p.kind() == Placement::Kind::Shard ? Shard(1 - p.dim()) : p;
  };
  ShardingDecision dec{{{}, {}, {}}, {}};
  for (int64_t m = 0; m < x.mesh().ndim(); ++m) {
    Placement px = x.placements()[size_t(m)];
    if (x.dim() == 1 && px.is_shard()) px = Shard(px.dim() + 1);  // seen as [1, in]
    PerDim p = decide(d, px, to_b(weight.placements()[size_t(m)]), x.numel(), weight.numel());
    if (x.dim() == 1 && p.a.is_shard()) p.a = Shard(p.a.dim() - 1);
    if (x.dim() == 1 && p.out.is_shard()) p.out = Shard(p.out.dim() - 1);
    dec.inputs[0].push_back(p.a);
    dec.inputs[1].push_back(to_b(p.b));
    // The bias follows the output's last dim: sharded with it, added once when it is Partial.
    Placement pb = Replicate();
    if (p.out.is_shard(x.dim() - 1)) pb = Shard(0);
    if (p.out.is_partial()) pb = Partial();
    dec.inputs[2].push_back(pb);
    dec.output.push_back(p.out);
  }
  Shape out = x.shape();
  out.back() = weight.size(0);
  return dtensor_ops::run("linear", {x, weight, bias}, dec, out,
                          [](const std::vector<Tensor>& l) { return linear(l[0], l[1], l[2]); });
}

DTensor linear_lowrank(const DTensor& x, const DTensor& weight, const DTensor& bias,
                       const DTensor& a, const DTensor& b, double scale, const DTensor& x_lowrank,
                       const LowRankRouting& routing) {
  dtensor_ops::check_same_mesh("linear_lowrank", {x, weight, bias, a, b, x_lowrank});
  if (x_lowrank.defined())
    TESSERA_CHECK(x_lowrank.shape() == x.shape(), "linear_lowrank: x_lowrank ", x_lowrank.str(),
                  " is not shaped like x ", x.str());
  TESSERA_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1) && a.dim() == 2 &&
                    b.dim() == 2 && a.size(1) == weight.size(1) && b.size(0) == weight.size(0) &&
                    a.size(0) == b.size(1),
                "linear_lowrank: input ", shape_str(x.shape()), ", weight ",
                shape_str(weight.shape()), ", a ", shape_str(a.shape()), " and b ",
                shape_str(b.shape()), " do not fit (weight [out, in], a [r, in], b [out, r])");
  const int64_t last = x.dim() - 1;
  ShardingDecision dec{{{}, {}, {}, {}, {}, {}}, {}};
  for (int64_t m = 0; m < x.mesh().ndim(); ++m) {
    const Placement pw = weight.placements()[size_t(m)];
    Placement px = x.placements()[size_t(m)];
    Placement w = pw, xi, ai, bi, bias_p, out;
    if (pw.kind() == Placement::Kind::Shard && pw.dim() == 0) {
      // Column parallel: every rank its slice of the output features.
      xi = Replicate(), ai = Replicate(), bi = Shard(0), bias_p = Shard(0), out = Shard(last);
    } else if (pw.kind() == Placement::Kind::Shard && pw.dim() == 1) {
      // Row parallel: partial sums (b's gradient is then summed over the ranks).
      xi = Shard(last), ai = Shard(1), bi = Replicate(), bias_p = Partial(), out = Partial();
    } else {
      // The weight whole: everything follows x's batch or sequence shards.
      w = Replicate();
      const bool keep = px.kind() == Placement::Kind::Shard && px.dim() != last;
      xi = keep ? px : Replicate();
      ai = Replicate(), bi = Replicate(), bias_p = Replicate(), out = xi;
    }
    dec.inputs[0].push_back(xi);
    dec.inputs[1].push_back(w);
    dec.inputs[2].push_back(bias_p);
    dec.inputs[3].push_back(ai);
    dec.inputs[4].push_back(bi);
    dec.inputs[5].push_back(xi);
    dec.output.push_back(out);
  }
  Shape out = x.shape();
  out.back() = weight.size(0);
  return dtensor_ops::run("linear_lowrank", {x, weight, bias, a, b, x_lowrank}, dec, out,
                          [scale, routing](const std::vector<Tensor>& l) {
                            return linear_lowrank(l[0], l[1], l[2], l[3], l[4], scale, l[5],
                                                  routing);
                          });
}

}  // namespace tessera
