#include <cmath>

#include "tessera/autograd/engine.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/layout.h"
#include "tessera/fsdp/fully_shard.h"

namespace tessera {

namespace {

// The flat window [start, start + length) of a contiguous tensor, as a view.
Tensor flat_window(const Tensor& t, int64_t start, int64_t length) {
  return kernels::narrow(kernels::view(t, Shape{t.numel()}), 0, start, length);
}

}  // namespace

std::vector<Parameter*> FSDPState::parameters() const {
  std::vector<Parameter*> out;
  for (const ParamInfo& i : params_)
    out.push_back(i.param);
  return out;
}

std::vector<std::string> FSDPState::parameter_names() const {
  std::vector<std::string> out;
  for (const ParamInfo& i : params_)
    out.push_back(i.name);
  return out;
}

void FSDPState::set_unsharded_params() {
  for (ParamInfo& i : params_) {
    DTensor dt;
    if (i.tp_mesh) dt = DTensor::from_local(i.leaf, *i.tp_mesh, i.tp_placements, i.tp_global_shape);
    i.param->set_unsharded(i.leaf, dt);
  }
  unsharded_ = true;
}

void FSDPState::unshard() {
  if (unsharded_) return;
  drop_leaves();
  gather(/*fresh=*/true);
  grads_ready_ = 0;
  set_unsharded_params();
}

void FSDPState::gather(bool fresh) {
  NoGradGuard no_grad;
  const int64_t k = shard_pg_->size();
  const DType gather_dtype = opts_.mp_policy.param_dtype.value_or(flat_.dtype());
  Tensor send = gather_dtype == flat_.dtype() ? flat_ : flat_.to(gather_dtype);
  Tensor gathered = empty(Shape{k * padded_size_}, gather_dtype);
  shard_pg_->all_gather_into_tensor(gathered, send)->wait();
  for (ParamInfo& i : params_) {
    Tensor leaf = fresh ? empty(i.unsharded_shape, gather_dtype) : i.leaf;
    if (!fresh) leaf.storage().impl()->reallocate();
    for (int64_t r = 0; r < k; ++r) {
      const Chunk c = chunk_of(i.rows, k, r);
      if (c.length == 0) continue;
      flat_window(leaf.detach(), c.start * i.row_numel, c.length * i.row_numel)
          .copy_(flat_window(gathered, r * padded_size_ + i.offset, c.length * i.row_numel));
    }
    if (fresh && i.param->requires_grad()) {
      leaf.set_requires_grad(true);
      std::weak_ptr<FSDPState> weak = weak_from_this();
      register_post_accumulate_grad_hook(leaf, [weak](Tensor&) {
        if (auto s = weak.lock()) s->on_grad_ready();
      });
    }
    i.leaf = leaf;
  }
  leaves_released_ = false;
}

void FSDPState::reshard() {
  for (ParamInfo& i : params_)
    i.param->clear_unsharded();
  unsharded_ = false;
  if (!backward_pending_) {
    drop_leaves();
  } else if (!leaves_released_) {
    // The autograd graph holds the gathered leaves until backward; free their bytes now and
    // gather into them again just before this group's backward (pre_backward).
    for (ParamInfo& i : params_)
      if (i.leaf.defined()) i.leaf.storage().impl()->release();
    leaves_released_ = true;
  }
}

void FSDPState::drop_leaves() {
  for (ParamInfo& i : params_)
    i.leaf = Tensor();
  leaves_released_ = false;
}

void FSDPState::free_leaves_after_backward() {
  // The graph (its AccumulateGrad nodes) still refers to the leaves until the whole backward
  // ends; free their bytes and their unsharded gradients now, so that only the groups whose
  // backward is running hold gathered memory.
  for (ParamInfo& i : params_) {
    if (!i.leaf.defined()) continue;
    i.leaf.set_grad(Tensor());
    if (!i.leaf.storage().impl()->is_released()) i.leaf.storage().impl()->release();
  }
  drop_leaves();
}

Tensor FSDPState::pre_forward(const Tensor& x) {
  unshard();
  const auto& pd = opts_.mp_policy.param_dtype;
  if (pd && x.defined() && is_floating(x.dtype()) && x.dtype() != *pd) return cast(x, *pd);
  return Tensor();
}

Tensor FSDPState::post_forward(const Tensor& y) {
  if (grad_enabled() && y.defined() && y.requires_grad()) {
    backward_pending_ = true;
    std::weak_ptr<FSDPState> weak = weak_from_this();
    register_hook(y, [weak](const Tensor&) {
      if (auto s = weak.lock()) s->pre_backward();
      return Tensor();
    });
  }
  if (!backward_pending_ || (opts_.reshard_after_forward && !is_root_)) reshard();
  const auto& od = opts_.mp_policy.output_dtype;
  if (od && y.defined() && is_floating(y.dtype()) && y.dtype() != *od) return cast(y, *od);
  return Tensor();
}

void FSDPState::queue_finalize() {
  if (finalize_queued_) return;
  finalize_queued_ = true;
  std::weak_ptr<FSDPState> weak = weak_from_this();
  autograd::queue_callback([weak] {
    if (auto s = weak.lock()) s->finalize_backward();
  });
}

void FSDPState::pre_backward() {
  queue_finalize();
  if (unsharded_) return;
  // The leaves from this step's forward are what the autograd graph saved and where backward
  // accumulates gradients; when resharding released their bytes, gather into them again.
  if (!params_.empty() && params_.front().leaf.defined()) {
    if (leaves_released_) gather(/*fresh=*/false);
    set_unsharded_params();
  } else {
    unshard();
  }
}

void FSDPState::on_grad_ready() {
  queue_finalize();
  ++grads_ready_;
  int64_t expected = 0;
  for (const ParamInfo& i : params_)
    expected += i.leaf.defined() && i.leaf.requires_grad();
  if (grads_ready_ == expected) post_backward();
}

void FSDPState::finalize_backward() {
  finalize_queued_ = false;
  // Parameters that got no gradient this backward (unused in forward) still take part in the
  // reduce-scatter with zeros, so every rank issues the same collectives.
  if (backward_pending_) {
    bool any = false;
    for (const ParamInfo& i : params_)
      any |= i.leaf.defined() && i.leaf.grad().defined();
    if (any)
      post_backward();
    else
      backward_pending_ = false;
  }
  reshard();
}

void FSDPState::post_backward() {
  NoGradGuard no_grad;
  backward_pending_ = false;
  grads_ready_ = 0;
  if (!requires_gradient_sync_) {
    for (ParamInfo& i : params_) {
      if (!i.leaf.defined() || !i.leaf.grad().defined()) continue;
      Tensor g = i.leaf.grad();
      i.accum_grad = i.accum_grad.defined() ? add(i.accum_grad, g) : g.contiguous().clone();
    }
    free_leaves_after_backward();
    reshard();
    return;
  }
  const int64_t k = shard_pg_->size();
  const DType stored_dtype = flat_.dtype();
  const DType reduce_dtype =
      opts_.mp_policy.reduce_dtype.value_or(opts_.mp_policy.param_dtype.value_or(stored_dtype));
  Tensor send = zeros(Shape{k * padded_size_}, reduce_dtype);
  std::vector<bool> has_grad(params_.size(), false);
  for (size_t p = 0; p < params_.size(); ++p) {
    ParamInfo& i = params_[p];
    if (!i.param->requires_grad()) continue;
    Tensor g = i.leaf.defined() ? i.leaf.grad() : Tensor();
    if (i.accum_grad.defined()) g = g.defined() ? add(i.accum_grad, g) : i.accum_grad;
    i.accum_grad = Tensor();
    if (!g.defined()) continue;
    has_grad[p] = true;
    TESSERA_CHECK(g.shape() == i.unsharded_shape, "fully_shard: gradient of '", i.name, "' is ",
                  g.str(), "; expected the unsharded shape ", shape_str(i.unsharded_shape));
    g = g.contiguous();
    for (int64_t r = 0; r < k; ++r) {
      const Chunk c = chunk_of(i.rows, k, r);
      if (c.length == 0) continue;
      flat_window(send, r * padded_size_ + i.offset, c.length * i.row_numel)
          .copy_(flat_window(g, c.start * i.row_numel, c.length * i.row_numel));
    }
  }
  Tensor reduced = empty(Shape{padded_size_}, reduce_dtype);
  shard_pg_->reduce_scatter_tensor(reduced, send, ReduceOp::Sum)->wait();
  int64_t dp = k;
  if (replicate_pg_) {
    replicate_pg_->all_reduce(reduced, ReduceOp::Sum)->wait();
    dp *= replicate_pg_->size();
  }
  // Each rank's loss is the mean over its own rows: averaging over the data-parallel ranks
  // gives the gradient of the mean loss over the global batch.
  Tensor averaged = mul(reduced.to(stored_dtype), 1.0 / double(dp));
  for (size_t p = 0; p < params_.size(); ++p) {
    if (!has_grad[p]) continue;
    ParamInfo& i = params_[p];
    const Tensor& stored = i.param->stored();
    Tensor g = kernels::view(flat_window(averaged, i.offset, stored.numel()), stored.shape());
    Tensor old = stored.grad();
    Tensor(stored).set_grad(old.defined() ? add(old, g) : g);
  }
  free_leaves_after_backward();
  reshard();
}

}  // namespace tessera
