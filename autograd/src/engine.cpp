#include "tessera/autograd/engine.h"

#include <atomic>
#include <queue>
#include <unordered_map>

#include "tessera/autograd/node.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"

namespace tessera {

namespace {

struct GraphTask {
  std::vector<std::function<void()>> callbacks;
  uint64_t id = 0;
};
thread_local GraphTask* t_task = nullptr;

struct ByLatest {
  bool operator()(const std::shared_ptr<autograd::Node>& a,
                  const std::shared_ptr<autograd::Node>& b) const {
    return a->sequence_nr() < b->sequence_nr();
  }
};

void accumulate(std::vector<Tensor>& buf, uint32_t nr, uint32_t size, const Tensor& g) {
  if (buf.size() < size) buf.resize(size);
  if (!buf[nr].defined()) {
    buf[nr] = g;
  } else {
    buf[nr] = kernels::binary(kernels::BinaryOp::Add, buf[nr], g);
  }
}

}  // namespace

void backward(const std::vector<Tensor>& outputs, const std::vector<Tensor>& grad_outputs,
              bool retain_graph) {
  using autograd::Edge;
  using autograd::Node;
  TESSERA_CHECK(grad_outputs.empty() || grad_outputs.size() == outputs.size(),
                "backward: ", grad_outputs.size(), " gradients given for ", outputs.size(),
                " outputs");
  TESSERA_CHECK(t_task == nullptr, "backward: called re-entrantly from inside a backward pass");

  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  std::vector<std::shared_ptr<Node>> roots;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& out = outputs[i];
    Edge e = autograd::gradient_edge(out);
    TESSERA_CHECK(e.valid(), "backward: output ", i, " (", out.str(),
                  ") does not require grad and has no grad_fn");
    Tensor g;
    if (grad_outputs.empty() || !grad_outputs[i].defined()) {
      TESSERA_CHECK(out.numel() == 1, "backward: output ", i, " has shape ", shape_str(out.shape()),
                    "; a gradient is needed for non-scalar outputs");
      g = ones_like(out);
    } else {
      g = grad_outputs[i];
      TESSERA_CHECK(g.shape() == out.shape(), "backward: gradient shape ", shape_str(g.shape()),
                    " does not match output shape ", shape_str(out.shape()));
    }
    accumulate(buffers[e.function.get()], e.input_nr, e.function->num_outputs(), g);
    roots.push_back(e.function);
  }

  // Dependencies: how many edges point at each node from the part of the graph we reach.
  std::unordered_map<Node*, int> deps;
  {
    std::vector<Node*> stack;
    std::unordered_map<Node*, bool> seen;
    for (auto& r : roots)
      if (!seen[r.get()]) {
        seen[r.get()] = true;
        stack.push_back(r.get());
      }
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (const Edge& e : n->next_edges()) {
        if (!e.valid()) continue;
        ++deps[e.function.get()];
        if (!seen[e.function.get()]) {
          seen[e.function.get()] = true;
          stack.push_back(e.function.get());
        }
      }
    }
  }

  GraphTask task;
  static std::atomic<uint64_t> next_id{1};
  task.id = next_id++;
  t_task = &task;
  struct Reset {
    ~Reset() { t_task = nullptr; }
  } reset;

  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, ByLatest> ready;
  {
    std::unordered_map<Node*, bool> queued;
    for (auto& r : roots)
      if (deps[r.get()] == 0 && !queued[r.get()]) {
        queued[r.get()] = true;
        ready.push(r);
      }
  }
  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top();
    ready.pop();
    std::vector<Tensor> grads = std::move(buffers[node.get()]);
    buffers.erase(node.get());
    grads.resize(node->num_outputs());
    grads = node->run_pre_hooks(std::move(grads));
    std::vector<Tensor> input_grads = node->apply(std::move(grads));
    if (!retain_graph) node->release_saved_tensors();
    const auto& edges = node->next_edges();
    for (size_t j = 0; j < edges.size(); ++j) {
      const Edge& e = edges[j];
      if (!e.valid()) continue;
      if (j < input_grads.size() && input_grads[j].defined())
        accumulate(buffers[e.function.get()], e.input_nr, e.function->num_outputs(),
                   input_grads[j]);
      if (--deps[e.function.get()] == 0) ready.push(e.function);
    }
  }
  // Callbacks may queue further callbacks; run until none are left.
  for (size_t i = 0; i < task.callbacks.size(); ++i) {
    auto cb = std::move(task.callbacks[i]);
    cb();
  }
}

void register_hook(const Tensor& t, std::function<Tensor(const Tensor&)> hook) {
  TESSERA_CHECK(t.requires_grad(), "register_hook on ", t.str(), " which does not require grad");
  if (t.grad_fn()) {
    t.grad_fn()->add_pre_hook(t.output_nr(), std::move(hook));
  } else {
    const_cast<Tensor&>(t).autograd_meta().grad_hooks.push_back(std::move(hook));
  }
}

void register_post_accumulate_grad_hook(const Tensor& leaf, std::function<void(Tensor&)> hook) {
  TESSERA_CHECK(leaf.is_leaf() && leaf.requires_grad(), "register_post_accumulate_grad_hook on ",
                leaf.str(), ": needs a leaf that requires grad");
  const_cast<Tensor&>(leaf).autograd_meta().post_accumulate_grad_hooks.push_back(std::move(hook));
}

void retain_grad(const Tensor& t) {
  TESSERA_CHECK(t.requires_grad(), "retain_grad on ", t.str(), " which does not require grad");
  if (t.is_leaf()) return;
  AutogradMeta& meta = const_cast<Tensor&>(t).autograd_meta();
  if (meta.retains_grad) return;
  meta.retains_grad = true;
  std::weak_ptr<AutogradMeta> weak = t.impl()->autograd;
  t.grad_fn()->add_pre_hook(t.output_nr(), [weak](const Tensor& g) {
    if (auto m = weak.lock()) {
      m->grad = m->grad.defined() ? kernels::binary(kernels::BinaryOp::Add, m->grad, g) : g.clone();
    }
    return Tensor();
  });
}

namespace autograd {
void queue_callback(std::function<void()> cb) {
  TESSERA_CHECK(t_task != nullptr, "queue_callback outside a backward pass");
  t_task->callbacks.push_back(std::move(cb));
}
bool in_backward() {
  return t_task != nullptr;
}
uint64_t backward_id() {
  return t_task != nullptr ? t_task->id : 0;
}
}  // namespace autograd

}  // namespace tessera
