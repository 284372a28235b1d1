#include "fsdp_group.h"

#include <chrono>
#include <vector>

#include "registry.h"
#include "schedule.h"
#include "tessera/autograd/checkpoint.h"
#include "tessera/autograd/engine.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/comm/progress.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/layout.h"

namespace tessera::detail {

namespace {

// The flat window [start, start + length) of a contiguous tensor, as a view.
Tensor flat_window(const Tensor& t, int64_t start, int64_t length) {
  return kernels::narrow(kernels::view(t, Shape{t.numel()}), 0, start, length);
}

double wait_seconds(const WorkPtr& work) {
  const auto start = std::chrono::steady_clock::now();
  work->wait();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

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

}  // namespace

FSDPGroup::~FSDPGroup() {
  unregister_group(this);
}

void FSDPGroup::set_unsharded_params() {
  for (ParamInfo& i : params_) {
    DTensor dt;
    if (i.tp_mesh) dt = DTensor::from_local(i.leaf, *i.tp_mesh, i.tp_placements, i.tp_global_shape);
    i.param->set_unsharded(i.leaf, dt);
    sync_aliases(i);
  }
  unsharded_ = true;
}

void FSDPGroup::unshard(bool async_op) {
  if (unsharded_) {
    if (!shards_written_since_gather()) {
      if (!backward_pending_) refresh_leaves();
      return;
    }
    // The shards were written while the gathered values stayed (a LoRA merge or a load after a
    // forward that kept them): those are stale. Gather again, as after a reshard; a backward
    // still pending on the old values then refuses them through the version counter.
    reshard();
  }
  if (async_op) {
    start_gather();
    return;
  }
  if (backward_pending_ && !params_.empty() && params_.front().leaf.defined()) {
    // Used again before this step's backward (a module called twice in one forward): the graph
    // holds the first use's leaves. Both uses must read and accumulate into the same leaves, so
    // one gradient holds both; fresh leaves would leave the first use's gradient unreduced.
    if (leaves_released_ || (pending_gather_ && pending_gather_->reuse))
      finish_gather(/*fresh=*/false);
    else
      drop_pending_gather();  // the leaves still hold what it would gather
    set_unsharded_params();
    return;
  }
  drop_leaves();
  finish_gather(/*fresh=*/true);
  clear_grads_in();
  set_unsharded_params();
}

bool FSDPGroup::shards_written_since_gather() const {
  const bool here = flat_.version() != leaves_shards_version_;
  if (gather_pg_->size() == 1) return here;
  // Whether to gather again must be the same on every rank, or their all-gathers would not
  // match: a rank whose pieces nobody wrote follows the others. Only a group found gathered at
  // its forward pays this (kept after backward or after a no_grad forward, a module used twice).
  Tensor flag = full({1}, here ? 1.0 : 0.0, TensorOptions(DType::Int32, flat_.device()));
  gather_pg_->all_reduce(flag, ReduceOp::Max)->wait();
  return flag.item<int32_t>() != 0;
}

void FSDPGroup::start_gather() {
  if (pending_gather_) return;
  NoGradGuard no_grad;
  const DType gather_dtype = opts_.mp_policy.param_dtype.value_or(flat_.dtype());
  PendingGather g;
  g.send = gather_dtype == flat_.dtype() ? flat_ : flat_.to(gather_dtype);
  // Before this group's backward the graph's saved leaves are views of the released buffer:
  // gather into its bytes again. Otherwise into a fresh buffer for fresh leaves.
  g.reuse = leaves_released_;
  g.shards_version = flat_.version();
  if (g.reuse) {
    g.saved_version = gathered_.version();
    gathered_.storage().impl()->reallocate();
    leaves_released_ = false;
    g.target = gathered_;
  } else {
    g.target = empty(Shape{unsharded_numel_}, TensorOptions(gather_dtype, flat_.device()));
  }
  g.work = gather_pg_->all_gather_runs(g.target, g.send, gather_runs_);
  progress_in_background(g.work);
  pending_gather_ = std::move(g);
}

void FSDPGroup::drop_pending_gather() {
  if (!pending_gather_) return;
  pending_gather_->work->wait();  // MPI may still be writing into the buffer
  if (pending_gather_->reuse) {
    settle_refill_version(*pending_gather_);
    release_unsharded();
  }
  pending_gather_.reset();
}

void FSDPGroup::settle_refill_version(const PendingGather& g) {
  StorageImpl* buffer = g.target.storage().impl();
  buffer->restore_version(g.saved_version);
  if (g.shards_version != leaves_shards_version_) buffer->bump_version();
}

void FSDPGroup::release_unsharded() {
  if (gathered_.defined() && !gathered_.storage().impl()->is_released()) {
    gathered_.storage().impl()->release();
    leaves_released_ = true;
  }
}

void FSDPGroup::finish_gather(bool fresh) {
  start_gather();
  NoGradGuard no_grad;
  PendingGather g = std::move(*pending_gather_);
  pending_gather_.reset();
  ++stats_.all_gathers;
  stats_.all_gather_wait_seconds += wait_seconds(g.work);
  if (g.reuse) settle_refill_version(g);
  if (g.reuse && !fresh) return;  // the leaves are views of the bytes just gathered
  leaves_shards_version_ = g.shards_version;
  gathered_ = g.target;
  make_leaves();
}

void FSDPGroup::refresh_leaves() {
  // Leaves kept from an earlier step (set_reshard_after_backward(false), or gathered under
  // no_grad with reshard_after_forward off) were made for the requires_grad of then: a parameter
  // unfrozen since would get no gradient from them, a frozen one would still get one.
  bool stale = false;
  for (const ParamInfo& i : params_)
    stale |= i.leaf.defined() && i.leaf.requires_grad() != i.param->requires_grad();
  if (!stale) return;
  make_leaves();
  set_unsharded_params();
}

void FSDPGroup::make_leaves() {
  // Fresh leaves: views of the gathered buffer, one per parameter, each a new autograd leaf.
  for (size_t p = 0; p < params_.size(); ++p) {
    ParamInfo& i = params_[p];
    Tensor leaf = kernels::view(flat_window(gathered_, i.base, shape_numel(i.unsharded_shape)),
                                i.unsharded_shape);
    if (i.param->requires_grad()) {
      leaf.set_requires_grad(true);
      std::weak_ptr<FSDPGroup> weak = weak_from_this();
      register_post_accumulate_grad_hook(leaf, [weak, p](Tensor&) {
        if (auto s = weak.lock()) s->on_grad_ready(p);
      });
    }
    i.leaf = leaf;
  }
  leaves_released_ = false;
}

namespace {
constexpr size_t kMaxReducesInFlightToPrefetch = 1;

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

void FSDPGroup::prefetch(bool forward) {
  std::vector<std::shared_ptr<FSDPGroup>> targets;
  const auto& explicit_targets = forward ? forward_prefetch_ : backward_prefetch_;
  if (explicit_targets) {
    for (const auto& w : *explicit_targets)
      if (auto s = w.lock()) targets.push_back(s);
  } else if (forward ? opts_.forward_prefetch : opts_.backward_prefetch) {
    auto next = forward ? schedule_->next_in_forward(this) : schedule_->next_in_backward(this);
    if (next) targets.push_back(next);
  }
  // Backward prefetch within the memory the bound allows: this group's weights and gradients,
  // the next group's weights, and one reduce-scatter buffer. A rank never waits for a
  // reduce-scatter during backward (schedule.h), so where they finish late (ranks sharing cores)
  // several are in flight, and a prefetch then would hold a fifth group-sized buffer: the next
  // group is gathered at its own pre-backward instead.
  if (!forward && !targets.empty()) {
    schedule_->retire(/*block=*/false);
    if (schedule_->in_flight.size() > kMaxReducesInFlightToPrefetch) return;
  }
  for (const auto& t : targets) {
    if (t.get() == this || t->unsharded_) continue;
    if (forward) {
      t->start_gather();
      // Under another root (an explicit target), its own forward may still come in this step.
      if (t->schedule_ == schedule_) schedule_->forward_prefetched.push_back(t);
    } else {
      schedule_->gather_through(t.get());  // in backward order, like every rank
    }
  }
}

bool FSDPGroup::needs_backward_gather() const {
  return !unsharded_ && leaves_released_ && !pending_gather_;
}

void FSDPGroup::reshard() {
  for (ParamInfo& i : params_) {
    i.param->clear_unsharded();
    sync_aliases(i);
  }
  unsharded_ = false;
  if (!backward_pending_) {
    drop_pending_gather();
    drop_leaves();
  } else if (!pending_gather_) {
    // The autograd graph holds the gathered leaves until backward; free their bytes now and
    // gather into them again just before this group's backward (pre_backward).
    release_unsharded();
  }
}

void FSDPGroup::drop_leaves() {
  for (ParamInfo& i : params_)
    i.leaf = Tensor();
  gathered_ = Tensor();
  leaves_released_ = false;
}

void FSDPGroup::free_leaves_after_backward() {
  // The graph (its AccumulateGrad nodes) still refers to the leaves until the whole backward
  // ends; free their bytes and their unsharded gradients now, so that only the groups whose
  // backward is running hold gathered memory.
  for (ParamInfo& i : params_)
    if (i.leaf.defined()) i.leaf.set_grad(Tensor());
  release_unsharded();
  drop_leaves();
}

void FSDPGroup::finish_backward() {
  if (reshard_after_backward_ || !unsharded_) {
    free_leaves_after_backward();
    reshard();
    return;
  }
  // The leaves become the next forward's (unshard() finds them gathered, and gathers again only
  // if the shards were written meanwhile, by an optimizer step say); their gradients were read.
  for (ParamInfo& i : params_)
    if (i.leaf.defined()) i.leaf.set_grad(Tensor());
}

std::string FSDPGroup::label() const {
  auto m = module_.lock();
  return "fully_shard(" + (m ? m->type_name() : std::string("module")) + ")";
}

Tensor FSDPGroup::pre_forward(const Tensor& x) {
  // Its recomputation inside the backward would gather again, out of the backward's order of
  // collectives. (Every rank runs the same forward, so every rank refuses.)
  if (autograd::in_checkpoint_region()) {
    TESSERA_FAIL(label(),
                 ": its forward runs inside an activation-checkpointed region, whose "
                 "recomputation in the backward would gather its parameters again; checkpoint "
                 "this module itself (checkpoint(module) keeps fully_shard's hooks outside the "
                 "region) or modules inside it instead");
  }
  forget_dropped_forward();
  schedule_->record_forward(shared_from_this());
  // This group's all-gather first, then the next group's, then the wait: both transfers run
  // during it and during this group's compute.
  if (!unsharded_) start_gather();
  prefetch(/*forward=*/true);
  unshard();
  const auto& pd = opts_.mp_policy.param_dtype;
  Tensor in = x;
  if (pd && opts_.mp_policy.cast_forward_inputs && x.defined() && is_floating(x.dtype()) &&
      x.dtype() != *pd)
    in = cast(x, *pd);
  // The gradients of the group's trainable parameters can all be ready while its backward still
  // uses gathered weights that get none (frozen ones, such as a LoRA base: the gradient of the
  // input still flows through them). When the input requires grad, its gradient marks the end
  // of the group's backward; when it does not, no step of the group's backward is left once its
  // trainable parameters have their gradients.
  //
  // The input is usually the previous group's output, whose hook (registered in its
  // post_forward) starts that group's backward. This one goes first (prepended), as in PyTorch's
  // FSDP2: this group packs its gradients and frees its weights before the previous group
  // prefetches the one before it, so their buffers never coexist.
  if (!backward_pending_) input_grad_pending_ = 0;
  if (grad_enabled() && in.defined() && in.requires_grad()) {
    ++input_grad_pending_;
    std::weak_ptr<FSDPGroup> weak = weak_from_this();
    register_hook(
        in,
        [weak](const Tensor&) {
          if (auto s = weak.lock()) s->on_input_grad();
          return Tensor();
        },
        /*prepend=*/true);
  }
  return in.is_same(x) ? Tensor() : in;
}

// Every rank runs the same program, so every rank finds the same graphs gone.
void FSDPGroup::forget_dropped_forward() {
  if (!backward_pending_ || pending_outputs_.empty() || in_backward_) return;
  for (const auto& node : pending_outputs_)
    if (!node.expired()) return;
  // The leaves that graph saved are nobody's now: the next gather makes fresh ones, and the
  // next backward waits for this step's uses only.
  backward_pending_ = false;
  input_grad_pending_ = 0;
  pending_outputs_.clear();
}

Tensor FSDPGroup::post_forward(const Tensor& y) {
  if (grad_enabled() && y.defined() && y.requires_grad()) {
    if (!backward_pending_) pending_outputs_.clear();
    backward_pending_ = true;
    if (y.grad_fn()) pending_outputs_.push_back(y.grad_fn());
    std::weak_ptr<FSDPGroup> weak = weak_from_this();
    register_hook(y, [weak](const Tensor&) {
      if (auto s = weak.lock()) s->pre_backward();
      return Tensor();
    });
  }
  // A root keeps what its backward is about to gather again, unless told otherwise.
  const bool reshard_now =
      is_root_ && !reshard_after_forward_set_ ? !backward_pending_ : opts_.reshard_after_forward;
  if (reshard_now) reshard();
  const auto& od = opts_.mp_policy.output_dtype;
  if (od && y.defined() && is_floating(y.dtype()) && y.dtype() != *od) return cast(y, *od);
  return Tensor();
}

void FSDPGroup::begin_backward() {
  schedule_->begin_backward(shared_from_this());
}

void FSDPGroup::pre_backward() {
  // The end of the first backward freed the gathered weights this graph saved.
  TESSERA_CHECK(backward_pending_, label(),
                ": a second backward through the same forward (retain_graph) is not supported; "
                "run the forward again");
  begin_backward();
  in_backward_ = true;
  if (unsharded_) {
    // Kept gathered since the forward (the root, reshard_after_forward off): a write to the
    // shards meanwhile reaches no saved leaf's version counter, so it is caught here.
    TESSERA_CHECK(flat_.version() == leaves_shards_version_, label(),
                  ": its parameters were modified by an in-place operation (an optimizer step, "
                  "a load) between the forward and this backward, which would differentiate at "
                  "the old values; run backward before changing them");
    prefetch(/*forward=*/false);
    return;
  }
  // The leaves from this step's forward are what the autograd graph saved and where backward
  // accumulates gradients; when resharding released their bytes, gather into them again.
  if (!params_.empty() && params_.front().leaf.defined()) {
    schedule_->gather_through(this);
    prefetch(/*forward=*/false);  // before waiting for this group's own, as in pre_forward
    if (pending_gather_ || leaves_released_) finish_gather(/*fresh=*/false);
    set_unsharded_params();
  } else {
    unshard();
    prefetch(/*forward=*/false);
  }
}

bool FSDPGroup::all_grads_in() const {
  for (const ParamInfo& i : params_) {
    if (!i.leaf.defined() || !i.leaf.requires_grad() || i.grad_in) continue;
    if (!in_backward_) return false;
    const AutogradMeta* m = i.leaf.autograd_meta_if_exists();
    if (m && !m->grad_accumulator.expired()) return false;  // a graph can still deliver it
  }
  return true;
}

void FSDPGroup::clear_grads_in() {
  for (ParamInfo& i : params_)
    i.grad_in = false;
  in_backward_ = false;
}

void FSDPGroup::on_grad_ready(size_t param) {
  begin_backward();
  params_[param].grad_in = true;
  if (!all_grads_in() || input_grad_pending_ > 0) return;
  grads_ready_for_reduce_ = true;
  schedule_->issue_ready_reduces();
}

void FSDPGroup::on_input_grad() {
  if (input_grad_pending_ == 0) return;
  if (--input_grad_pending_ > 0) return;  // another use's input still waits for its gradient
  if (!all_grads_in()) return;
  // Ready, also with nothing to reduce (frozen parameters only): reduces go out in backward
  // order, so one that never became ready would hold back every group after it until the end
  // of backward, each keeping its gathered weights and gradients.
  begin_backward();
  grads_ready_for_reduce_ = true;
  schedule_->issue_ready_reduces();
}

void FSDPGroup::mark_grads_pending(bool pending) {
  if (pending && !requires_gradient_sync_) return;  // the stored gradients are not touched
  for (ParamInfo& i : params_) {
    i.param->set_grad_pending(pending && i.param->requires_grad());
    sync_aliases(i);
  }
}

void FSDPGroup::start_reduce() {
  NoGradGuard no_grad;
  backward_pending_ = false;
  grads_ready_for_reduce_ = false;
  clear_grads_in();
  settle_backward_gather();
  const DType reduce_dtype =
      opts_.mp_policy.reduce_dtype.value_or(opts_.mp_policy.param_dtype.value_or(flat_.dtype()));
  if (!requires_gradient_sync_) {
    // Summed in the reduce dtype, as the reduction would: micro-batches summed in a 16-bit
    // param_dtype lose the precision that a float32 reduce_dtype asks for.
    for (ParamInfo& i : params_) {
      if (!i.leaf.defined() || !i.leaf.grad().defined()) continue;
      Tensor g = i.leaf.grad().to(reduce_dtype);
      i.accum_grad = i.accum_grad.defined()     ? add(i.accum_grad, g)
                     : g.is_same(i.leaf.grad()) ? g.contiguous().clone()
                                                : g.contiguous();
    }
    finish_backward();
    return;
  }
  bool trainable = false;
  for (const ParamInfo& i : params_)
    trainable |= i.param->requires_grad();
  if (!trainable) {  // the same on every rank: nothing to reduce
    for (ParamInfo& i : params_)
      i.accum_grad = Tensor();  // unsynced sums of parameters frozen since
    finish_backward();
    return;
  }
  // Packing needs only the gradients: free the gathered weights first.
  if (reshard_after_backward_) release_unsharded();
  // Each rank's block holds its rows of every trainable parameter's gradient, padded, then one
  // flag per parameter (1 where this rank has a gradient for it): the reduce-scatter sums the
  // flags too, so every rank learns which parameters got a gradient anywhere without another
  // collective.
  const int64_t k = reduce_pg_->size();
  PendingReduce pr;
  pr.offsets = reduce_offsets(pr.size);
  const int64_t block = pr.size + int64_t(params_.size());
  pr.send = zeros(Shape{k * block}, TensorOptions(reduce_dtype, flat_.device()));
  const int64_t n_params = int64_t(params_.size());
  const int64_t pre = predivide_factor(data_parallel_size(reduce_pg_, replicate_pg_), reduce_dtype);
  std::vector<float> has_grad(params_.size(), 0.0f);
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
  pr.send.as_strided({k, n_params}, {block, 1}, pr.size)
      .copy_(kernels::expand(from_vector<float>(has_grad, {1, n_params}), {k, n_params}));
  // The unsharded gradients are packed: free them before the transfer.
  finish_backward();
  pr.reduced = empty(Shape{block}, TensorOptions(reduce_dtype, flat_.device()));
  pr.work = reduce_pg_->reduce_scatter_tensor(pr.reduced, pr.send, ReduceOp::Sum);
  progress_in_background(pr.work);
  pending_reduce_ = std::move(pr);
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

bool FSDPGroup::partial_reduce_fits() const {
  int64_t size = 0;
  return !partial_reduce_ || partial_reduce_->offsets == reduce_offsets(size);
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
  if (requires_all_reduce_) return true;
  for (size_t p = 0; p < params_.size(); ++p)
    if (pr.offsets[p] >= 0) {
      params_[p].param->set_grad_pending(false);
      sync_aliases(params_[p]);
    }
  pr.work = nullptr;
  partial_reduce_ = std::move(pr);
  pending_reduce_.reset();
  return false;
}

bool FSDPGroup::advance_reduce(bool block) {
  if (!pending_reduce_) return true;
  NoGradGuard no_grad;
  PendingReduce& pr = *pending_reduce_;
  if (!wait_or_test(pr.work, block, stats_.reduce_scatter_wait_seconds)) return false;
  if (!pr.across_replicas) {
    ++stats_.reduce_scatters;
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
