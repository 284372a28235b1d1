#include "tessera/autograd/engine.h"

#include <atomic>
#include <map>
#include <optional>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "tessera/autograd/deferred_reduction.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/node.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"

namespace tessera {

namespace {

struct GraphTask {
  std::vector<std::function<void()>> callbacks;
  uint64_t id = 0;
  // The node being applied, and the gradients it returned unreduced (by tensor impl); cleared
  // after each node.
  const autograd::Node* running = nullptr;
  std::unordered_map<const void*, autograd::GradientReductionPtr> deferred;
};
thread_local GraphTask* t_task = nullptr;

struct ByLatest {
  bool operator()(const std::shared_ptr<autograd::Node>& a,
                  const std::shared_ptr<autograd::Node>& b) const {
    return a->sequence_nr() < b->sequence_nr();
  }
};

// The gradient collected for one forward output of a node: a full value, or (pending set) this
// rank's term of a reduction not yet done, possibly already started.
struct Slot {
  Tensor value;
  autograd::GradientReductionPtr pending;
  std::function<Tensor()> started;

  // Moves the value out: the slot must hold no reference of its own to a gradient it hands on,
  // or AccumulateGrad could never take that buffer as the leaf's .grad without a copy.
  Tensor reduced() {
    if (!pending) return std::move(value);
    Tensor out = started ? started() : pending->start(value)();
    pending = nullptr;
    started = nullptr;
    return out;
  }
};

void accumulate(std::vector<Slot>& buf, uint32_t nr, uint32_t size, Tensor g,
                autograd::GradientReductionPtr pending) {
  if (buf.size() < size) buf.resize(size);
  Slot& s = buf[nr];
  if (!s.value.defined()) {
    s.value = std::move(g);
    s.pending = std::move(pending);
    return;
  }
  if (s.pending && pending && s.pending->same_as(*pending)) {
    s.value = kernels::binary(kernels::BinaryOp::Add, s.value, g);
    return;
  }
  // A term meets a full gradient (or a term of another reduction): reduce, then add.
  const Tensor full = pending ? pending->start(g)() : g;
  s.value = kernels::binary(kernels::BinaryOp::Add, s.reduced(), full);
}

// Whether `node` takes slot `nr`'s terms unreduced (Node::takes_partial_gradient); never when a
// hook would see the gradient.
bool passes_terms(const autograd::Node& node, uint32_t nr, const Slot& s) {
  return s.pending && !s.started && !node.has_pre_hooks(nr) &&
         node.takes_partial_gradient(nr, *s.pending);
}

// Starts the reductions of a node that has all its gradients, so that they progress while other
// ready nodes run.
void start_reductions(const autograd::Node& node, std::vector<Slot>& buf) {
  for (uint32_t i = 0; i < buf.size(); ++i) {
    Slot& s = buf[i];
    if (s.pending && !s.started && !passes_terms(node, i, s)) s.started = s.pending->start(s.value);
  }
}

using autograd::Edge;
using autograd::Node;
using Buffers = std::unordered_map<Node*, std::vector<Slot>>;

// What grad() asks of a run: which nodes' gradients to take, and which nodes to apply (those
// from which a taken gradient can be reached); nothing else runs, so no leaf accumulates.
struct Captures {
  // node -> (its forward output, index into `values`)
  std::unordered_map<const Node*, std::vector<std::pair<uint32_t, size_t>>> at;
  std::unordered_set<const Node*> runs;
  std::vector<Tensor> values;
  bool wants(const Node* node) const { return runs.count(node) || at.count(node); }
  bool taken(const Node* node, uint32_t nr) const {
    auto it = at.find(node);
    if (it == at.end()) return false;
    for (const auto& [n, i] : it->second)
      if (n == nr) return true;
    return false;
  }
};

// Puts each output's starting gradient into its node's slot; returns the nodes, in order.
std::vector<std::shared_ptr<Node>> seed(const std::vector<Tensor>& outputs,
                                        const std::vector<Tensor>& grad_outputs, Buffers& buffers,
                                        const char* op) {
  TESSERA_CHECK(grad_outputs.empty() || grad_outputs.size() == outputs.size(), op, ": ",
                grad_outputs.size(), " gradients given for ", outputs.size(), " outputs");
  TESSERA_CHECK(t_task == nullptr, op, ": called re-entrantly from inside a backward pass");
  std::vector<std::shared_ptr<Node>> roots;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& out = outputs[i];
    Edge e = autograd::gradient_edge(out);
    TESSERA_CHECK(e.valid(), op, ": output ", i, " (", out.str(),
                  ") does not require grad and has no grad_fn");
    Tensor g;
    if (grad_outputs.empty() || !grad_outputs[i].defined()) {
      TESSERA_CHECK(out.numel() == 1, op, ": output ", i, " has shape ", shape_str(out.shape()),
                    "; a gradient is needed for non-scalar outputs");
      g = ones_like(out);
    } else {
      g = grad_outputs[i];
      TESSERA_CHECK(g.shape() == out.shape(), op, ": gradient shape ", shape_str(g.shape()),
                    " does not match output shape ", shape_str(out.shape()));
      TESSERA_CHECK(g.device() == out.device(), op, ": gradient ", g.str(), " for output ", i, " (",
                    out.str(), ") is on another device");
      // As PyTorch's engine, a gradient of another dtype is cast to the output's: every node
      // computes in the dtypes of its forward (a float64 gradient met a float32 matmul's saved
      // operands and failed inside the backward).
      if (g.dtype() != out.dtype()) g = g.to(out.dtype());
    }
    accumulate(buffers[e.function.get()], e.input_nr, e.function->num_outputs(), std::move(g),
               nullptr);
    roots.push_back(e.function);
  }
  return roots;
}

// How many edges point at each node from the part of the graph the roots reach; `order`, when
// given, gets those nodes in an order where every node comes before the nodes its edges reach.
std::unordered_map<Node*, int> count_dependencies(const std::vector<std::shared_ptr<Node>>& roots,
                                                  std::vector<Node*>* order) {
  std::unordered_map<Node*, int> deps;
  std::vector<Node*> stack;
  std::unordered_set<Node*> seen;
  for (auto& r : roots)
    if (seen.insert(r.get()).second) stack.push_back(r.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges()) {
      if (!e.valid()) continue;
      ++deps[e.function.get()];
      if (seen.insert(e.function.get()).second) stack.push_back(e.function.get());
    }
  }
  if (order) {
    std::unordered_map<Node*, int> left = deps;
    for (Node* n : seen)
      if (left[n] == 0) stack.push_back(n);
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      order->push_back(n);
      for (const Edge& e : n->next_edges())
        if (e.valid() && --left[e.function.get()] == 0) stack.push_back(e.function.get());
    }
  }
  return deps;
}

