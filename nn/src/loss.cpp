// Loss-parallel cross-entropy (Megatron's vocab-parallel cross-entropy): the logits stay sharded
// on the vocabulary dim. Three per-row statistics cross the ranks instead of the [N, V] logits:
// the max (for a stable exp), the sum of exponentials and the target's logit.
#include "tessera/nn/loss.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/autograd/function.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/core/kernels/shape_ops.h"
#include "tessera/core/kernels/views.h"
#include "tessera/core/kernels/vocab_parallel.h"

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

// Class weights as the Function needs them (undefined tensors without weights, where every class
// weighs 1): the weights of the rows' targets, this rank's slice of the class weights, their
// total over the vocabulary and a mean's divisor. The weight is global and the target
// replicated, so each rank finds all of these without a collective.
struct RowWeights {
  Tensor rows;   // [N] w[target] of the compute dtype, 0 on ignored rows
  Tensor slice;  // [length] w[start, start + length) of the compute dtype
  double total = 0;
  int64_t kept = 0;    // rows whose target is not ignore_index
  double divisor = 0;  // sum of the kept rows' weights (their count without weights)
  bool defined() const { return rows.defined(); }
};

// Per-row statistics kept for the backward: the row's log-sum-exp over the whole vocabulary.
class VocabParallelCrossEntropy final : public autograd::Function {
 public:
  // target: int64 [N] on the logits' device, -1 for ignored rows.
  VocabParallelCrossEntropy(VocabShard shard, Tensor target, RowWeights weights,
                            kernels::Reduction reduction, double label_smoothing)
      : shard_(std::move(shard)),
        target_(std::move(target)),
        weights_(std::move(weights)),
        reduction_(reduction),
        smoothing_(label_smoothing) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    const Tensor& logits = in[0];
    shape_ = logits.shape();
    dtype_ = logits.dtype();
    const int64_t rows = target_.numel();
    Tensor x = kernels::reshape(logits.detach().to(compute_dtype(dtype_)).contiguous(),
                                {rows, shard_.length});
    // A rank holding no column of the vocabulary contributes -inf to the max (amax of nothing
    // is an error).
    Tensor row_max = shard_.length > 0 ? kernels::amax(x, {1})
                                       : full({rows}, -std::numeric_limits<double>::infinity(),
                                              TensorOptions(x.dtype(), x.device()));
    all_reduce(row_max, ReduceOp::Max);
    Tensor stats = kernels::vocab_ce_stats(x, row_max, target_, shard_.start);
    if (smoothing_ != 0.0 || weights_.defined())
      return {weighted_forward(x, row_max, std::move(stats))};
    all_reduce(stats, ReduceOp::Sum);
    kernels::VocabCrossEntropy ce = kernels::vocab_ce_loss(stats, row_max, target_, weights_.kept);
    save_for_backward({x, ce.lse});
    if (reduction_ == kernels::Reduction::Mean) return {ce.loss.to(dtype_)};
    // Per row: lse - the target's logit, 0 on ignored rows.
    const Tensor per_row = kernels::where(
        ignored_rows(), zeros({}, TensorOptions(x.dtype(), x.device())),
        kernels::binary(kernels::BinaryOp::Sub, ce.lse, kernels::select(stats, 1, 1)));
    if (reduction_ == kernels::Reduction::Sum) return {kernels::sum(per_row, {}, false).to(dtype_)};
    return {kernels::reshape(per_row, Shape(shape_.begin(), shape_.end() - 1)).to(dtype_)};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    const std::vector<Tensor>& s = saved_tensors();
    if (smoothing_ != 0.0 || weights_.defined()) return {weighted_backward(g[0], s[0], s[1])};
    if (reduction_ == kernels::Reduction::None) {
      // Each row's softmax - onehot scaled by that row's incoming gradient.
      Tensor grad = kernels::vocab_ce_backward(s[0], s[1], target_, shard_.start, 1.0);
      const Tensor per_row =
          kernels::reshape(g[0].to(grad.dtype()).contiguous(), {grad.size(0), 1});
      grad = kernels::binary(kernels::BinaryOp::Mul, grad, per_row);
      return {kernels::reshape(grad, shape_).to(dtype_)};
    }
    double scale = g[0].to(DType::Float64).item<double>();
    if (reduction_ == kernels::Reduction::Mean) scale /= weights_.divisor;
    Tensor grad = kernels::vocab_ce_backward(s[0], s[1], target_, shard_.start, scale);
    return {kernels::reshape(grad, shape_).to(dtype_)};
  }

 private:
  Tensor ignored_rows() const {
    return kernels::compare_scalar(kernels::CompareOp::Eq, target_, -1.0);
  }

  // PyTorch's per-row loss with class weights w (all 1 without) and label smoothing eps:
  // (1 - eps) * w[t] * (lse - x[t]) + (eps / V) * (W * lse - sum_j w[j] * x[j]), W the weights'
  // total. The weighted sum of logits over the whole vocabulary is a third column of the
  // statistics' all-reduce (no collective more); without smoothing it is not needed.
  Tensor weighted_forward(const Tensor& x, const Tensor& row_max, Tensor stats) {
    using kernels::BinaryOp;
    const int64_t rows = x.size(0);
    if (smoothing_ != 0.0) {
      const Tensor terms =
          weights_.defined()
              ? kernels::binary(BinaryOp::Mul, x, kernels::reshape(weights_.slice, {1, -1}))
              : x;
      const Tensor local_sum = shard_.length > 0
                                   ? kernels::sum(terms, {1}, true)
                                   : zeros({rows, 1}, TensorOptions(x.dtype(), x.device()));
      stats = kernels::cat({stats, local_sum}, 1);
    }
    all_reduce(stats, ReduceOp::Sum);
    const Tensor two = kernels::narrow(stats, 1, 0, 2).contiguous();
    kernels::VocabCrossEntropy ce = kernels::vocab_ce_loss(two, row_max, target_, weights_.kept);
    save_for_backward({x, ce.lse});
    Tensor per_row =
        kernels::binary(BinaryOp::Sub, ce.lse, kernels::select(two, 1, 1).contiguous());
    if (weights_.defined()) per_row = kernels::binary(BinaryOp::Mul, per_row, weights_.rows);
    if (smoothing_ != 0.0) {
      const Tensor smooth = kernels::binary(
          BinaryOp::Sub, kernels::binary_scalar(BinaryOp::Mul, ce.lse, weights_.total),
          kernels::select(stats, 1, 2).contiguous());
      per_row = kernels::binary(
          BinaryOp::Add, kernels::binary_scalar(BinaryOp::Mul, per_row, 1.0 - smoothing_),
          kernels::binary_scalar(BinaryOp::Mul, smooth, smoothing_ / double(shard_.vocab_size)));
    }
    per_row =
        kernels::where(ignored_rows(), zeros({}, TensorOptions(x.dtype(), x.device())), per_row);
    switch (reduction_) {
      case kernels::Reduction::None:
        return kernels::reshape(per_row, Shape(shape_.begin(), shape_.end() - 1)).to(dtype_);
      case kernels::Reduction::Sum:
        return kernels::sum(per_row, {}, false).to(dtype_);
      case kernels::Reduction::Mean:
        break;
    }
    // No kept row: 0/0, NaN as PyTorch's mean.
    return kernels::binary_scalar(BinaryOp::Div, kernels::sum(per_row, {}, false), weights_.divisor)
        .to(dtype_);
  }

  // The gradient of weighted_forward's loss on kept rows: (1 - eps) * w[t] * (softmax - onehot)
  // + eps * (W / V * softmax - w / V), times the incoming gradient (per row, or the reduction's
  // scale).
  Tensor weighted_backward(const Tensor& g, const Tensor& x, const Tensor& lse) const {
    using kernels::BinaryOp;
    const int64_t rows = x.size(0);
    Tensor grad = kernels::vocab_ce_backward(x, lse, target_, shard_.start, 1.0 - smoothing_);
    if (weights_.defined())
      grad = kernels::binary(BinaryOp::Mul, grad, kernels::reshape(weights_.rows, {rows, 1}));
    if (smoothing_ != 0.0) {
      const double v = double(shard_.vocab_size);
      const Tensor softmax =
          kernels::unary(kernels::UnaryOp::Exp,
                         kernels::binary(BinaryOp::Sub, x, kernels::reshape(lse, {rows, 1})));
      Tensor uniform =
          weights_.defined()
              ? kernels::binary(BinaryOp::Sub,
                                kernels::binary_scalar(BinaryOp::Mul, softmax, weights_.total / v),
                                kernels::binary_scalar(
                                    BinaryOp::Div, kernels::reshape(weights_.slice, {1, -1}), v))
              : kernels::binary_scalar(BinaryOp::Sub, softmax, 1.0 / v);
      uniform = kernels::masked_fill(kernels::binary_scalar(BinaryOp::Mul, uniform, smoothing_),
                                     kernels::reshape(ignored_rows(), {rows, 1}), 0.0);
      grad = kernels::binary(BinaryOp::Add, grad, uniform);
    }
    if (reduction_ == kernels::Reduction::None) {
      grad = kernels::binary(BinaryOp::Mul, grad,
                             kernels::reshape(g.to(grad.dtype()).contiguous(), {rows, 1}));
    } else {
      double scale = g.to(DType::Float64).item<double>();
      if (reduction_ == kernels::Reduction::Mean) scale /= weights_.divisor;
      grad = kernels::binary_scalar(BinaryOp::Mul, grad, scale);
    }
    return kernels::reshape(grad, shape_).to(dtype_);
  }

  void all_reduce(Tensor& t, ReduceOp op) const {
    for (const ProcessGroupPtr& g : shard_.groups)
      g->all_reduce(t, op)->wait();
  }

  VocabShard shard_;
  Tensor target_;
  RowWeights weights_;
  kernels::Reduction reduction_;
  double smoothing_;
  Shape shape_;
  DType dtype_ = DType::Float32;
};

