// sum/mean over dims: a reduced sharded dim leaves each rank a partial sum (Partial); kept dims
// stay sharded. mean is the sum scaled by the global count, so partial means add up right.
// softmax/log_softmax need the whole of their dim: a shard of it is gathered first.
#include <algorithm>

#include "dispatch.h"
#include "tessera/autograd/ops.h"
#include "tessera/dtensor/ops.h"

namespace tessera {

namespace {

using dtensor_ops::ShardingDecision;

std::vector<int64_t> normalize_dims(const std::vector<int64_t>& dims, int64_t nd, const char* op) {
  std::vector<int64_t> out;
  if (dims.empty()) {
    for (int64_t d = 0; d < nd; ++d)
      out.push_back(d);
  } else {
    for (int64_t d : dims)
      out.push_back(wrap_dim(d, nd, op));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// The geometry of a reduction over `dims`: which input dims go, where a kept one lands, and the
// output's shape.
struct Reduced {
  std::vector<int64_t> dims;  // sorted, unique
  bool keepdim;

  bool has(int64_t d) const { return std::binary_search(dims.begin(), dims.end(), d); }
  int64_t out_dim(int64_t d) const {
    if (keepdim) return d;
    return d - std::count_if(dims.begin(), dims.end(), [&](int64_t r) { return r < d; });
  }
  Shape out_shape(const Shape& in) const {
    Shape out;
    for (int64_t d = 0; d < int64_t(in.size()); ++d) {
      if (!has(d))
        out.push_back(in[size_t(d)]);
      else if (keepdim)
        out.push_back(1);
    }
    return out;
  }
};

DTensor reduce_sum(const char* op, const DTensor& x, const std::vector<int64_t>& dims_in,
                   bool keepdim, double scale) {
  const Reduced r{normalize_dims(dims_in, x.dim(), op), keepdim};
  ShardingDecision dec{{{}}, {}};
  for (const Placement& p0 : x.placements()) {
    Placement p = p0;
    if (p.is_partial() && p.reduce_op() != ReduceOp::Sum) p = Replicate();
    if (p.is_strided_shard() && !r.has(p.dim())) p = Replicate();
    dec.inputs[0].push_back(p);
    if (p.is_shard() && r.has(p.dim())) {
      dec.output.push_back(Partial());
    } else if (p.is_shard()) {
      dec.output.push_back(Shard(r.out_dim(p.dim())));
    } else {
      dec.output.push_back(p);
    }
  }
  return dtensor_ops::run(op, {x}, dec, r.out_shape(x.shape()),
                          [dims = r.dims, keepdim, scale](const std::vector<Tensor>& l) {
                            Tensor s = sum(l[0], dims, keepdim);
                            return scale == 1.0 ? s : mul(s, scale);
                          });
}

ShardingDecision keep_dim_whole(const DTensor& x, int64_t dim) {
  ShardingDecision dec{{{}}, {}};
  for (const Placement& p : x.placements()) {
    Placement q = (p.is_shard(dim) || p.is_partial()) ? Replicate() : p;
    dec.inputs[0].push_back(q);
    dec.output.push_back(q);
  }
  return dec;
}

}  // namespace

DTensor sum(const DTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce_sum("sum", x, dims, keepdim, 1.0);
}

DTensor mean(const DTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  int64_t count = 1;
  for (int64_t d : normalize_dims(dims, x.dim(), "mean"))
    count *= x.size(d);
  TESSERA_CHECK(count > 0, "mean over empty dims of ", shape_str(x.shape()));
  return reduce_sum("mean", x, dims, keepdim, 1.0 / double(count));
}

DTensor amax(const DTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  const Reduced r{normalize_dims(dims, x.dim(), "amax"), keepdim};
  ShardingDecision dec{{{}}, {}};
  for (const Placement& p : x.placements()) {
    // The reduced dims whole on every rank, so that the gradient finds the global maxima; a
    // strided shard of a kept dim is gathered as in sum (its dim is renumbered).
    const bool gather =
        p.is_partial() || (p.is_shard() && (r.has(p.dim()) || p.is_strided_shard()));
    const Placement q = gather ? Replicate() : p;
    dec.inputs[0].push_back(q);
    dec.output.push_back(q.is_shard() ? Shard(r.out_dim(q.dim())) : q);
  }
  return dtensor_ops::run(
      "amax", {x}, dec, r.out_shape(x.shape()),
      [dims = r.dims, keepdim](const std::vector<Tensor>& l) { return amax(l[0], dims, keepdim); });
}

DTensor softmax(const DTensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim(), "softmax");
  return dtensor_ops::run("softmax", {x}, keep_dim_whole(x, dim), x.shape(),
                          [dim](const std::vector<Tensor>& l) { return softmax(l[0], dim); });
}

DTensor log_softmax(const DTensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim(), "log_softmax");
  return dtensor_ops::run("log_softmax", {x}, keep_dim_whole(x, dim), x.shape(),
                          [dim](const std::vector<Tensor>& l) { return log_softmax(l[0], dim); });
}

}  // namespace tessera
