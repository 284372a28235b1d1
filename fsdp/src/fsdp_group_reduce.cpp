// FSDPGroup's reduction: its gradients packed and reduce-scattered (then, for HSDP, all-reduced
// across replicas, or kept for a later all-reduce), and the averaged shards added to the stored
// parameters' gradients.
#include <cmath>
#include <utility>
#include <vector>

#include "fsdp_group.h"
#include "fsdp_util.h"
#include "schedule.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/comm/progress.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/layout.h"

namespace tessera::detail {

namespace {

// Waits for `work` when `block` (adding the time to `waited`), else only tests it; true when it
// completed.
bool wait_or_test(const WorkPtr& work, bool block, double& waited) {
  if (block) {
    waited += wait_seconds(work);
    return true;
  }
  if (!work->is_completed()) return false;
  work->wait();  // runs its completion step
  return true;
}

// What each rank's gradient terms are divided by before a float16 reduction (the sum by dp over
// it after): float16 ends at 65504, and the sum of dp terms overflows long before their mean
// would. A power of two near sqrt(dp), as PyTorch's FSDP2 picks it; 1 for other dtypes, whose
// sums are divided by dp afterwards only.
int64_t predivide_factor(int64_t dp, DType reduce_dtype) {
  if (reduce_dtype != DType::Float16) return 1;
  int64_t f = 1;
  while (dp % f == 0 && dp / f > f)
    f *= 2;
  return f;
}

int64_t data_parallel_size(const ProcessGroupPtr& shard, const ProcessGroupPtr& replicate) {
  return shard->size() * (replicate ? replicate->size() : 1);
}
}  // namespace

void FSDPGroup::accumulate_unsynced(DType reduce_dtype) {
  // Summed in the reduce dtype, as the reduction would: micro-batches summed in a 16-bit
  // param_dtype lose the precision that a float32 reduce_dtype asks for.
  for (ParamInfo& i : params_) {
    if (!i.leaf.defined() || !i.leaf.grad().defined()) continue;
    Tensor g = i.leaf.grad().to(reduce_dtype);
    i.accum_grad = i.accum_grad.defined()     ? add(i.accum_grad, g)
                   : g.is_same(i.leaf.grad()) ? g.contiguous().clone()
                                              : g.contiguous();
  }
}

FSDPGroup::PendingReduce FSDPGroup::pack_gradients(DType reduce_dtype) {
  // Each rank's block holds its rows of every trainable parameter's gradient, padded, then one
  // flag per parameter (1 where this rank has a gradient for it), then shards_written_ and, where
  // set, the world rank + 1 in base-256 digits: the reduce-scatter sums the flags too, so every
  // rank learns which parameters got a gradient anywhere, and how many ranks wrote their shards
  // (and which, when one did), without another collective.
  const int64_t k = reduce_pg_->size();
  PendingReduce pr;
  pr.offsets = reduce_offsets(pr.size);
  const int64_t block = pr.size + int64_t(params_.size()) + kWrittenSlots;
  pr.send = zeros(Shape{k * block}, TensorOptions(reduce_dtype, flat_.device()));
  const int64_t n_params = int64_t(params_.size());
  const int64_t pre = predivide_factor(data_parallel_size(reduce_pg_, replicate_pg_), reduce_dtype);
  std::vector<float> has_grad(params_.size() + kWrittenSlots, 0.0f);
  const bool wrote = std::exchange(shards_written_, false);
  // Sums kept for a later all-reduce that already hold this rank's flag (a write in an earlier
  // micro-batch) are added to this reduce: flagged again, one rank would count as two.
  if (wrote && !wrote_here_) {
    has_grad[params_.size()] = 1.0f;
    // Each digit is below 256, exact in any 16-bit reduce dtype, and summed only with zeros
    // when one rank wrote (the only case that names it).
    int64_t id = world_rank() + 1;
    for (int64_t d = 0; d < kRankDigits; ++d, id >>= 8)
      has_grad[params_.size() + 1 + size_t(d)] = float(id & 0xff);
  }
  wrote_here_ |= wrote;  // also in sums kept for a later all-reduce, which hold its flag
  for (size_t p = 0; p < params_.size(); ++p) {
    ParamInfo& i = params_[p];
    if (!i.param->requires_grad()) {
      i.accum_grad = Tensor();  // frozen since: it gets no gradient, now or later
      continue;
    }
    Tensor g = i.leaf.defined() ? i.leaf.grad() : Tensor();
    if (i.accum_grad.defined())
      g = g.defined() ? add(i.accum_grad, g.to(reduce_dtype)) : i.accum_grad;
    i.accum_grad = Tensor();
    if (!g.defined()) continue;
    TESSERA_CHECK(g.shape() == i.unsharded_shape, label(), ": gradient of '", i.name, "' is ",
                  g.str(), "; expected the unsharded shape ", shape_str(i.unsharded_shape));
    g = g.contiguous();
    if (pre != 1) g = mul(g, 1.0 / double(pre));  // before the cast to the reduce dtype
    has_grad[p] = 1.0f;
    for (int64_t r = 0; r < k; ++r) {
      const Chunk c = chunk_of(i.rows, k, r);
      if (c.length == 0) continue;
      flat_window(pr.send, r * block + pr.offsets[p], c.length * i.row_numel)
          .copy_(flat_window(g, c.start * i.row_numel, c.length * i.row_numel));
    }
  }
  // The flags of every rank's block at once: one copy from the host, not one fill per parameter
  // and rank (each a kernel launch on a device).
  const int64_t n_flags = n_params + kWrittenSlots;
  pr.send.as_strided({k, n_flags}, {block, 1}, pr.size)
      .copy_(kernels::expand(from_vector<float>(has_grad, {1, n_flags}), {k, n_flags}));
  return pr;
}

void FSDPGroup::start_reduce() {
  NoGradGuard no_grad;
  // Not run in this step: reduced only for the sums it holds from earlier micro-batches, with no
  // backward gather owed for it.
  const bool ran = backward_pending_;
  if (ran && flat_.version() != leaves_shards_version_) shards_written_ = true;
  backward_pending_ = false;
  grads_ready_for_reduce_ = false;
  clear_grads_in();
  if (ran) settle_backward_gather();
  const DType reduce_dtype =
      opts_.mp_policy.reduce_dtype.value_or(opts_.mp_policy.param_dtype.value_or(flat_.dtype()));
  if (!requires_gradient_sync_) {
    accumulate_unsynced(reduce_dtype);
    unsynced_sums_ = true;
    schedule_->hold_sums(shared_from_this());
    finish_backward();
    return;
  }
  if (!ran && all_reduce_kept_sums()) return;
  unsynced_sums_ = false;  // packed below, or dropped with the parameters frozen since
  bool trainable = false;
  for (const ParamInfo& i : params_)
    trainable |= i.param->requires_grad();
  // Nothing to reduce (the same on every rank). Kept gathered, its backward read the values its
  // forward saved, and a write to its shards meanwhile changed no gradient. Gathered again for
  // backward, it read the written values: the flags alone are reduced then, on a backward that
  // communicates for this group anyway.
  if (!trainable && !gathers_for_backward()) {
    for (ParamInfo& i : params_)
      i.accum_grad = Tensor();  // unsynced sums of parameters frozen since
    shards_written_ = false;
    finish_backward();
    return;
  }
  // Packing needs only the gradients: free the gathered weights first.
  if (reshard_after_backward_) release_unsharded();
  PendingReduce pr = pack_gradients(reduce_dtype);
  // The unsharded gradients are packed: free them before the transfer.
  finish_backward();
  pr.reduced = empty(Shape{pr.size + int64_t(params_.size()) + kWrittenSlots},
                     TensorOptions(reduce_dtype, flat_.device()));
  pr.work = reduce_pg_->reduce_scatter_tensor(pr.reduced, pr.send, ReduceOp::Sum);
  progress_in_background(pr.work);
  pending_reduce_ = std::move(pr);
}

bool FSDPGroup::all_reduce_kept_sums() {
  // Skipped by this step's forward (on every rank alike), it has no gradient of this step: its
  // sums kept for the all-reduce across replicas were reduce-scattered when they were kept, and a
  // reduce-scatter of zeros would add nothing to them. Sums of micro-batches without sync are
  // not reduce-scattered yet: those take the full path. The all-reduce itself goes out when
  // the schedule retires this reduce (advance_reduce), in issue order like every group's: issued
  // here, it could pass those of groups before it on some ranks and not on others.
  if (unsynced_sums_ || !partial_reduce_ || !requires_all_reduce_ || !replicate_pg_) return false;
  pending_reduce_ = std::move(*partial_reduce_);
  partial_reduce_.reset();
  pending_reduce_->work = nullptr;
  finish_backward();
  return true;
}

void FSDPGroup::settle_backward_gather() {
  // A group whose backward did not run on this rank still gathers for it, as the ranks where it
  // ran did: finalize issues that gather, or, for a group of frozen parameters made ready early by
  // its input's gradient (another consumer of the input delivered it), this does, in backward
  // order as everywhere. Finish it before anything frees the buffer it writes into; kept
  // gathered, it leaves the group gathered as on those ranks, so that the next forward issues
  // the same collectives everywhere.
  if (needs_backward_gather()) schedule_->gather_through(this);
  if (!pending_gather_) return;
  if (reshard_after_backward_) {
    drop_pending_gather();
    return;
  }
  // Into the leaves the graph saved (a fresh target would replace them, and their gradients).
  TESSERA_CHECK(pending_gather_->reuse, label(), ": a backward gather not into its leaves");
  finish_gather(/*fresh=*/false);
  set_unsharded_params();
}

std::vector<int64_t> FSDPGroup::reduce_offsets(int64_t& size) const {
  std::vector<int64_t> offsets;
  size = 0;
  for (const ParamInfo& i : params_) {
    offsets.push_back(i.param->requires_grad() ? size : -1);
    if (i.param->requires_grad()) size += i.chunk_rows * i.row_numel;
  }
  return offsets;
}

bool FSDPGroup::gathers_for_backward() const {
  // As post_forward decides it for a forward with a backward to come.
  return (!is_root_ || reshard_after_forward_set_) && bool(opts_.reshard_after_forward);
}

void FSDPGroup::read_written_flag(const PendingReduce& pr) {
  const std::vector<double> slots =
      flat_window(pr.reduced, pr.size + int64_t(params_.size()), kWrittenSlots).to_vector<double>();
  ranks_that_wrote_ = std::llround(slots[0]);
  if (ranks_that_wrote_ == 0) wrote_here_ = false;
  writing_rank_ = -1;
  if (ranks_that_wrote_ != 1) return;
  int64_t id = 0;
  for (int64_t d = kRankDigits - 1; d >= 0; --d)
    id = id * 256 + std::llround(slots[size_t(1 + d)]);
  writing_rank_ = id - 1;
}

bool FSDPGroup::partial_reduce_fits() const {
  int64_t size = 0;
  return !partial_reduce_ || partial_reduce_->offsets == reduce_offsets(size);
}

bool FSDPGroup::reduces_waiting_sums() const {
  return requires_gradient_sync_ && (unsynced_sums_ || (partial_reduce_ && requires_all_reduce_));
}

bool FSDPGroup::merge_partial_reduce() {
  PendingReduce& pr = *pending_reduce_;
  if (partial_reduce_) {
    // FSDPSchedule::begin_backward refused a change before this backward began.
    TESSERA_CHECK(partial_reduce_->offsets == pr.offsets, label(),
                  ": the kept gradient sums do not fit this backward's reduce");
    pr.reduced = add(pr.reduced, partial_reduce_->reduced);
    partial_reduce_.reset();
  }
  // Kept, the sums keep their flag of a write to the shards too: only the replicas' all-reduce
  // tells every rank, and the backward that runs it refuses.
  if (requires_all_reduce_) return true;
  for (size_t p = 0; p < params_.size(); ++p)
    if (pr.offsets[p] >= 0) {
      params_[p].param->set_grad_pending(false);
      sync_aliases(params_[p]);
    }
  pr.work = nullptr;
  partial_reduce_ = std::move(pr);
  pending_reduce_.reset();
  schedule_->hold_sums(shared_from_this());
  return false;
}

bool FSDPGroup::advance_reduce(bool block) {
  if (!pending_reduce_) return true;
  NoGradGuard no_grad;
  PendingReduce& pr = *pending_reduce_;
  // No work: kept sums with no reduce-scatter in this step (all_reduce_kept_sums).
  if (pr.work && !wait_or_test(pr.work, block, stats_.reduce_scatter_wait_seconds)) return false;
  if (!pr.across_replicas) {
    if (pr.work) ++stats_.reduce_scatters;
    pr.send = Tensor();
    if (replicate_pg_) {
      if (!merge_partial_reduce()) return true;
      pr.work = replicate_pg_->all_reduce(pr.reduced, ReduceOp::Sum);
      progress_in_background(pr.work);
      pr.across_replicas = true;
      return advance_reduce(block);
    }
  }
  const int64_t dp = data_parallel_size(reduce_pg_, replicate_pg_);
  const int64_t pre = predivide_factor(dp, pr.reduced.dtype());
  const double divide = gradient_divide_factor_.value_or(double(dp));
  const std::vector<double> flags =
      flat_window(pr.reduced, pr.size, int64_t(params_.size())).to_vector<double>();
  read_written_flag(pr);
  // Each rank's loss is the mean over its own rows: averaging over the data-parallel ranks
  // gives the gradient of the mean loss over the global batch (or set_gradient_divide_factor's).
  const DType stored_dtype = flat_.dtype();
  Tensor averaged = mul(flat_window(pr.reduced, 0, pr.size).to(stored_dtype), double(pre) / divide);
  const std::vector<int64_t> offsets = std::move(pr.offsets);
  pending_reduce_.reset();
  for (size_t p = 0; p < params_.size(); ++p) {
    ParamInfo& i = params_[p];
    if (offsets[p] < 0) continue;
    i.param->set_grad_pending(false);
    sync_aliases(i);
    if (flags[p] == 0) continue;  // no rank had a gradient: leave it undefined, as unsharded
    const Tensor& stored = i.param->stored();
    Tensor g = kernels::view(flat_window(averaged, offsets[p], stored.numel()), stored.shape());
    Tensor old = stored.grad();
    Tensor(stored).set_grad(old.defined() ? add(old, g) : g);
  }
  return true;
}

}  // namespace tessera::detail
