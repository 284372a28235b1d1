// Sharding rules of embedding, RMSNorm and LayerNorm (see nn_ops.h), and the local lookup of a
// vocabulary shard: ids outside this rank's rows give zero rows, so the ranks' results add up to
// the full lookup (Partial), and the backward scatters only into the rows this rank owns.
#include "tessera/dtensor/nn_ops.h"

#include <algorithm>
#include <limits>

#include "dispatch.h"
#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/core/kernels/vocab_parallel.h"

namespace tessera {

namespace {

using dtensor_ops::ShardingDecision;
using dtensor_ops::sum_partial;

// Inputs {ids, weight rows [start, start + rows) of a [vocab, D] table}; only the weight is
// differentiable.
class VocabShardEmbedding final : public autograd::Function {
 public:
  VocabShardEmbedding(int64_t start, int64_t vocab) : start_(start), vocab_(vocab) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    const Tensor& ids = in[0];
    const Tensor& w = in[1];
    rows_ = w.size(0);
    dim_ = w.size(1);
    // Rows owned elsewhere are filled with zeros rather than multiplied by a 0/1 mask, so that
    // a non-finite value in this rank's table cannot leak into another rank's rows.
    auto [shifted, foreign] = kernels::vocab_shard_ids(ids, start_, rows_, vocab_);
    dtype_ = w.dtype();
    save_for_backward({shifted, foreign});
    Shape out_shape = ids.shape();
    out_shape.push_back(dim_);
    if (rows_ == 0) return {zeros(out_shape, TensorOptions(w.dtype(), w.device()))};
    return {kernels::masked_fill(kernels::embedding(w, shifted), foreign, 0.0)};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    if (!needs_input_grad(1)) return {Tensor(), Tensor()};
    if (rows_ == 0) return {Tensor(), zeros({0, dim_}, TensorOptions(dtype_, g[0].device()))};
    const Tensor& shifted = saved_tensors()[0];
    const Tensor& foreign = saved_tensors()[1];
    Tensor masked = kernels::masked_fill(g[0], foreign, 0.0);
    return {Tensor(), kernels::embedding_backward(masked, shifted, rows_).to(dtype_)};
  }

 private:
  int64_t start_, vocab_;
  int64_t rows_ = 0, dim_ = 0;
  DType dtype_ = DType::Float32;
};

ShardingDecision embedding_decision(const DTensor& ids, const DTensor& weight) {
  ShardingDecision dec{{{}, {}}, {}};
  const int64_t out_last = ids.dim();
  for (int64_t m = 0; m < ids.mesh().ndim(); ++m) {
    Placement pi = ids.placements()[size_t(m)];
    Placement pw = weight.placements()[size_t(m)];
    // Ids are never summed by a lookup, and a strided shard of the table has no row range. A
    // strided shard of the ids is valid only beside the shards of later mesh dims, which the
    // cases below may replace by Replicate.
    if (pi.is_partial() || pi.is_strided_shard()) pi = Replicate();
    if (pw.is_strided_shard() || (pw.is_partial() && !sum_partial(pw))) pw = Replicate();
    if (pw.is_shard(0) || sum_partial(pw)) {
      dec.inputs[0].push_back(Replicate());
      dec.inputs[1].push_back(pw);
      dec.output.push_back(Partial());
    } else if (pw.is_shard(1)) {
      // Ids are the small operand: gathering them keeps the table's columns split.
      dec.inputs[0].push_back(Replicate());
      dec.inputs[1].push_back(pw);
      dec.output.push_back(Shard(out_last));
    } else {
      dec.inputs[0].push_back(pi);
      dec.inputs[1].push_back(Replicate());
      dec.output.push_back(pi);
    }
  }
  return dec;
}

// `ids` placed as the lookup takes them: where they stay sharded, each rank looks up and checks
// only its own, and a bad id must fail every rank, not one while the others go on to their next
// collective. Ranks that differ only along the other mesh dims hold the same ids.
void agree_ids_in_range(const DTensor& ids, int64_t vocab) {
  std::vector<int64_t> dims;
  for (int64_t m = 0; m < ids.mesh().ndim(); ++m)
    if (ids.placements()[size_t(m)].is_shard() && ids.mesh().size(m) > 1) dims.push_back(m);
  if (dims.empty()) return;
  int64_t found = 0, bad = std::numeric_limits<int64_t>::min();
  for (int64_t id : ids.to_local().to(DType::Int64).to_vector<int64_t>())
    if (id < 0 || id >= vocab) {
      found = 1;
      bad = std::max(bad, id);
    }
  Tensor flag = from_vector<int64_t>({found, bad}, {2}).to(ids.mesh().device());
  for (int64_t m : dims)
    ids.mesh().group(m)->all_reduce(flag, ReduceOp::Max)->wait();
  const std::vector<int64_t> f = flag.to_vector<int64_t>();
  TESSERA_CHECK(f[0] == 0, "embedding: id ", f[1], " (", found ? "on this rank" : "on another rank",
                ") is out of range for num_embeddings ", vocab, " (ids ", ids.str(), ")");
}

ShardingDecision norm_decision(const DTensor& x, size_t n_params) {
  ShardingDecision dec;
  dec.inputs.resize(1 + n_params);
  const int64_t last = x.dim() - 1;
  for (const Placement& p : x.placements()) {
    const Placement q = (p.is_partial() || p.is_shard(last)) ? Replicate() : p;
    dec.inputs[0].push_back(q);
    for (size_t i = 1; i <= n_params; ++i)
      dec.inputs[i].push_back(Replicate());
    dec.output.push_back(q);
  }
  return dec;
}

void check_norm_args(const char* op, const DTensor& x, const std::vector<DTensor>& params) {
  TESSERA_CHECK(x.defined() && x.dim() >= 1, op,
                ": input must be a DTensor of at least 1 dim, got ",
                x.defined() ? x.str() : std::string("undefined"));
  for (const DTensor& p : params) {
    if (!p.defined()) continue;
    TESSERA_CHECK(p.dim() == 1 && p.size(0) == x.size(-1), op, ": weight/bias ",
                  shape_str(p.shape()), " does not match the normalised dim of input ",
                  shape_str(x.shape()), " (expected [", x.size(-1), "])");
  }
}

}  // namespace

