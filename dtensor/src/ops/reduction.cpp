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

DTensor reduce_sum(const char* op, const DTensor& x, const std::vector<int64_t>& dims_in,
                   bool keepdim, double scale) {
  std::vector<int64_t> dims = normalize_dims(dims_in, x.dim(), op);
  auto reduced = [&](int64_t d) { return std::binary_search(dims.begin(), dims.end(), d); };
  ShardingDecision dec{{{}}, {}};
  for (const Placement& p0 : x.placements()) {
    Placement p = p0;
    if (p.is_partial() && p.reduce_op() != ReduceOp::Sum) p = Replicate();
    if (p.is_strided_shard() && !reduced(p.dim())) p = Replicate();
    dec.inputs[0].push_back(p);
    if (p.is_shard() && reduced(p.dim())) {
      dec.output.push_back(Partial());
    } else if (p.is_shard()) {
      int64_t od = p.dim();
      if (!keepdim)
        od -= std::count_if(dims.begin(), dims.end(), [&](int64_t d) { return d < p.dim(); });
      dec.output.push_back(Shard(od));
    } else {
      dec.output.push_back(p);
    }
  }
  Shape out;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (!reduced(d))
      out.push_back(x.size(d));
    else if (keepdim)
      out.push_back(1);
  }
  return dtensor_ops::run(op, {x}, dec, out, [dims, keepdim, scale](const std::vector<Tensor>& l) {
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

DTensor amax(const DTensor& x, const std::vector<int64_t>& dims_in, bool keepdim) {
  std::vector<int64_t> dims = normalize_dims(dims_in, x.dim(), "amax");
  auto reduced = [&](int64_t d) { return std::binary_search(dims.begin(), dims.end(), d); };
  ShardingDecision dec{{{}}, {}};
  for (const Placement& p : x.placements()) {
    // The reduced dims whole on every rank, so that the gradient finds the global maxima; a
    // strided shard of a kept dim is gathered as in sum (its dim is renumbered).
    const bool gather =
        p.is_partial() || (p.is_shard() && (reduced(p.dim()) || p.is_strided_shard()));
    const Placement q = gather ? Replicate() : p;
    dec.inputs[0].push_back(q);
    if (q.is_shard() && !keepdim) {
      const int64_t below =
          std::count_if(dims.begin(), dims.end(), [&](int64_t d) { return d < q.dim(); });
      dec.output.push_back(Shard(q.dim() - below));
    } else {
      dec.output.push_back(q);
    }
  }
  Shape out;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (!reduced(d))
      out.push_back(x.size(d));
    else if (keepdim)
      out.push_back(1);
  }
  return dtensor_ops::run("amax", {x}, dec, out, [dims, keepdim](const std::vector<Tensor>& l) {
    return amax(l[0], dims, keepdim);
  });
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