// The ranks sharing the vocabulary must agree on its size: each places its columns by it, and
// `from_local` without a global shape guesses it from the local width, which differs between
// ranks when the vocabulary does not split evenly (8, 8, 8 and 6 columns guess 32 and 24). Every
// rank then fails alike, rather than one on a target beyond its own guess while the others wait
// in the loss's collectives, or all going on with overlapping columns.
// What each rank found before the first collective of the loss, agreed over every rank of the
// logits' mesh, so that no rank goes on into the forward's all-reduces while another throws.
struct LocalFindings {
  bool local_shape_ok = true;
  std::string bad_target;  // this rank's first out-of-range target (or bad argument), described
  uint64_t target_hash = 0;
  // ignore_index, reduction and label_smoothing, described and hashed (the value's bits): ranks
  // passing different ones would each compute another loss through the same collectives,
  // silently.
  std::string options;
  uint64_t options_hash = 0;
  // Whether there are class weights, and a hash of their values: each rank weighs its own slice,
  // so ranks passing different weights would sum terms of different losses. Presence is agreed
  // on its own, so that no weight's hash can pass for "none".
  bool has_weight = false;
  uint64_t weight_hash = 0;
};

// Halves of a 64-bit hash, each also negated, so that one all-reduce with Max finds both the
// largest and the smallest value of each.
void push_hash(std::vector<int64_t>& v, uint64_t h) {
  const int64_t hi = int64_t(h >> 32), lo = int64_t(h & 0xffffffffu);
  v.insert(v.end(), {hi, -hi, lo, -lo});
}

