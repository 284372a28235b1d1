// Views of DTensors. A view keeps a sharded dim intact when that dim leads the group of dims it
// is merged with or split into and the shard count divides the sizes involved (so each rank's
// chunk of the old dim is exactly its chunk of the new one). Anything else would need data
// movement: `view` refuses it with an error naming the op, shapes and placements, while
// `reshape`, which may copy, first gathers the tensor dims whose shards cannot stay intact, as
// PyTorch's DTensor does (its view is strict, its reshape redistributes).
#include "dispatch.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/ops.h"

namespace tessera {

namespace {

using dtensor_ops::ShardingDecision;

// `p` with its shard moved to tensor dim `dim` (the kind and split factor kept).
Placement moved(const Placement& p, int64_t dim) {
  return p.is_strided_shard() ? StridedShard(dim, p.split_factor()) : Shard(dim);
}

struct Group {
  int64_t in_begin, in_end, out_begin, out_end;  // [begin, end)
};

// Splits the two shapes into runs of dims with equal products.
std::vector<Group> group_dims(const Shape& in, const Shape& out) {
  std::vector<Group> groups;
  size_t i = 0, j = 0;
  while (i < in.size() || j < out.size()) {
    Group g{int64_t(i), int64_t(i), int64_t(j), int64_t(j)};
    int64_t pi = 1, po = 1;
    if (i < in.size()) pi = in[i++];
    if (j < out.size()) po = out[j++];
    while (pi != po) {
      if (pi < po && i < in.size())
        pi *= in[i++];
      else if (j < out.size())
        po *= out[j++];
      else
        break;
    }
    g.in_end = int64_t(i);
    g.out_end = int64_t(j);
    groups.push_back(g);
  }
  return groups;
}

int64_t first_nontrivial(const Shape& s, int64_t b, int64_t e) {
  for (int64_t k = b; k < e; ++k)
    if (s[size_t(k)] != 1) return k;
  return b;
}

// Why the shards of tensor dim `d` (over every mesh dim that shards it, `k` pieces in all) cannot
// stay intact in `out`, or "" when they can; `lead_out` receives the output dim they land on.
std::string shard_break(const Shape& in, const Shape& out, const std::vector<Group>& groups,
                        int64_t d, int64_t k, int64_t& lead_out) {
  const Group* g = nullptr;
  for (const Group& gr : groups)
    if (d >= gr.in_begin && d < gr.in_end) g = &gr;
  lead_out = g ? first_nontrivial(out, g->out_begin, g->out_end) : -1;
  bool ok = g && first_nontrivial(in, g->in_begin, g->in_end) == d && lead_out < g->out_end;
  if (ok) {
    bool one_to_one =
        in[size_t(d)] == out[size_t(lead_out)] &&
        shape_numel(Shape(in.begin() + g->in_begin, in.begin() + g->in_end)) == in[size_t(d)];
    ok = one_to_one || (in[size_t(d)] % k == 0 && out[size_t(lead_out)] % k == 0);
  }
  if (ok) return "";
  return "sharded dim " + std::to_string(d) + " does not stay intact in shape " + shape_str(out) +
         " (redistribute it first)";
}

// The placements of a view of `x` as `out`. With `strict` (view) a shard that cannot stay intact
// is an error; without (reshape) every shard of that tensor dim becomes Replicate on the input,
// gathered before the local reshape.
ShardingDecision view_decision(const char* op, const DTensor& x, const Shape& out, bool strict) {
  const Shape& in = x.shape();
  const Placements& ps = x.placements();
  const int64_t nm = x.mesh().ndim();
  ShardingDecision dec{{{}}, {}};
  if (shape_numel(in) == 0) {
    for (const Placement& p : ps) {
      const bool keep = !p.is_shard() || out.size() == in.size();
      if (!keep && strict)
        dtensor_ops::no_rule(op, {x}, "cannot view an empty sharded tensor as " + shape_str(out));
      dec.inputs[0].push_back(keep ? p : Replicate());
      dec.output.push_back(keep ? p : Replicate());
    }
    return dec;
  }
  std::vector<Group> groups = group_dims(in, out);
  // Tensor dims whose shards move, and where each kept one lands.
  std::vector<std::string> broken(in.size());
  std::vector<int64_t> lead(in.size(), -1);
  for (int64_t d = 0; d < int64_t(in.size()); ++d) {
    int64_t k = 1;
    bool sharded = false;
    for (int64_t m = 0; m < nm; ++m) {
      if (!ps[size_t(m)].is_shard(d)) continue;
      k *= x.mesh().size(m);
      sharded = true;
    }
    if (sharded) broken[size_t(d)] = shard_break(in, out, groups, d, k, lead[size_t(d)]);
  }
  for (const Placement& p : ps) {
    if (!p.is_shard()) {
      dec.inputs[0].push_back(p);
      dec.output.push_back(p);
      continue;
    }
    const std::string& why = broken[size_t(p.dim())];
    if (!why.empty()) {
      if (strict) dtensor_ops::no_rule(op, {x}, why);
      dec.inputs[0].push_back(Replicate());
      dec.output.push_back(Replicate());
      continue;
    }
    dec.inputs[0].push_back(p);
    dec.output.push_back(moved(p, lead[size_t(p.dim())]));
  }
  return dec;
}

}  // namespace

DTensor view(const DTensor& x, const Shape& shape) {
  Shape out = kernels::infer_shape(shape, x.numel(), "view");
  ShardingDecision dec = view_decision("view", x, out, true);
  auto spec = std::make_shared<const DTensorSpec>(x.mesh(), dec.output, out, x.dtype());
  Shape local = spec->local_layout().local_shape;
  return dtensor_ops::run("view", {x}, dec, out,
                          [local](const std::vector<Tensor>& l) { return view(l[0], local); });
}

DTensor reshape(const DTensor& x, const Shape& shape) {
  Shape out = kernels::infer_shape(shape, x.numel(), "reshape");
  ShardingDecision dec = view_decision("reshape", x, out, false);
  auto spec = std::make_shared<const DTensorSpec>(x.mesh(), dec.output, out, x.dtype());
  Shape local = spec->local_layout().local_shape;
  return dtensor_ops::run("reshape", {x}, dec, out,
                          [local](const std::vector<Tensor>& l) { return reshape(l[0], local); });
}

DTensor transpose(const DTensor& x, int64_t d0, int64_t d1) {
  d0 = wrap_dim(d0, x.dim(), "transpose");
  d1 = wrap_dim(d1, x.dim(), "transpose");
  ShardingDecision dec{{x.placements()}, {}};
  for (const Placement& p : x.placements()) {
    if (!p.is_shard() || (p.dim() != d0 && p.dim() != d1)) {
      dec.output.push_back(p);
      continue;
    }
    int64_t nd = p.dim() == d0 ? d1 : d0;
    dec.output.push_back(moved(p, nd));
  }
  Shape out = x.shape();
  std::swap(out[size_t(d0)], out[size_t(d1)]);
  return dtensor_ops::run("transpose", {x}, dec, out, [d0, d1](const std::vector<Tensor>& l) {
    return transpose(l[0], d0, d1);
  });
}

DTensor permute(const DTensor& x, const std::vector<int64_t>& dims) {
  const int64_t nd = x.dim();
  TESSERA_CHECK(int64_t(dims.size()) == nd, "permute: ", dims.size(), " dims given for ", x.str());
  std::vector<int64_t> order, position(size_t(nd), -1);
  Shape out;
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim(dims[i], nd, "permute");
    TESSERA_CHECK(position[size_t(d)] < 0, "permute: dim ", d, " repeated in ", shape_str(dims),
                  " for ", x.str());
    position[size_t(d)] = int64_t(i);
    order.push_back(d);
    out.push_back(x.size(d));
  }
  ShardingDecision dec{{x.placements()}, {}};
  for (const Placement& p : x.placements())
    dec.output.push_back(p.is_shard() ? moved(p, position[size_t(p.dim())]) : p);
  return dtensor_ops::run("permute", {x}, dec, out,
                          [order](const std::vector<Tensor>& l) { return permute(l[0], order); });
}

