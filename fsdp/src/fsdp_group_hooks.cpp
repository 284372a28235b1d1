// FSDPGroup's hooks: what fully_shard's module hooks (before and after forward) and the autograd
// hooks (on the outputs, the leaves and the input) do, and when a group's backward is over.
#include "fsdp_group.h"
#include "schedule.h"
#include "tessera/autograd/checkpoint.h"
#include "tessera/autograd/engine.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"

namespace tessera::detail {

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
  // The hook sits on an alias of the caller's tensor, made by this forward, as FSDP2 hooks the
  // outputs of its RegisterPostBackwardFunction: a hook on the caller's tensor would stay as long
  // as that tensor lives, so a trainable input or a kept tensor reused each step would collect
  // one per step, and every later backward would run them all (an earlier step's hook ending this
  // group's backward at that tensor's gradient while another use's backward still reads its
  // weights). The alias's gradient also comes before the caller's tensor's, whose hooks include
  // the previous group's (registered in its post_forward, starting that group's backward): this
  // group packs its gradients and frees its weights before the previous group prefetches the one
  // before it, so their buffers never coexist.
  if (!backward_pending_) input_grad_pending_ = 0;
  if (grad_enabled() && in.defined() && in.requires_grad()) {
    ++input_grad_pending_;
    if (in.is_same(x)) in = reshape(in, in.shape());
    std::weak_ptr<FSDPGroup> weak = weak_from_this();
    register_hook(in, [weak](const Tensor&) {
      if (auto s = weak.lock()) s->on_input_grad();
      return Tensor();
    });
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
  // Nor are the bytes its leaves viewed, or the piece reshard_after_forward=N kept for its
  // backward: gathered from them, the next forward would read the weights of that forward, not
  // what an optimizer step or a load wrote to the shards since. It gathers from the shards.
  if (!unsharded_) {
    if (pending_gather_ && pending_gather_->reuse) drop_pending_gather();
    drop_leaves();
  }
}

Tensor FSDPGroup::post_forward(const Tensor& y_in) {
  Tensor y = y_in;
  if (grad_enabled() && y.defined() && y.requires_grad()) {
    // A leaf output (the input passed through) has no node of this forward whose end says the
    // forward was dropped, and a hook on it would stay for every later backward that reaches it
    // (a trainable input reused each step). Its alias has both, as any computed output.
    if (!y.grad_fn()) y = reshape(y, y.shape());
    if (!backward_pending_) pending_outputs_.clear();
    backward_pending_ = true;
    pending_outputs_.push_back(y.grad_fn());
    std::weak_ptr<FSDPGroup> weak = weak_from_this();
    register_hook(y, [weak](const Tensor&) {
      if (auto s = weak.lock()) s->pre_backward();
      return Tensor();
    });
  }
  // A root keeps what its backward is about to gather again, unless told otherwise.
  const bool own_choice = !is_root_ || reshard_after_forward_set_;
  const bool reshard_now = own_choice ? bool(opts_.reshard_after_forward) : !backward_pending_;
  // The int form keeps a piece only for a backward to come, and only when reshard() frees the
  // gathered buffer (not while a gather into it is in flight); otherwise it reshards fully.
  if (reshard_now && own_choice && post_forward_plan_ && backward_pending_ && unsharded_ &&
      !pending_gather_ && gathered_.defined())
    keep_post_forward_piece();
  if (reshard_now) reshard();
  const auto& od = opts_.mp_policy.output_dtype;
  if (od && y.defined() && is_floating(y.dtype()) && y.dtype() != *od) return cast(y, *od);
  return y.is_same(y_in) ? Tensor() : y;
}

void FSDPGroup::begin_backward() {
  schedule_->begin_backward(shared_from_this());
}

void FSDPGroup::pre_backward() {
  // The end of a backward settled this forward (it settles every forward of the model still
  // pending: reduces their gradients, frees the gathered weights their graphs saved), whether
  // that backward went through this graph (retain_graph) or through another forward's. PyTorch's
  // FSDP2 gathers again in the second case; here the forward must run again.
  TESSERA_CHECK(backward_pending_, label(),
                ": a second backward through the same forward (retain_graph) is not supported, "
                "nor a backward through a forward an earlier backward settled (two forwards "
                "before their backwards: each backward settles every pending forward); run each "
                "forward's backward before the next forward, or run the forward again");
  begin_backward();
  in_backward_ = true;
  if (unsharded_) {
    // Kept gathered since the forward (the root, reshard_after_forward off). A write to the
    // shards meanwhile is refused at the end of backward (shards_written_).
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

}  // namespace tessera::detail