bool hashes_agree(const std::vector<int64_t>& r, size_t at) {
  return r[at] == -r[at + 1] && r[at + 2] == -r[at + 3];
}

// The groups that carry the agreement, one all-reduce each in turn, and the device its values
// travel on. Every rank of the logits' mesh returns the loss marked Replicate over every mesh
// dim, so all of them agree, not only those sharing a vocabulary group: ranks that differ along
// a Replicate dim alone would otherwise each compute another loss unnoticed.
struct AgreeingGroups {
  std::vector<ProcessGroupPtr> groups;
  Device device;
};

AgreeingGroups agreeing_groups(const DeviceMesh& mesh, Device logits_device) {
  // One dim: the mesh's own group spans it, on the logits' device as the loss's collectives (the
  // loss-parallel path's agreement stays one all-reduce, and a mesh that from_group made over a
  // device group has no CPU group to use instead).
  if (mesh.ndim() == 1) return {{mesh.group(0)}, logits_device};
  // Several dims: the values are host data, so CPU groups carry them. A mesh spanning the world
  // is spanned by the CPU world group: one all-reduce however many dims. A group over a smaller
  // mesh's ranks does not exist, and making one is collective over the whole world (every rank
  // would have to call the loss at once, each making a communicator per call), so such a mesh
  // agrees along each of its dims in turn.
  if (mesh.size() == world_size()) return {{world_group()}, Device::cpu()};
  std::vector<ProcessGroupPtr> groups;
  for (int64_t d = 0; d < mesh.ndim(); ++d)
    groups.push_back(mesh.host_group(d));
  return {std::move(groups), Device::cpu()};
}

