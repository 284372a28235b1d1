// FSDPGroup's gathering: the all-gather of its shards (issued ahead, or prefetched for the next
// group), the leaves made over the gathered buffer, unshard and reshard.
#include <vector>

#include "fsdp_group.h"
#include "fsdp_util.h"
#include "registry.h"
#include "schedule.h"
#include "tessera/autograd/engine.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/comm/progress.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"

namespace tessera::detail {

namespace {
constexpr size_t kMaxReducesInFlightToPrefetch = 1;
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
  forget_dropped_forward();
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
  drop_stale_prefetch();
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
  // Whether to gather again must be the same on every rank, or their all-gathers would not
  // match: a rank whose pieces nobody wrote follows the others. Only a group found gathered at
  // its forward pays this (kept after backward or after a no_grad forward, a module used twice).
  return on_any_rank(flat_.version() != leaves_shards_version_);
}

bool FSDPGroup::on_any_rank(bool here) const {
  if (gather_pg_->size() == 1) return here;
  Tensor flag = full({1}, here ? 1.0 : 0.0, TensorOptions(DType::Int32, flat_.device()));
  gather_pg_->all_reduce(flag, ReduceOp::Max)->wait();
  return flag.item<int32_t>() != 0;
}

void FSDPGroup::drop_stale_prefetch() {
  if (!pending_gather_ || !pending_gather_->other_root) return;
  pending_gather_->other_root = false;  // checked once
  if (on_any_rank(pending_gather_->shards_version != flat_.version())) drop_pending_gather();
}

void FSDPGroup::start_gather() {
  if (pending_gather_) return;
  NoGradGuard no_grad;
  const DType gather_dtype = opts_.mp_policy.param_dtype.value_or(flat_.dtype());
  PendingGather g;
  g.id = ++gathers_started_;
  // Before this group's backward the graph's saved leaves are views of the released buffer:
  // gather into its bytes again. Otherwise into a fresh buffer for fresh leaves.
  g.reuse = leaves_released_;
  g.from_post_forward = g.reuse && post_forward_piece_.has_value();
  g.shards_version = flat_.version();
  if (g.from_post_forward)
    g.send = post_forward_piece_->piece;
  else
    g.send = gather_dtype == flat_.dtype() ? flat_ : flat_.to(gather_dtype);
  if (g.reuse) {
    g.saved_version = gathered_.version();
    gathered_.storage().impl()->reallocate();
    leaves_released_ = false;
    g.target = gathered_;
  } else {
    g.target = empty(Shape{unsharded_numel_}, TensorOptions(gather_dtype, flat_.device()));
  }
  if (g.from_post_forward) {
    const PostForwardPlan& plan = *post_forward_piece_->plan;
    g.work = plan.pg->all_gather_runs(g.target, g.send, plan.runs);
    g.group_size = plan.pg->size();
  } else {
    g.work = gather_pg_->all_gather_runs(g.target, g.send, gather_runs_);
    g.group_size = gather_pg_->size();
  }
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
  ++stats_.all_gathers_by_group_size[g.group_size];
  stats_.all_gather_wait_seconds += wait_seconds(g.work);
  // The leaves hold the values now; a later release gathers from the stored shards.
  if (g.from_post_forward) post_forward_piece_.reset();
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
      t->forget_dropped_forward();  // before its own forward does: not from a stale piece
      t->start_gather();
      if (t->schedule_ != schedule_ && !t->pending_gather_->reuse)
        t->pending_gather_->other_root = true;
      // This step's, also for a group under another root (an explicit target): its forward uses
      // it in this step, or this step drops it. A gather into the leaves a pending backward
      // saved (a module used again later in its forward) is its own step's to settle.
      if (!t->pending_gather_->reuse)
        schedule_->forward_prefetched.push_back({t, t->pending_gather_->id});
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

void FSDPGroup::reshard_fully() {
  reshard();
  // A gather issued from the piece (a prefetch) still holds it until it is used or dropped.
  post_forward_piece_.reset();
}

void FSDPGroup::drop_leaves() {
  for (ParamInfo& i : params_)
    i.leaf = Tensor();
  post_forward_piece_.reset();
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

ReshardAfterForward FSDPGroup::resolve_reshard_after_forward(const ReshardAfterForward& r) const {
  const std::optional<int64_t> n = r.world_size();
  if (!n) return r;
  const int64_t size = gather_pg_->size();
  TESSERA_CHECK(*n >= 1 && size % *n == 0, label(), ": reshard_after_forward=", *n,
                " is not a world size to reshard to within the shard group of ", size,
                " ranks; an int must divide ", size, " (1 acts as false, ", size,
                " as true; true and false stay bools)");
  if (*n == 1) return false;
  if (*n == size) return true;
  return r;
}

void FSDPGroup::apply_reshard_after_forward(const ReshardAfterForward& r) {
  opts_.reshard_after_forward = r;
  post_forward_plan_.reset();
  const std::optional<int64_t> n = r.world_size();
  if (!n) return;
  auto plan = std::make_shared<PostForwardPlan>();
  plan->pg = post_forward_group(shard_pg_, *n);
  // Sub-group rank j keeps the stored shards of shard ranks j*k .. j*k + k - 1, so the ranks of
  // every sub-group together hold the whole group, in the shard group's order.
  const int64_t k = gather_pg_->size() / *n;
  plan->runs.assign(size_t(*n), {});
  for (int64_t j = 0; j < *n; ++j)
    for (int64_t t = 0; t < k; ++t)
      for (const GatherRun& run : gather_runs_[size_t(j * k + t)])
        plan->runs[size_t(j)].push_back({t * padded_size_ + run.src, run.dst, run.length});
  post_forward_plan_ = std::move(plan);
}

void FSDPGroup::keep_post_forward_piece() {
  NoGradGuard no_grad;
  const PostForwardPlan& plan = *post_forward_plan_;
  const int64_t k = gather_pg_->size() / plan.pg->size();
  const int64_t j = plan.pg->rank();
  // Zeros: the padding between runs is sent (by some backends) though never placed.
  Tensor piece =
      zeros(Shape{k * padded_size_}, TensorOptions(gathered_.dtype(), gathered_.device()));
  for (int64_t t = 0; t < k; ++t)
    for (const GatherRun& run : gather_runs_[size_t(j * k + t)])
      flat_window(piece, t * padded_size_ + run.src, run.length)
          .copy_(flat_window(gathered_, run.dst, run.length));
  post_forward_piece_ = PostForwardPiece{post_forward_plan_, piece};
}

std::string FSDPGroup::label() const {
  auto m = module_.lock();
  return "fully_shard(" + (m ? m->type_name() : std::string("module")) + ")";
}

}  // namespace tessera::detail
