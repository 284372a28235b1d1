// Loss-parallel cross-entropy (Megatron's vocab-parallel cross-entropy): the logits stay sharded
// on the vocabulary dim. Three per-row statistics cross the ranks instead of the [N, V] logits:
// the max (for a stable exp), the sum of exponentials and the target's logit.
#include "tessera/nn/loss.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "tessera/autograd/function.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"

namespace tessera {

namespace {

constexpr const char* kOp = "vocab_parallel_cross_entropy";

// Where this rank's slice sits in the vocabulary and which groups hold the other slices.
struct VocabShard {
  int64_t vocab_size = 0;
  int64_t start = 0;
  int64_t length = 0;
  std::vector<ProcessGroupPtr> groups;  // one per mesh dim that shards the vocabulary
};

// Per-row statistics kept for the backward: the row's log-sum-exp over the whole vocabulary.
class VocabParallelCrossEntropy final : public autograd::Function {
 public:
  VocabParallelCrossEntropy(VocabShard shard, std::vector<int64_t> target, int64_t kept)
      : shard_(std::move(shard)), target_(std::move(target)), kept_(kept) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    const Tensor& logits = in[0];
    shape_ = logits.shape();
    dtype_ = logits.dtype();
    const DType cdt = compute_dtype(dtype_);
    const int64_t n = shard_.length, rows = int64_t(target_.size());
    Tensor x = kernels::reshape(logits.detach().to(cdt).contiguous(), {rows, n});
    Tensor lse = empty({rows}, cdt);
    Tensor loss;
    if (cdt == DType::Float64)
      loss = run<double>(x, lse);
    else
      loss = run<float>(x, lse);
    save_for_backward({x, lse});
    return {loss.to(dtype_)};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    const std::vector<Tensor>& s = saved_tensors();
    const double scale = g[0].to(DType::Float64).item<double>() / double(kept_);
    Tensor grad = s[0].dtype() == DType::Float64 ? grad_rows<double>(s[0], s[1], scale)
                                                 : grad_rows<float>(s[0], s[1], scale);
    return {kernels::reshape(grad, shape_).to(dtype_)};
  }

 private:
  void all_reduce(Tensor& t, ReduceOp op) const {
    for (const ProcessGroupPtr& g : shard_.groups)
      g->all_reduce(t, op)->wait();
  }

  // The target's local column, or -1 when another rank owns it or the row is ignored.
  int64_t local_target(size_t row) const {
    const int64_t t = target_[row];
    return t >= shard_.start && t < shard_.start + shard_.length ? t - shard_.start : -1;
  }

  template <class C>
  Tensor run(const Tensor& x, Tensor& lse_out) {
    const int64_t n = shard_.length, rows = int64_t(target_.size());
    const C* px = x.data<C>();
    const C neg_inf = -std::numeric_limits<C>::infinity();
    Tensor row_max = full({rows}, double(neg_inf), DTypeOf<C>::value);
    C* pm = row_max.data<C>();
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < n; ++j)
        pm[i] = std::max(pm[i], px[i * n + j]);
    all_reduce(row_max, ReduceOp::Max);

    // Row i: [sum of exp(l - max) over this slice, the target logit if this slice holds it].
    Tensor stats = zeros({rows, 2}, DTypeOf<C>::value);
    C* ps = stats.data<C>();
    for (int64_t i = 0; i < rows; ++i) {
      // An all -inf row would make every term exp(nan); shifting by 0 keeps it exp(-inf) = 0.
      const C shift = std::isfinite(pm[i]) ? pm[i] : C(0);
      C acc = 0;
      for (int64_t j = 0; j < n; ++j)
        acc += std::exp(px[i * n + j] - shift);
      ps[2 * i] = acc;
      const int64_t lt = local_target(size_t(i));
      if (lt >= 0) ps[2 * i + 1] = px[i * n + lt];
    }
    all_reduce(stats, ReduceOp::Sum);

    C* pl = lse_out.data<C>();
    double total = 0;
    for (int64_t i = 0; i < rows; ++i) {
      const C shift = std::isfinite(pm[i]) ? pm[i] : C(0);
      pl[i] = std::log(ps[2 * i]) + shift;
      if (target_[size_t(i)] >= 0) total += double(pl[i] - ps[2 * i + 1]);
    }
    // Mean over zero kept rows is 0/0, as in cross_entropy and PyTorch.
    const double mean = kept_ ? total / double(kept_) : std::numeric_limits<double>::quiet_NaN();
    return scalar_tensor(double(C(mean)), DTypeOf<C>::value);
  }