// Marks the nodes to apply besides those already marked (backward's leaf accumulators): those
// with an edge to a node whose gradient is taken or that is applied itself (walked against
// `order`, so successors are decided first).
void mark_runs(const std::vector<Node*>& order, Captures& captures) {
  std::unordered_set<const Node*> leads;  // taken from, or applied
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    Node* n = *it;
    bool runs = false;
    for (const Edge& e : n->next_edges())
      if (e.valid() && leads.count(e.function.get())) runs = true;
    if (runs) captures.runs.insert(n);
    if (captures.wants(n)) leads.insert(n);
  }
}

// The gradients `node` receives, from its slots: reduced, unless the node takes a slot's terms
// unreduced (into `terms`) and grad() takes nothing there.
std::vector<Tensor> gather_inputs(Node& node, std::vector<Slot>& slots, const Captures* captures,
                                  std::map<uint32_t, autograd::GradientReductionPtr>& terms) {
  std::vector<Tensor> grads(node.num_outputs());
  for (uint32_t i = 0; i < slots.size() && i < grads.size(); ++i) {
    if (passes_terms(node, i, slots[i]) && !(captures && captures->taken(&node, i))) {
      terms[i] = slots[i].pending;
      grads[i] = slots[i].value;
    } else {
      grads[i] = slots[i].reduced();
    }
  }
  return grads;
}

// Takes grad()'s gradients at `node`, after the hooks a backward would run there (a leaf's
// hooks, which its accumulator runs otherwise, included), as PyTorch's engine does.
void take(Node& node, std::vector<Tensor>& grads, Captures& captures) {
  auto it = captures.at.find(&node);
  if (it == captures.at.end()) return;
  if (auto* acc = dynamic_cast<autograd::AccumulateGrad*>(&node); acc && !grads.empty())
    grads[0] = acc->run_leaf_hooks(std::move(grads[0]));
  for (const auto& [nr, index] : it->second)
    if (nr < grads.size()) captures.values[index] = grads[nr];
}