DTensor embedding(const DTensor& ids, const DTensor& weight) {
  TESSERA_CHECK(ids.defined() && weight.defined(), "embedding: undefined ids or weight");
  dtensor_ops::check_same_mesh("embedding", {ids, weight});
  TESSERA_CHECK(ids.dtype() == DType::Int64 || ids.dtype() == DType::Int32,
                "embedding: ids must be int64 or int32, got ", ids.str());
  TESSERA_CHECK(weight.dim() == 2, "embedding: weight must be [V, D], got ", weight.str());
  ShardingDecision dec = embedding_decision(ids, weight);
  Shape out = ids.shape();
  out.push_back(weight.size(1));
  // Placed before the check (a collective every rank makes, whatever its ids), so that the
  // check sees what each lookup will.
  const DTensor placed = ids.redistribute(dec.inputs[0]);
  agree_ids_in_range(placed, weight.size(0));
  bool vocab_sharded = false;
  for (const Placement& p : dec.inputs[1])
    vocab_sharded = vocab_sharded || p.is_shard(0);
  if (!vocab_sharded)
    return dtensor_ops::run("embedding", {placed, weight}, dec, out,
                            [](const std::vector<Tensor>& l) { return embedding(l[0], l[1]); });
  // The rows this rank holds once the weight has the placements the rule asks for.
  const DTensorSpec wspec(weight.mesh(), dec.inputs[1], weight.shape(), weight.dtype());
  const int64_t start = wspec.local_layout().global_offset[0];
  const int64_t vocab = weight.size(0);
  return dtensor_ops::run(
      "embedding", {placed, weight}, dec, out, [start, vocab](const std::vector<Tensor>& l) {
        return autograd::Function::apply<VocabShardEmbedding>({l[0], l[1]}, start, vocab)[0];
      });
}

DTensor rms_norm(const DTensor& x, const DTensor& weight, double eps) {
  check_norm_args("rms_norm", x, {weight});
  dtensor_ops::check_same_mesh("rms_norm", {x, weight});
  return dtensor_ops::run(
      "rms_norm", {x, weight}, norm_decision(x, 1), x.shape(),
      [eps](const std::vector<Tensor>& l) { return rms_norm(l[0], l[1], eps); });
}

DTensor layer_norm(const DTensor& x, const DTensor& weight, const DTensor& bias, double eps) {
  check_norm_args("layer_norm", x, {weight, bias});
  dtensor_ops::check_same_mesh("layer_norm", {x, weight, bias});
  return dtensor_ops::run(
      "layer_norm", {x, weight, bias}, norm_decision(x, 2), x.shape(),
      [eps](const std::vector<Tensor>& l) { return layer_norm(l[0], l[1], l[2], eps); });
}

}  // namespace tessera
