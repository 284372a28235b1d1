// A backend for device tensors that moves them through host memory over a CPU group: each call
// copies its device inputs to host tensors, runs the CPU group's operation on them, and copies
// the device outputs back when the work completes. Tensors already on the CPU pass through
// untouched. What it costs is two copies over the host link per call; what it buys is that any
// number of ranks can share one GPU (NCCL refuses two ranks on one device). The host buffers are
// pinned where something can pin (pinned_allocator(): a CUDA build with a GPU), so that both
// copies run at the link's full speed; they come from a caching pool, reused call after call.
#include "checked_process_group.h"
#include "tessera/comm/backend.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/allocator.h"
#include "tessera/core/factory.h"
#include "then_work.h"

namespace tessera {

namespace {

bool on_host(const Tensor& t) {
  return !t.defined() || t.device().is_cpu();
}

// A host buffer for `t`'s elements: pinned where something can pin.
Tensor host_buffer(const Tensor& t) {
  return empty(t.shape(), TensorOptions(t.dtype()).pin_memory(pinned_allocator() != nullptr));
}

// Host stand-ins of one call's device tensors, and the copies back to the device that complete it.
struct Staging {
  std::vector<Tensor> keep;  // host tensors the CPU group may still read or write
  std::vector<std::pair<Tensor, Tensor>> outputs;  // (device tensor, its host stand-in)

  // A host copy of `t` for the CPU group to read (and, for in-place operations, write).
  Tensor in(const Tensor& t) {
    if (on_host(t)) return t;
    Tensor h = host_buffer(t);
    h.copy_(t);
    keep.push_back(h);
    return h;
  }
  // `in` that is copied back to `t` when the work completes.
  Tensor inout(Tensor& t) {
    Tensor h = in(t);
    if (!on_host(t)) outputs.emplace_back(t, h);
    return h;
  }
  // A host tensor the CPU group overwrites whole, copied back to `t`.
  Tensor out(Tensor& t) {
    if (on_host(t)) return t;
    Tensor h = host_buffer(t);
    keep.push_back(h);
    outputs.emplace_back(t, h);
    return h;
  }
  std::vector<Tensor> in(const std::vector<Tensor>& ts) {
    std::vector<Tensor> hs;
    for (const Tensor& t : ts)
      hs.push_back(in(t));
    return hs;
  }
  std::vector<Tensor> out(std::vector<Tensor>& ts) {
    std::vector<Tensor> hs;
    for (Tensor& t : ts)
      hs.push_back(out(t));
    return hs;
  }
};

class StagedProcessGroup final : public ProcessGroup {
 public:
  explicit StagedProcessGroup(ProcessGroupPtr host)
      : ProcessGroup(host->rank(), host->size(), host->world_ranks(), host->name()),
        host_(std::move(host)) {}

  WorkPtr all_reduce(Tensor& t, ReduceOp op) override {
    Staging s;
    Tensor h = s.inout(t);
    WorkPtr w = host_->all_reduce(h, op);
    return staged(std::move(w), std::move(s));
  }
  WorkPtr all_gather_into_tensor(Tensor& out, const Tensor& in) override {
    Staging s;
    Tensor ho = s.out(out);
    WorkPtr w = host_->all_gather_into_tensor(ho, s.in(in));
    return staged(std::move(w), std::move(s));
  }
  WorkPtr all_gather(std::vector<Tensor>& outputs, const Tensor& in) override {
    Staging s;
    std::vector<Tensor> ho = s.out(outputs);
    WorkPtr w = host_->all_gather(ho, s.in(in));
    return staged(std::move(w), std::move(s));
  }
  // `out` keeps what no run writes (FSDP's padding), so it goes to the host and back whole.
  WorkPtr all_gather_runs(Tensor& out, const Tensor& in,
                          const std::vector<std::vector<GatherRun>>& runs) override {
    Staging s;
    Tensor ho = s.inout(out);
    WorkPtr w = host_->all_gather_runs(ho, s.in(in), runs);
    return staged(std::move(w), std::move(s));
  }
  WorkPtr reduce_scatter_tensor(Tensor& out, const Tensor& in, ReduceOp op) override {
    Staging s;
    Tensor ho = s.out(out);
    WorkPtr w = host_->reduce_scatter_tensor(ho, s.in(in), op);
    return staged(std::move(w), std::move(s));
  }
  WorkPtr reduce_scatter(Tensor& out, const std::vector<Tensor>& inputs, ReduceOp op) override {
    Staging s;
    Tensor ho = s.out(out);
    WorkPtr w = host_->reduce_scatter(ho, s.in(inputs), op);
    return staged(std::move(w), std::move(s));
  }
  WorkPtr all_to_all(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs) override {
    Staging s;
    std::vector<Tensor> ho = s.out(outputs);
    WorkPtr w = host_->all_to_all(ho, s.in(inputs));
    return staged(std::move(w), std::move(s));
  }
  WorkPtr broadcast(Tensor& t, int root) override {
    Staging s;
    Tensor h = rank() == root ? s.in(t) : s.out(t);
    WorkPtr w = host_->broadcast(h, root);
    return staged(std::move(w), std::move(s));
  }
  WorkPtr scatter(Tensor& out, const std::vector<Tensor>& inputs, int root) override {
    Staging s;
    Tensor ho = s.out(out);
    WorkPtr w = host_->scatter(ho, s.in(inputs), root);
    return staged(std::move(w), std::move(s));
  }
  WorkPtr send(const Tensor& t, int dst, int tag) override {
    Staging s;
    WorkPtr w = host_->send(s.in(t), dst, tag);
    return staged(std::move(w), std::move(s));
  }
  WorkPtr recv(Tensor& t, int src, int tag) override {
    Staging s;
    Tensor h = s.out(t);
    WorkPtr w = host_->recv(h, src, tag);
    return staged(std::move(w), std::move(s));
  }
  WorkPtr barrier() override { return host_->barrier(); }
  ProcessGroupPtr split(int color, int key, const std::string& name) override {
    ProcessGroupPtr host = host_->split(color, key, name);
    return host ? std::make_shared<StagedProcessGroup>(std::move(host)) : nullptr;
  }

 private:
  // The CPU group's work, then the copies back to the device, run once by whichever of wait(),
  // is_completed() and dropping the work first sees the transfers done; the host tensors live
  // until then (ThenWork drops the step once it has run).
  static WorkPtr staged(WorkPtr inner, Staging s) {
    if (s.keep.empty()) return inner;  // every tensor was on the host
    return std::make_shared<detail::ThenWork>(std::move(inner), [s = std::move(s)]() mutable {
      for (auto& [device, host] : s.outputs)
        device.detach().copy_(host);
    });
  }

  ProcessGroupPtr host_;
};

}  // namespace

ProcessGroupPtr host_staged_group(ProcessGroupPtr host_group) {
  TESSERA_CHECK(host_group != nullptr, "host_staged_group: no CPU group given");
  return std::make_shared<StagedProcessGroup>(std::move(host_group));
}

BackendFactory host_staged_backend() {
  // world_group() checks the device world this makes, so staging goes over the CPU world's
  // backend group, not over its checked wrapper.
  return [] {
    const ProcessGroupPtr cpu = world_group();
    const auto checked = std::dynamic_pointer_cast<detail::CheckedProcessGroup>(cpu);
    return host_staged_group(checked ? checked->inner() : cpu);
  };
}

}  // namespace tessera
