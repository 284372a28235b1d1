// Activation checkpointing (checkpoint.h) and the frame that holds a region's saved tensors.
#include "tessera/autograd/checkpoint.h"

#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>

#include "checkpoint_frame.h"
#include "tessera/autograd/grad_mode.h"

namespace tessera {

namespace autograd::detail {

namespace {
thread_local CheckpointFrame* t_packing = nullptr;
thread_local CheckpointFrame* t_keeping = nullptr;

std::string describe(const Tensor& t) {
  return dtype_name(t.dtype()) + std::string(" ") + shape_str(t.shape());
}
}  // namespace

std::string node_name(const char* mangled) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string out = status == 0 && demangled ? demangled : mangled;
  std::free(demangled);
  return out;
}

CheckpointFrame::CheckpointFrame(std::shared_ptr<const Fn> fn, Tensor x)
    : fn_(std::move(fn)), x_(std::move(x)), first_serial_(StorageImpl::next_serial()) {}

CheckpointFrame* CheckpointFrame::packing() {
  return t_packing;
}
CheckpointFrame* CheckpointFrame::keeping() {
  return t_keeping;
}

Tensor CheckpointFrame::run_forward() {
  // A region inside another's forward: the enclosing one is told what this one reads and which
  // generators it uses too, since its recomputation runs this region's function again.
  enclosing_ = t_packing;
  struct Scope {
    CheckpointFrame& frame;
    tessera::detail::GeneratorObserver* observer = tessera::detail::t_generator_observer;
    explicit Scope(CheckpointFrame& f) : frame(f) {
      t_packing = &f;
      tessera::detail::t_generator_observer = &f;
    }
    ~Scope() {
      t_packing = frame.enclosing_;
      frame.enclosing_ = nullptr;
      tessera::detail::t_generator_observer = observer;
    }
  } scope(*this);
  Tensor y = (*fn_)(x_);
  // What a write after this point would change under the recomputation.
  for (auto& [impl, o] : outside_)
    if (auto s = o.storage.lock()) o.version = s->version();
  return y;
}

void CheckpointFrame::saw_inputs(const std::vector<Tensor>& inputs, const char* node) {
  if (enclosing_) enclosing_->saw_inputs(inputs, node);
  for (const Tensor& t : inputs) {
    if (!t.defined()) continue;
    const StorageImpl* impl = t.storage().impl();
    if (!impl || impl->serial() >= first_serial_ || outside_.count(impl)) continue;
    outside_[impl] = {t.storage().weak_impl(), describe(t), node, 0};
  }
}

size_t CheckpointFrame::pack(const Tensor& t, const char* node) {
  const StorageImpl* impl = t.storage().impl();
  const bool outside = impl && impl->serial() < first_serial_;
  packed_.push_back({t.shape(), t.dtype(), t.device(), t.storage().weak_impl(),
                     outside ? t.storage() : Storage(), t.version(), node});
  released_.push_back(false);
  return packed_.size() - 1;
}

void CheckpointFrame::keep(const Tensor& t) {
  const size_t i = kept_.size();
  // Detached: a kept tensor must not hold the recomputation's graph (and through it the
  // parameters' gradient accumulators) alive.
  kept_.push_back(i < released_.size() && released_[i] ? Tensor() : t.detach());
  kept_versions_.push_back(t.version());
}

void CheckpointFrame::used(const Generator& gen, uint64_t offset) {
  if (enclosing_) enclosing_->used(gen, offset);
  // Generators made and dropped inside the region (a copy drawn from once) are gone by now.
  std::erase_if(generators_, [](const Drawn& d) { return d.gen.expired(); });
  const auto handle = gen.handle();
  for (const Drawn& d : generators_)
    if (!d.gen.owner_before(handle) && !handle.owner_before(d.gen)) return;
  generators_.push_back({handle, gen.seed(), offset});
}

std::vector<CheckpointFrame::Drawn> CheckpointFrame::set_generators(const std::vector<Drawn>& to) {
  std::vector<Drawn> was;
  for (const Drawn& d : to) {
    const auto handle = d.gen.lock();
    if (!handle) continue;  // destroyed since: nothing draws from it again
    Generator& gen = *handle->at;
    was.push_back({d.gen, gen.seed(), gen.offset()});
    gen.manual_seed(d.seed);
    gen.set_offset(d.offset);
  }
  return was;
}

Tensor CheckpointFrame::unpack(size_t id, const char* node) {
  TESSERA_CHECK(id < packed_.size() && !released_[id], "checkpoint: ", node_name(node),
                " needs saved tensor ", id,
                " of its checkpointed region, which an earlier backward freed; pass "
                "retain_graph=true to backward through the graph twice");
  if (id >= kept_.size() || !kept_[id].defined()) recompute(node);
  // Handed out once: the node holds it while it runs, and a retained graph's next backward
  // recomputes rather than the frame holding the region's activations between backwards.
  const Tensor k = std::move(kept_[id]);
  kept_[id] = Tensor();
  TESSERA_CHECK(k.version() == kept_versions_[id], "checkpoint: ", node_name(node),
                ": one of the tensors needed for gradient computation (", describe(k),
                ", recomputed in a checkpointed region) has been modified by an in-place "
                "operation since: version ",
                k.version(), ", expected ", kept_versions_[id],
                "; do the write after the last backward through the region");
  return k;
}

void CheckpointFrame::release(size_t id) {
  if (id < released_.size()) released_[id] = true;
  if (id < kept_.size()) kept_[id] = Tensor();
}

void CheckpointFrame::check_inputs_unchanged(const char* node) const {
  for (const auto& [impl, o] : outside_) {
    const auto s = o.storage.lock();
    if (!s || s->version() == o.version) continue;
    TESSERA_FAIL("checkpoint: recomputing the region for ", node_name(node),
                 ": a tensor it read from outside (", o.shape, ", read by ", node_name(o.node),
                 ") has been modified by an in-place operation since the forward (version ",
                 s->version(), ", expected ", o.version,
                 "), so the recomputation would see other values (an optimizer step, a load, "
                 "copy_ ...); do the write after backward");
  }
}

void CheckpointFrame::recompute(const char* node) {
  TESSERA_CHECK(t_keeping == nullptr && t_packing == nullptr,
                "checkpoint: a region's recomputation (for ", node_name(node),
                ") started inside another's forward or recomputation");
  check_inputs_unchanged(node);
  // The generators the region used go back to where they stood before it (seed and offset),
  // and afterwards to where they stand now, also when the recomputation throws.
  struct Restore {
    std::vector<Drawn> now;
    tessera::detail::GeneratorObserver* observer = tessera::detail::t_generator_observer;
    ~Restore() {
      t_keeping = nullptr;
      tessera::detail::t_generator_observer = observer;
      set_generators(now);
    }
  } restore;
  restore.now = set_generators(generators_);
  kept_.clear();
  kept_versions_.clear();
  t_keeping = this;
  tessera::detail::t_generator_observer = nullptr;
  {
    EnableGradGuard grad;
    // On a detached input: what fn does to its input's autograd state (a hook registered on it)
    // must not happen to the forward's graph a second time.
    Tensor in = x_.detach();
    if (x_.requires_grad()) in.set_requires_grad(true);
    (void)(*fn_)(in);
  }
  check_recomputed(node);
}

void CheckpointFrame::check_recomputed(const char* node) const {
  // The messages' arguments are evaluated only when a check fails: this runs for every saved
  // tensor of every recomputation.
  const auto rule = [] {
    return "; the checkpointed function must run the same operations again (no branch on state "
           "changed since the forward)";
  };
  TESSERA_CHECK(kept_.size() == packed_.size(), "checkpoint: recomputing the region for ",
                node_name(node), " kept ", kept_.size(),
                " tensors for backward where its forward kept ", packed_.size(), rule());
  for (size_t i = 0; i < packed_.size(); ++i) {
    const Packed& p = packed_[i];
    if (released_[i]) continue;
    const Tensor& k = kept_[i];
    const auto saved_by = [&] {
      return "tensor " + std::to_string(i) + " saved by " + node_name(p.node);
    };
    TESSERA_CHECK(k.shape() == p.shape && k.dtype() == p.dtype && k.device() == p.device,
                  "checkpoint: recomputing the region for ", node_name(node), ", ", saved_by(),
                  " is ", describe(k), " on ", k.device().str(), " where the forward saved ",
                  dtype_name(p.dtype), " ", shape_str(p.shape), " on ", p.device.str(), rule());
    const auto s = p.storage.lock();
    const bool same_storage = s && s.get() == k.storage().impl();
    // A parameter or input of the region: the same one again, or the module's state changed.
    TESSERA_CHECK(!p.held.defined() || same_storage, "checkpoint: recomputing the region for ",
                  node_name(node), ", ", saved_by(),
                  " is another tensor than in the forward (it came from outside the region): "
                  "the modules' state changed between the forward and the backward (set_adapter, "
                  "set_batch_adapters, a replaced parameter ...); change it after backward");
    TESSERA_CHECK(!same_storage || kept_versions_[i] == p.version, "checkpoint: ", node_name(node),
                  ": one of the tensors needed for gradient computation (", describe(k), ", ",
                  saved_by(),
                  " in a checkpointed region) has been modified by an in-place operation since "
                  "the forward: version ",
                  kept_versions_[i], ", expected ", p.version,
                  " (an optimizer step, a load, copy_ ...); do the write after backward");
  }
}

}  // namespace autograd::detail

namespace autograd {
bool in_checkpoint_region() {
  return detail::t_packing != nullptr;
}
bool in_checkpoint_recompute() {
  return detail::t_keeping != nullptr;
}
}  // namespace autograd

Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x) {
  using autograd::detail::CheckpointFrame;
  TESSERA_CHECK(fn != nullptr, "checkpoint: no function given");
  if (!grad_enabled()) return fn(x);
  if (autograd::in_checkpoint_recompute()) {
    // A region nested in one being recomputed: its own nodes from the forward recompute
    // themselves when the backward reaches them; here it only gives the enclosing region its
    // values again, keeping nothing into that region's frame (its graph is dropped after).
    struct Suspend {
      CheckpointFrame* keeping = autograd::detail::t_keeping;
      Suspend() { autograd::detail::t_keeping = nullptr; }
      ~Suspend() { autograd::detail::t_keeping = keeping; }
    } suspend;
    return fn(x);
  }
  // The one copy both runs use, made before the frame: a generator it holds counts as older
  // than the region, so its draws are put back for the recomputation.
  auto own = std::make_shared<const CheckpointFrame::Fn>(fn);
  auto frame = std::make_shared<CheckpointFrame>(std::move(own), x);
  return frame->run_forward();
}

}  // namespace tessera