void agree_over_mesh(const DeviceMesh& mesh, Device logits_device, int64_t vocab_size,
                     const LocalFindings& mine) {
  const AgreeingGroups agreeing = agreeing_groups(mesh, logits_device);
  // Reduced over every agreeing group in turn before any check: the maxima are then those of
  // every rank of the mesh, so all of them decide alike (checked after each group, one group's
  // ranks could throw while another's went on into the next all-reduce).
  std::vector<int64_t> values = {vocab_size,
                                 -vocab_size,
                                 mine.local_shape_ok ? 0 : 1,
                                 mine.bad_target.empty() ? 0 : 1,
                                 mine.has_weight ? 1 : 0,
                                 mine.has_weight ? -1 : 0};
  push_hash(values, mine.target_hash);
  push_hash(values, mine.options_hash);
  push_hash(values, mine.weight_hash);
  Tensor v = from_vector<int64_t>(values, {int64_t(values.size())}).to(agreeing.device);
  for (const ProcessGroupPtr& g : agreeing.groups)
    g->all_reduce(v, ReduceOp::Max)->wait();
  {
    const std::vector<int64_t> r = v.to_vector<int64_t>();
    TESSERA_CHECK(r[0] == -r[1], kOp, ": the ranks disagree on the vocabulary size (from ", -r[1],
                  " to ", r[0], ", this rank ", vocab_size,
                  "): pass the global shape to DTensor::from_local when the vocabulary does not "
                  "split evenly over the ranks");
    TESSERA_CHECK(r[2] == 0, kOp,
                  ": some rank's local logits do not match its piece of the "
                  "vocabulary",
                  mine.local_shape_ok ? "" : " (this one's)");
    TESSERA_CHECK(r[3] == 0, kOp, ": ",
                  mine.bad_target.empty()
                      ? std::string("another rank's target is out of range, or not an int64 "
                                    "or int32 tensor of the logits' rows, or its "
                                    "label_smoothing or weight is refused")
                      : mine.bad_target);
    TESSERA_CHECK(hashes_agree(r, 6), kOp, ": the ranks of ", mesh.str(),
                  " pass different targets (each needs the same whole target; when the batch is "
                  "split over a data-parallel mesh dim, give the logits the sub-mesh without it)");
    TESSERA_CHECK(hashes_agree(r, 10), kOp, ": the ranks of ", mesh.str(),
                  " pass different ignore_index, reduction or label_smoothing (this rank: ",
                  mine.options, ")");
    TESSERA_CHECK(r[4] == -r[5] && hashes_agree(r, 14), kOp, ": the ranks of ", mesh.str(),
                  " pass different class weights (each needs the same global weight of one value "
                  "per class; this rank: ",
                  mine.has_weight ? "a weight" : "none", ")");
  }
}

