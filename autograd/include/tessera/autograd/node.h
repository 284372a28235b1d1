#pragma once
// A node of the backward graph. Each differentiable output points at the node that produced it
// (grad_fn); each node points at the nodes of its inputs (next edges).
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/autograd/deferred_reduction.h"
#include "tessera/core/tensor.h"

namespace tessera::autograd {

class Node;

// What a gradient for one of a node's forward outputs must be, as PyTorch's InputMetadata: the
// engine checks each gradient a node returns against what the next node takes. `shape` points
// into the node (valid while it lives); null where the node takes any gradient.
struct GradientMeta {
  const Shape* shape = nullptr;
  DType dtype = DType::Float32;
  Device device;
  bool known() const { return shape != nullptr; }
};

struct Edge {
  std::shared_ptr<Node> function;
  uint32_t input_nr = 0;  // which of function's forward outputs this edge feeds
  bool valid() const { return function != nullptr; }
};

class Node : public std::enable_shared_from_this<Node> {
 public:
  Node();
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // Gradients w.r.t. this node's forward outputs (undefined = no gradient) in, gradients for
  // each next edge out.
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) = 0;
  virtual std::string name() const = 0;
  // Drops tensors kept for backward; called once the node has run unless retain_graph.
  virtual void release_saved_tensors() {}
  // What the gradient of forward output `output_nr` must be; unknown by default.
  virtual GradientMeta gradient_meta(uint32_t /*output_nr*/) const { return {}; }

  const std::vector<Edge>& next_edges() const { return next_edges_; }
  void set_next_edges(std::vector<Edge> edges) { next_edges_ = std::move(edges); }
  uint32_t num_outputs() const { return num_outputs_; }
  void set_num_outputs(uint32_t n) { num_outputs_ = n; }
  // Creation order; the engine runs later nodes first among those ready.
  uint64_t sequence_nr() const { return sequence_nr_; }

  // Hooks on the gradient arriving for forward output `output_nr` (tensor hooks on non-leaves).
  using GradHook = std::function<Tensor(const Tensor&)>;
  // Runs `hook` on the gradient of output `output_nr` before apply(), after the hooks added
  // before it (or before them, with `prepend`).
  void add_pre_hook(uint32_t output_nr, GradHook hook, bool prepend = false);
  // retain_grad's hook: runs after all the others of its output, prepended ones included, so
  // that .grad holds the gradient as the hooks left it (PyTorch's order).
  void set_retain_hook(uint32_t output_nr, GradHook hook);
  std::vector<Tensor> run_pre_hooks(std::vector<Tensor>&& grads);
  // Whether any hook (retain_grad's included) sees that output's gradient.
  bool has_pre_hooks(uint32_t output_nr) const {
    return pre_hooks_.count(output_nr) != 0 || retain_hooks_.count(output_nr) != 0;
  }

  // Whether this node's backward can take the gradient of forward output `output_nr` as this
  // rank's unreduced term of `reduction` and finish the reduction itself more cheaply (an
  // all-gather's backward reduce-scatters the terms rather than all-reduce them and keep a
  // chunk). The engine then passes the term unreduced, with the reduction in
  // incoming_reduction(output_nr) while the node runs (deferred_reduction.h).
  virtual bool takes_partial_gradient(uint32_t /*output_nr*/,
                                      const GradientReduction& /*reduction*/) const {
    return false;
  }
  GradientReductionPtr incoming_reduction(uint32_t output_nr) const;
  void set_incoming_reductions(std::map<uint32_t, GradientReductionPtr> reductions) {
    incoming_ = std::move(reductions);
  }

 private:
  std::vector<Edge> next_edges_;
  uint32_t num_outputs_ = 1;
  uint64_t sequence_nr_;
  std::multimap<uint32_t, GradHook> pre_hooks_;
  std::map<uint32_t, GradHook> retain_hooks_;
  std::map<uint32_t, GradientReductionPtr> incoming_;
};

// Accumulates incoming gradients into a leaf's .grad, running its hooks around that.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(Tensor leaf);
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) override;
  std::string name() const override { return "AccumulateGrad"; }
  // The leaf's, read when asked: its gradient has the leaf's shape, dtype and device.
  GradientMeta gradient_meta(uint32_t output_nr) const override;
  const Tensor& leaf() const { return leaf_; }
  // The leaf's gradient hooks over `g`, each given the previous one's result; apply() runs them
  // before accumulating, autograd::grad before taking the gradient instead.
  Tensor run_leaf_hooks(Tensor g);

 private:
  Tensor leaf_;
};

// The edge a gradient for `t` must flow into: its grad_fn, or its leaf accumulator, or none.
Edge gradient_edge(const Tensor& t);

}  // namespace tessera::autograd