// Runs the graph below `roots` (every node, or with `captures` only the nodes it marks),
// then the callbacks queued meanwhile.
void run_graph(const std::vector<std::shared_ptr<Node>>& roots, Buffers& buffers,
               std::unordered_map<Node*, int>& deps, bool retain_graph, Captures* captures) {
  GraphTask task;
  static std::atomic<uint64_t> next_id{1};
  task.id = next_id++;
  t_task = &task;
  struct Reset {
    ~Reset() { t_task = nullptr; }
  } reset;

  // Backward formulas and hooks record no history (PyTorch's engine without create_graph): a
  // hook computing with a tensor that requires grad would otherwise build a graph nobody runs.
  std::optional<NoGradGuard> no_grad(std::in_place);
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, ByLatest> ready;
  {
    std::unordered_set<Node*> queued;
    for (auto& r : roots)
      if (deps[r.get()] == 0 && (!captures || captures->wants(r.get())) &&
          queued.insert(r.get()).second)
        ready.push(r);
  }
  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top();
    ready.pop();
    std::vector<Slot> slots = std::move(buffers[node.get()]);
    buffers.erase(node.get());
    const bool runs = !captures || captures->runs.count(node.get());
    std::map<uint32_t, autograd::GradientReductionPtr> terms;
    std::vector<Tensor> grads = gather_inputs(*node, slots, captures, terms);
    grads = node->run_pre_hooks(std::move(grads));
    if (captures) take(*node, grads, *captures);
    // A node grad() takes from but does not apply passes nothing on: the nodes its edges reach
    // lead to no gradient it takes.
    if (!runs) continue;
    std::vector<Tensor> input_grads;
    {
      node->set_incoming_reductions(std::move(terms));
      struct Clear {  // also when apply throws: a retained graph may run the node again
        Node& n;
        ~Clear() { n.set_incoming_reductions({}); }
      } clear{*node};
      task.running = node.get();
      input_grads = node->apply(std::move(grads));
      task.running = nullptr;
    }
    if (!retain_graph) node->release_saved_tensors();
    const auto& edges = node->next_edges();
    for (size_t j = 0; j < edges.size(); ++j) {
      const Edge& e = edges[j];
      if (!e.valid()) continue;
      if (j < input_grads.size() && input_grads[j].defined()) {
        auto d = task.deferred.find(input_grads[j].impl());
        accumulate(buffers[e.function.get()], e.input_nr, e.function->num_outputs(),
                   std::move(input_grads[j]), d == task.deferred.end() ? nullptr : d->second);
      }
      // A node grad() neither applies nor takes from is left alone: its reductions (collectives)
      // are never started, as none would be waited on.
      if (--deps[e.function.get()] == 0 && (!captures || captures->wants(e.function.get()))) {
        start_reductions(*e.function, buffers[e.function.get()]);
        ready.push(e.function);
      }
    }
    task.deferred.clear();
  }
  no_grad.reset();
  // Callbacks may queue further callbacks; run until none are left.
  for (size_t i = 0; i < task.callbacks.size(); ++i) {
    auto cb = std::move(task.callbacks[i]);
    cb();
  }
}

// A non-leaf's .grad gains `g` (retain_grad, backward(inputs)): a copy the first time, since `g`
// may be shared with the graph, a sum after.
void add_to_grad(AutogradMeta& meta, const Tensor& g) {
  meta.grad =
      meta.grad.defined() ? kernels::binary(kernels::BinaryOp::Add, meta.grad, g) : g.clone();
}

// Where each input's gradient arrives, refusing an input that cannot have one.
std::vector<Edge> input_edges(const std::vector<Tensor>& inputs, const char* op) {
  std::vector<Edge> at(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    TESSERA_CHECK(inputs[i].defined(), op, ": input ", i, " is undefined");
    TESSERA_CHECK(inputs[i].requires_grad(), op, ": input ", i, " (", inputs[i].str(),
                  ") does not require grad");
    at[i] = autograd::gradient_edge(inputs[i]);
  }
  return at;
}