uint64_t bytes_hash(const void* data, size_t bytes) {
  return std::hash<std::string_view>()(std::string_view(static_cast<const char*>(data), bytes));
}

void describe_options(LocalFindings& mine, int64_t ignore_index, kernels::Reduction reduction,
                      double label_smoothing) {
  mine.options =
      (std::ostringstream() << "ignore_index " << ignore_index << ", reduction "
                            << reduction_name(reduction) << ", label_smoothing " << label_smoothing)
          .str();
  uint64_t smoothing_bits = 0;
  std::memcpy(&smoothing_bits, &label_smoothing, sizeof smoothing_bits);
  mine.options_hash =
      std::hash<std::string>()(std::to_string(ignore_index) + "/" + std::to_string(int(reduction)) +
                               "/" + std::to_string(smoothing_bits));
}

// Ignored rows become -1 (the kernels' mark); the first target out of range is a finding.
void mark_ignored_rows(std::vector<int64_t>& t, int64_t ignore_index, int64_t vocab_size,
                       LocalFindings& mine) {
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == ignore_index) {
      t[i] = -1;
      continue;
    }
    if ((t[i] < 0 || t[i] >= vocab_size) && mine.bad_target.empty())
      mine.bad_target = "target " + std::to_string(t[i]) + " at row " + std::to_string(i) +
                        " is out of range for a vocabulary of " + std::to_string(vocab_size) +
                        " (ignore_index is " + std::to_string(ignore_index) + ")";
  }
}

// t: the targets with -1 on ignored rows; w: the global class weights, empty for none.
RowWeights row_weights(const std::vector<int64_t>& t, const std::vector<double>& w,
                       const VocabShard& shard, const Tensor& logits) {
  RowWeights r;
  r.total = w.empty() ? double(shard.vocab_size) : 0.0;
  for (double x : w)
    r.total += x;
  std::vector<double> rows(t.size(), 0.0);
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] < 0) continue;
    ++r.kept;
    rows[i] = w.empty() ? 1.0 : w[size_t(t[i])];
    r.divisor += rows[i];
  }
  if (w.empty()) return r;
  const TensorOptions opts(compute_dtype(logits.dtype()), logits.device());
  r.rows = from_vector<double>(rows).to(opts.dtype).to(opts.device);
  const std::vector<double> slice(w.begin() + shard.start, w.begin() + shard.start + shard.length);
  r.slice = from_vector<double>(slice).to(opts.dtype).to(opts.device);
  return r;
}

// What the call itself gets wrong (empty when nothing): a finding like an out-of-range target,
// agreed before the loss's collectives (a last batch of another size on one rank, say), not
// thrown alone.
std::string call_problem(const DTensorSpec& spec, const Tensor& target, double label_smoothing,
                         const Tensor& weight, Device device) {
  const Shape row_shape(spec.global_shape.begin(), spec.global_shape.end() - 1);
  if (!(label_smoothing >= 0.0 && label_smoothing <= 1.0))
    return (std::ostringstream() << "label_smoothing must be in [0, 1], got " << label_smoothing)
        .str();
  if (target.dtype() != DType::Int64 && target.dtype() != DType::Int32)
    return "target must be int64 or int32 class indices, got " + target.str();
  if (target.shape() != row_shape)
    return "target " + shape_str(target.shape()) + " does not match logits " +
           shape_str(spec.global_shape) + " (expected " + shape_str(row_shape) +
           ", the logits' shape without the vocabulary dim)";
  // The class weight as cross_entropy takes it, checked against the global logits.
  return cross_entropy_weight_problem(weight, spec.global_shape, spec.dtype, device,
                                      "the global logits",
                                      "the whole vocabulary, not this rank's slice");
}