  template <class C>
  Tensor grad_rows(const Tensor& x, const Tensor& lse, double scale) const {
    const int64_t n = shard_.length, rows = int64_t(target_.size());
    Tensor out = zeros({rows, n}, DTypeOf<C>::value);
    const C* px = x.data<C>();
    const C* pl = lse.data<C>();
    C* po = out.data<C>();
    for (int64_t i = 0; i < rows; ++i) {
      if (target_[size_t(i)] < 0) continue;
      const int64_t lt = local_target(size_t(i));
      for (int64_t j = 0; j < n; ++j) {
        const C p = std::exp(px[i * n + j] - pl[i]) - (j == lt ? C(1) : C(0));
        po[i * n + j] = C(p * C(scale));
      }
    }
    return out;
  }

  VocabShard shard_;
  std::vector<int64_t> target_;  // ignored rows hold -1
  int64_t kept_;
  Shape shape_;
  DType dtype_ = DType::Float32;
};

}  // namespace

DTensor vocab_parallel_cross_entropy(const DTensor& logits, const Tensor& target,
                                     int64_t ignore_index) {
  TESSERA_CHECK(logits.defined(), kOp, ": logits are undefined");
  TESSERA_CHECK(target.defined(), kOp, ": target is undefined");
  const DTensorSpec& spec = logits.spec();
  TESSERA_CHECK(spec.ndim() >= 1 && is_floating(spec.dtype), kOp,
                ": logits must be a floating-point [..., V] DTensor, got ", spec.str());
  const int64_t vdim = spec.ndim() - 1;
  const Shape row_shape(spec.global_shape.begin(), spec.global_shape.end() - 1);
  TESSERA_CHECK(target.dtype() == DType::Int64, kOp, ": target must be int64 class indices, got ",
                target.str());
  TESSERA_CHECK(target.shape() == row_shape, kOp, ": target ", shape_str(target.shape()),
                " does not match logits ", shape_str(spec.global_shape), " (expected ",
                shape_str(row_shape), ", the logits' shape without the vocabulary dim)");

  VocabShard shard;
  shard.vocab_size = spec.global_shape.back();
  for (size_t d = 0; d < spec.placements.size(); ++d) {
    const Placement p = spec.placements[d].normalized(spec.ndim());
    if (p.is_replicate()) continue;
    // Rows split over ranks would need the target split the same way; a strided vocabulary
    // slice is not one contiguous range of class ids.
    TESSERA_CHECK(p.kind() == Placement::Kind::Shard && p.dim() == vdim, kOp, ": logits ",
                  spec.str(), " have ", p.str(), " on mesh dim ", d,
                  "; every mesh dim must be Replicate or Shard(-1) (the vocabulary dim)",
                  p.is_partial() ? " — redistribute Partial logits first" : "");
    shard.groups.push_back(spec.mesh.group(int64_t(d)));
  }

  if (shard.groups.empty()) {
    // Every rank holds the whole vocabulary: the plain loss is already replicated.
    Tensor loss = cross_entropy(logits.to_local(), target, ignore_index);
    return DTensor::from_local(loss, spec.mesh, Placements(spec.placements.size()), Shape{});
  }

  const LocalLayout layout = spec.local_layout();
  shard.start = layout.global_offset.back();
  shard.length = layout.local_shape.back();
  TESSERA_CHECK(logits.to_local().shape() == layout.local_shape, kOp, ": local logits ",
                shape_str(logits.to_local().shape()), " do not match the local shape ",
                shape_str(layout.local_shape), " of ", spec.str());

  std::vector<int64_t> t = target.to_vector<int64_t>();
  int64_t kept = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == ignore_index) {
      t[i] = -1;
      continue;
    }
    TESSERA_CHECK(t[i] >= 0 && t[i] < shard.vocab_size, kOp, ": target ", t[i], " at row ", i,
                  " is out of range for a vocabulary of ", shard.vocab_size, " (ignore_index is ",
                  ignore_index, ")");
    ++kept;
  }

  Tensor loss = autograd::Function::apply<VocabParallelCrossEntropy>(
      {logits.to_local()}, std::move(shard), std::move(t), kept)[0];
  return DTensor::from_local(loss, spec.mesh, Placements(spec.placements.size()), Shape{});
}

}  // namespace tessera
