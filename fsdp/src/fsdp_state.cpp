// FSDPState, the public handle: each call acts on every dtype group of its fully_shard call.
#include <cmath>
#include <functional>
#include <string>

#include "fsdp_group.h"
#include "registry.h"

namespace tessera {

using detail::FSDPGroup;

namespace {

// A handle may outlive its model; then its parameters are gone with it.
void check_module_alive(const std::vector<std::shared_ptr<FSDPGroup>>& groups, const char* call) {
  TESSERA_CHECK(!groups.front()->module_.expired(), "FSDPState::", call,
                ": the fully_shard'ed module was destroyed; this handle only reports its stats");
}

// Sets a flag on this call's groups and, with `recurse` (PyTorch's FSDPModule setters), on every
// group of a fully_shard'ed module inside the module.
void for_groups(const std::vector<std::shared_ptr<FSDPGroup>>& groups, bool recurse,
                const std::function<void(FSDPGroup&)>& set) {
  for (const auto& g : groups)
    set(*g);
  if (!recurse) return;
  if (auto m = groups.front()->module_.lock())
    for (const auto& g : detail::groups_inside(detail::live_groups(), *m))
      set(*g);
}

}  // namespace

std::string ReshardAfterForward::str() const {
  if (world_size_) return std::to_string(*world_size_);
  return reshard_ ? "true" : "false";
}

FSDPState::FSDPState(std::vector<std::shared_ptr<FSDPGroup>> groups) : groups_(std::move(groups)) {
  TESSERA_CHECK(!groups_.empty(), "FSDPState: no parameter group");
}

FSDPState::~FSDPState() = default;

UnshardHandle FSDPState::unshard(bool async_op) {
  check_module_alive(groups_, "unshard");
  UnshardHandle handle;
  for (const auto& g : groups_) {
    g->unshard(async_op);
    if (g->pending_gather_) handle.gathers_.emplace_back(g, g->pending_gather_->id);
  }
  return handle;
}

void UnshardHandle::wait() {
  for (const auto& [weak, id] : gathers_) {
    auto g = weak.lock();
    // Another gather of the group since (or none) means this one was used or dropped.
    if (g && g->pending_gather_ && g->pending_gather_->id == id) g->unshard();
  }
  gathers_.clear();
}

void FSDPState::reshard() {
  check_module_alive(groups_, "reshard");
  for (const auto& g : groups_)
    g->reshard_fully();
}

void FSDPState::set_requires_gradient_sync(bool sync, bool recurse) {
  for_groups(groups_, recurse, [sync](FSDPGroup& g) { g.requires_gradient_sync_ = sync; });
}

void FSDPState::set_requires_all_reduce(bool all_reduce, bool recurse) {
  for_groups(groups_, recurse, [all_reduce](FSDPGroup& g) { g.requires_all_reduce_ = all_reduce; });
}

void FSDPState::set_reshard_after_backward(bool r, bool recurse) {
  for_groups(groups_, recurse, [r](FSDPGroup& g) { g.reshard_after_backward_ = r; });
}

void FSDPState::set_reshard_after_forward(ReshardAfterForward r, bool recurse) {
  // Every group checks the value before any takes it: a refused call changes nothing.
  for_groups(groups_, recurse, [&r](FSDPGroup& g) { g.resolve_reshard_after_forward(r); });
  for_groups(groups_, recurse, [&r](FSDPGroup& g) {
    g.apply_reshard_after_forward(g.resolve_reshard_after_forward(r));
    g.reshard_after_forward_set_ = true;
  });
}

void FSDPState::set_gradient_divide_factor(double factor) {
  TESSERA_CHECK(std::isfinite(factor) && factor > 0, "set_gradient_divide_factor: ", factor,
                " is not a positive finite number");
  for (const auto& g : groups_)
    g->gradient_divide_factor_ = factor;
}

void FSDPState::set_modules_to_forward_prefetch(
    const std::vector<std::shared_ptr<FSDPState>>& states) {
  std::vector<std::weak_ptr<FSDPGroup>> targets;  // every dtype group of every target
  for (const auto& s : states) {
    TESSERA_CHECK(s != nullptr, "set_modules_to_forward_prefetch: a target is null");
    targets.insert(targets.end(), s->groups_.begin(), s->groups_.end());
  }
  for (const auto& g : groups_)
    g->forward_prefetch_ = targets;
}

void FSDPState::set_modules_to_backward_prefetch(
    const std::vector<std::shared_ptr<FSDPState>>& states) {
  std::vector<std::weak_ptr<FSDPGroup>> targets;
  for (const auto& s : states) {
    TESSERA_CHECK(s != nullptr, "set_modules_to_backward_prefetch: a target is null");
    targets.insert(targets.end(), s->groups_.begin(), s->groups_.end());
  }
  for (const auto& g : groups_)
    g->backward_prefetch_ = targets;
}

std::vector<Parameter*> FSDPState::parameters() const {
  check_module_alive(groups_, "parameters");
  std::vector<Parameter*> out;
  for (const auto& g : groups_)
    for (const FSDPGroup::ParamInfo& i : g->params_)
      out.push_back(i.param);
  return out;
}

std::vector<std::string> FSDPState::parameter_names() const {
  check_module_alive(groups_, "parameter_names");
  std::vector<std::string> out;
  for (const auto& g : groups_)
    for (const FSDPGroup::ParamInfo& i : g->params_)
      out.push_back(i.name);
  return out;
}

const Tensor& FSDPState::flat_buffer() const {
  if (groups_.size() > 1) {
    std::string dtypes;
    for (const auto& g : groups_)
      dtypes += std::string(dtypes.empty() ? "" : ", ") + dtype_name(g->flat_.dtype());
    TESSERA_FAIL("FSDPState::flat_buffer: the parameters have several dtypes (", dtypes,
                 "), one buffer each; say which: flat_buffer(dtype)");
  }
  return groups_.front()->flat_;
}

const Tensor& FSDPState::flat_buffer(DType dtype) const {
  for (const auto& g : groups_)
    if (g->flat_.dtype() == dtype) return g->flat_;
  TESSERA_FAIL("FSDPState::flat_buffer: no parameter of dtype ", dtype_name(dtype),
               " in this group");
}

bool FSDPState::is_unsharded() const {
  for (const auto& g : groups_)
    if (!g->unsharded_) return false;
  return true;
}

bool FSDPState::is_root() const {
  return groups_.front()->is_root_;
}

const FSDPOptions& FSDPState::options() const {
  return groups_.front()->opts_;
}

FSDPCommStats FSDPState::comm_stats() const {
  FSDPCommStats t;
  for (const auto& g : groups_) {
    t.all_gathers += g->stats_.all_gathers;
    for (const auto& [size, n] : g->stats_.all_gathers_by_group_size)
      t.all_gathers_by_group_size[size] += n;
    t.all_gather_wait_seconds += g->stats_.all_gather_wait_seconds;
    t.reduce_scatters += g->stats_.reduce_scatters;
    t.reduce_scatter_wait_seconds += g->stats_.reduce_scatter_wait_seconds;
  }
  return t;
}

void FSDPState::reset_comm_stats() {
  for (const auto& g : groups_)
    g->stats_ = {};
}

}  // namespace tessera