// This rank's vocabulary slice and the groups of the mesh dims that shard it (none when every
// rank holds the whole vocabulary).
VocabShard vocab_shard(const DTensorSpec& spec) {
  const int64_t vdim = spec.ndim() - 1;
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
  const LocalLayout layout = spec.local_layout();
  shard.start = layout.global_offset.back();
  shard.length = layout.local_shape.back();
  return shard;
}

// The call as this rank reads it: its findings, the targets (-1 on ignored rows) and the class
// weights (empty without), read only when the call itself is sound.
struct LocalCall {
  LocalFindings mine;
  std::vector<int64_t> target;
  std::vector<double> weight;
};

LocalCall read_call(const DTensor& logits, const Tensor& target, int64_t ignore_index,
                    kernels::Reduction reduction, double label_smoothing, const Tensor& weight) {
  const DTensorSpec& spec = logits.spec();
  LocalCall c;
  c.mine.bad_target =
      call_problem(spec, target, label_smoothing, weight, logits.to_local().device());
  const bool sound = c.mine.bad_target.empty();
  c.mine.local_shape_ok = logits.to_local().shape() == spec.local_layout().local_shape;
  describe_options(c.mine, ignore_index, reduction, label_smoothing);
  if (sound) c.target = target.to_vector<int64_t>();
  c.mine.target_hash = bytes_hash(c.target.data(), c.target.size() * sizeof(int64_t));
  c.mine.has_weight = weight.defined();
  if (sound && weight.defined()) c.weight = weight.to_vector<double>();
  c.mine.weight_hash = bytes_hash(c.weight.data(), c.weight.size() * sizeof(double));
  mark_ignored_rows(c.target, ignore_index, spec.global_shape.back(), c.mine);
  return c;
}

}  // namespace

DTensor vocab_parallel_cross_entropy(const DTensor& logits, const Tensor& target,
                                     int64_t ignore_index, kernels::Reduction reduction,
                                     double label_smoothing, const Tensor& weight) {
  TESSERA_CHECK(logits.defined(), kOp, ": logits are undefined");
  TESSERA_CHECK(target.defined(), kOp, ": target is undefined");
  const DTensorSpec& spec = logits.spec();
  TESSERA_CHECK(spec.ndim() >= 1 && is_floating(spec.dtype), kOp,
                ": logits must be a floating-point [..., V] DTensor, got ", spec.str());
  VocabShard shard = vocab_shard(spec);
  const LocalCall call =
      read_call(logits, target, ignore_index, reduction, label_smoothing, weight);
  agree_over_mesh(spec.mesh, logits.to_local().device(), shard.vocab_size, call.mine);
  const Shape local_shape = spec.local_layout().local_shape;
  TESSERA_CHECK(logits.to_local().shape() == local_shape, kOp, ": local logits ",
                shape_str(logits.to_local().shape()), " do not match the local shape ",
                shape_str(local_shape), " of ", spec.str());

  Tensor loss;
  if (shard.groups.empty()) {
    loss = tessera::cross_entropy(logits.to_local(), target, ignore_index, reduction,
                                  label_smoothing, weight);
  } else {
    const Tensor local_target = from_vector(call.target).to(logits.to_local().device());
    RowWeights weights = row_weights(call.target, call.weight, shard, logits.to_local());
    loss = autograd::Function::apply<VocabParallelCrossEntropy>(
        {logits.to_local()}, std::move(shard), local_target, std::move(weights), reduction,
        label_smoothing)[0];
  }
  return DTensor::from_local(loss, spec.mesh, Placements(spec.placements.size()), loss.shape());
}

}  // namespace tessera