DTensor unsqueeze(const DTensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim() + 1, "unsqueeze");
  ShardingDecision dec{{x.placements()}, {}};
  for (const Placement& p : x.placements())
    dec.output.push_back(p.is_shard() && p.dim() >= dim ? moved(p, p.dim() + 1) : p);
  Shape out = x.shape();
  out.insert(out.begin() + dim, 1);
  return dtensor_ops::run("unsqueeze", {x}, dec, out,
                          [dim](const std::vector<Tensor>& l) { return unsqueeze(l[0], dim); });
}

DTensor squeeze(const DTensor& x, int64_t dim) {
  TESSERA_CHECK(x.dim() > 0, "squeeze: ", x.str(), " has no dims");
  dim = wrap_dim(dim, x.dim(), "squeeze");
  // A dim of another size stays, as in PyTorch. The decision is the global size's: a shard of
  // a longer dim may have local size 1 on some rank, which must not squeeze there.
  const bool drop = x.size(dim) == 1;
  ShardingDecision dec{{{}}, {}};
  for (const Placement& p : x.placements()) {
    // Only the first rank of the mesh dim holds the one element of a sharded size-1 dim.
    const Placement q = drop && p.is_shard(dim) ? Replicate() : p;
    dec.inputs[0].push_back(q);
    dec.output.push_back(drop && q.is_shard() && q.dim() > dim ? moved(q, q.dim() - 1) : q);
  }
  Shape out = x.shape();
  if (drop) out.erase(out.begin() + dim);
  return dtensor_ops::run("squeeze", {x}, dec, out, [dim, drop](const std::vector<Tensor>& l) {
    return drop ? squeeze(l[0], dim) : view(l[0], l[0].shape());
  });
}

