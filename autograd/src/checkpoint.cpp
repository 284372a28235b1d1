// Activation checkpointing (checkpoint.h) and the frame that holds a region's saved tensors.
#include "tessera/autograd/checkpoint.h"

#include <algorithm>

#include "checkpoint_frame.h"
#include "tessera/autograd/grad_mode.h"

namespace tessera {

namespace autograd::detail {

namespace {
thread_local CheckpointFrame* t_packing = nullptr;
thread_local CheckpointFrame* t_keeping = nullptr;
}  // namespace

CheckpointFrame::CheckpointFrame(std::function<void()> recompute)
    : recompute_(std::move(recompute)), stamp_(tessera::detail::next_generator_stamp()) {}

CheckpointFrame* CheckpointFrame::packing() {
  return t_packing;
}
CheckpointFrame* CheckpointFrame::keeping() {
  return t_keeping;
}

CheckpointFrame::Forward::Forward(CheckpointFrame& frame)
    : observer_(tessera::detail::t_generator_observer) {
  t_packing = &frame;
  tessera::detail::t_generator_observer = &frame;
}

CheckpointFrame::Forward::~Forward() {
  t_packing = nullptr;
  tessera::detail::t_generator_observer = observer_;
}

size_t CheckpointFrame::pack(const Tensor& t) {
  packed_.push_back({t.shape(), t.dtype(), t.storage().weak_impl(), t.version()});
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

void CheckpointFrame::advanced(Generator& gen, uint64_t start) {
  if (gen.stamp() >= stamp_) return;  // made inside the region: made again by the recomputation
  for (const auto& [g, s] : generators_)
    if (g == &gen) return;
  generators_.emplace_back(&gen, start);
}

Tensor CheckpointFrame::unpack(size_t id, const std::string& node) {
  if (!recomputed_) recompute(node);
  TESSERA_CHECK(id < kept_.size() && kept_[id].defined(), "checkpoint: ", node,
                " needs saved tensor ", id,
                " of its checkpointed region, which an earlier backward freed; pass "
                "retain_graph=true to backward through the graph twice");
  return kept_[id];
}

void CheckpointFrame::release(size_t id) {
  if (id < released_.size()) released_[id] = true;
  if (id < kept_.size()) kept_[id] = Tensor();
}

void CheckpointFrame::recompute(const std::string& node) {
  TESSERA_CHECK(t_keeping == nullptr && t_packing == nullptr,
                "checkpoint: a region's recomputation (for ", node,
                ") started inside another's forward or recomputation");
  // The generators the region advanced go back to where they stood before it, and afterwards
  // to where they stand now, also when the recomputation throws.
  std::vector<uint64_t> now;
  for (auto& [g, start] : generators_) {
    now.push_back(g->offset());
    g->set_offset(start);
  }
  struct Restore {
    CheckpointFrame& f;
    std::vector<uint64_t>& now;
    tessera::detail::GeneratorObserver* observer = tessera::detail::t_generator_observer;
    ~Restore() {
      t_keeping = nullptr;
      tessera::detail::t_generator_observer = observer;
      for (size_t i = 0; i < f.generators_.size(); ++i)
        f.generators_[i].first->set_offset(now[i]);
    }
  } restore{*this, now};
  kept_.clear();
  kept_versions_.clear();
  t_keeping = this;
  tessera::detail::t_generator_observer = nullptr;
  {
    EnableGradGuard grad;
    recompute_();
  }
  check_recomputed(node);
  recomputed_ = true;
}

void CheckpointFrame::check_recomputed(const std::string& node) const {
  const char* rule =
      "; the checkpointed function must run the same operations again (no branch on state "
      "changed since the forward)";
  TESSERA_CHECK(kept_.size() == packed_.size(), "checkpoint: recomputing the region for ", node,
                " kept ", kept_.size(), " tensors for backward where its forward kept ",
                packed_.size(), rule);
  for (size_t i = 0; i < packed_.size(); ++i) {
    const Packed& p = packed_[i];
    if (released_[i]) continue;
    const Tensor& k = kept_[i];
    TESSERA_CHECK(k.shape() == p.shape && k.dtype() == p.dtype,
                  "checkpoint: recomputing the region for ", node, ", tensor ", i,
                  " kept for backward is ", dtype_name(k.dtype()), " ", shape_str(k.shape()),
                  " where the forward kept ", dtype_name(p.dtype), " ", shape_str(p.shape), rule);
    // The same storage as in the forward (a parameter, the region's input): it must hold what
    // the forward read, as a saved tensor must without checkpointing.
    const auto s = p.storage.lock();
    TESSERA_CHECK(!(s && s.get() == k.storage().impl()) || kept_versions_[i] == p.version,
                  "checkpoint: ", node, ": one of the tensors needed for gradient computation (",
                  dtype_name(k.dtype()), " ", shape_str(k.shape()),
                  ", saved in a checkpointed region) has been modified by an in-place operation "
                  "since the forward: version ",
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
  TESSERA_CHECK(!autograd::in_checkpoint_region(),
                "checkpoint: regions do not nest (this one starts inside another's forward); "
                "checkpoint either the inner or the outer one");
  // Inside a recomputation the region runs as in its forward, keeping into the outer frame;
  // without grad mode nothing is kept.
  if (autograd::in_checkpoint_recompute() || !grad_enabled()) return fn(x);
  auto frame = std::make_shared<CheckpointFrame>([fn, x] { (void)fn(x); });
  CheckpointFrame::Forward scope(*frame);
  return fn(x);
}

}  // namespace tessera