// backward(inputs): leaves accumulate as in any backward; a non-leaf input's gradient is taken
// and accumulated into its .grad afterwards, as retain_grad would (which, if set, already does).
void backward_into(const std::vector<Tensor>& outputs, const std::vector<Tensor>& grad_outputs,
                   bool retain_graph, const std::vector<Tensor>& inputs) {
  const std::vector<Edge> at = input_edges(inputs, "backward");
  Captures captures;
  captures.values.resize(inputs.size());
  std::vector<size_t> non_leaves;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].is_leaf()) {
      captures.runs.insert(at[i].function.get());
      continue;
    }
    bool repeated = false;
    for (size_t j : non_leaves)
      repeated = repeated || inputs[j].is_same(inputs[i]);
    if (repeated) continue;
    non_leaves.push_back(i);
    captures.at[at[i].function.get()].push_back({at[i].input_nr, i});
  }
  Buffers buffers;
  std::vector<std::shared_ptr<Node>> roots = seed(outputs, grad_outputs, buffers, "backward");
  std::vector<Node*> order;
  std::unordered_map<Node*, int> deps = count_dependencies(roots, &order);
  mark_runs(order, captures);
  run_graph(roots, buffers, deps, retain_graph, &captures);
  for (size_t i : non_leaves) {
    const Tensor& g = captures.values[i];
    AutogradMeta& meta = const_cast<Tensor&>(inputs[i]).autograd_meta();
    if (!g.defined() || meta.retains_grad) continue;
    add_to_grad(meta, g);
  }
}

}  // namespace

void backward(const std::vector<Tensor>& outputs, const std::vector<Tensor>& grad_outputs,
              bool retain_graph, const std::vector<Tensor>& inputs) {
  if (!inputs.empty()) return backward_into(outputs, grad_outputs, retain_graph, inputs);
  Buffers buffers;
  std::vector<std::shared_ptr<Node>> roots = seed(outputs, grad_outputs, buffers, "backward");
  std::unordered_map<Node*, int> deps = count_dependencies(roots, nullptr);
  run_graph(roots, buffers, deps, retain_graph, nullptr);
}

namespace autograd {

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs, bool retain_graph,
                         bool allow_unused) {
  TESSERA_CHECK(!inputs.empty(), "grad: no inputs given");
  Captures captures;
  captures.values.resize(inputs.size());
  // The inputs' nodes first, so that a bad input fails before any gradient is seeded.
  const std::vector<Edge> at = input_edges(inputs, "grad");
  Buffers buffers;
  std::vector<std::shared_ptr<Node>> roots = seed(outputs, grad_outputs, buffers, "grad");
  std::vector<Node*> order;
  std::unordered_map<Node*, int> deps = count_dependencies(roots, &order);
  const std::unordered_set<Node*> reached(order.begin(), order.end());
  for (size_t i = 0; i < inputs.size(); ++i) {
    // Checked before anything runs, so that the graph survives the error.
    TESSERA_CHECK(allow_unused || reached.count(at[i].function.get()), "grad: input ", i, " (",
                  inputs[i].str(),
                  ") is not used in the graph of the outputs; pass allow_unused = true to get an "
                  "undefined gradient for it");
    captures.at[at[i].function.get()].push_back({at[i].input_nr, i});
  }
  mark_runs(order, captures);
  run_graph(roots, buffers, deps, retain_graph, &captures);
  for (size_t i = 0; i < inputs.size(); ++i)
    TESSERA_CHECK(allow_unused || captures.values[i].defined(), "grad: input ", i, " (",
                  inputs[i].str(),
                  ") received no gradient (the nodes between it and the outputs passed none); "
                  "pass allow_unused = true to get an undefined gradient for it");
  return std::move(captures.values);
}

}  // namespace autograd

void register_hook(const Tensor& t, std::function<Tensor(const Tensor&)> hook, bool prepend) {
  TESSERA_CHECK(t.requires_grad(), "register_hook on ", t.str(), " which does not require grad");
  if (t.grad_fn()) {
    t.grad_fn()->add_pre_hook(t.output_nr(), std::move(hook), prepend);
  } else {
    auto& hooks = const_cast<Tensor&>(t).autograd_meta().grad_hooks;
    hooks.insert(prepend ? hooks.begin() : hooks.end(), std::move(hook));
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
  t.grad_fn()->set_retain_hook(t.output_nr(), [weak](const Tensor& g) {
    if (auto m = weak.lock()) add_to_grad(*m, g);
    return Tensor();
  });
}

namespace autograd {
Tensor reduce_later(const Node& node, Tensor term, GradientReductionPtr reduction) {
  if (!term.defined()) return term;  // no gradient: nothing to reduce
  TESSERA_CHECK(reduction != nullptr, "reduce_later: no reduction given for ", term.str());
  if (t_task == nullptr || t_task->running != &node) return reduction->start(std::move(term))();
  t_task->deferred[term.impl()] = std::move(reduction);
  return term;
}

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