DTensor flatten(const DTensor& x, int64_t start_dim, int64_t end_dim) {
  return reshape(x, kernels::flatten_shape(x.shape(), start_dim, end_dim));
}

namespace {

// Placements for an op along tensor dim `dim`: a shard of that dim is gathered (Replicate);
// every other placement, Partial included (cat and narrow are linear), is kept.
Placements along_dim(const Placements& ps, int64_t dim) {
  Placements out;
  for (const Placement& p : ps)
    out.push_back(p.is_shard(dim) ? Replicate() : p);
  return out;
}

}  // namespace

DTensor cat(const std::vector<DTensor>& xs, int64_t dim) {
  TESSERA_CHECK(!xs.empty(), "cat: no DTensors");
  dtensor_ops::check_same_mesh("cat", xs);
  const int64_t nd = xs[0].dim();
  dim = wrap_dim(dim, nd, "cat");
  Shape out = xs[0].shape();
  out[size_t(dim)] = 0;
  for (const DTensor& x : xs) {
    TESSERA_CHECK(x.dim() == nd && x.dtype() == xs[0].dtype(), "cat: ", x.str(), " and ",
                  xs[0].str(), " differ in rank or dtype");
    for (int64_t d = 0; d < nd; ++d)
      TESSERA_CHECK(d == dim || x.size(d) == xs[0].size(d), "cat: shapes ", shape_str(x.shape()),
                    " and ", shape_str(xs[0].shape()), " differ outside dim ", dim);
    out[size_t(dim)] += x.size(dim);
  }
  // Every input in the first one's placements (its shards of `dim` gathered).
  const Placements target = along_dim(xs[0].placements(), dim);
  ShardingDecision dec{std::vector<Placements>(xs.size(), target), target};
  return dtensor_ops::run("cat", xs, dec, out,
                          [dim](const std::vector<Tensor>& l) { return cat(l, dim); });
}

DTensor narrow(const DTensor& x, int64_t dim, int64_t start, int64_t length) {
  dim = wrap_dim(dim, x.dim(), "narrow");
  TESSERA_CHECK(start >= 0 && length >= 0 && start + length <= x.size(dim), "narrow: [", start,
                ", ", start + length, ") out of dim ", dim, " of ", x.str());
  const Placements target = along_dim(x.placements(), dim);
  Shape out = x.shape();
  out[size_t(dim)] = length;
  return dtensor_ops::run("narrow", {x}, ShardingDecision{{target}, target}, out,
                          [dim, start, length](const std::vector<Tensor>& l) {
                            return narrow(l[0], dim, start, length);
                          });
}

}  // namespace tessera
