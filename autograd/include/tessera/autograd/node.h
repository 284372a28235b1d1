#pragma once
// A node of the backward graph. Each differentiable output points at the node that produced it
// (grad_fn); each node points at the nodes of its inputs (next edges).
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::autograd {

class Node;

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

  const std::vector<Edge>& next_edges() const { return next_edges_; }
  void set_next_edges(std::vector<Edge> edges) { next_edges_ = std::move(edges); }
  uint32_t num_outputs() const { return num_outputs_; }
  void set_num_outputs(uint32_t n) { num_outputs_ = n; }
  // Creation order; the engine runs later nodes first among those ready.
  uint64_t sequence_nr() const { return sequence_nr_; }

  // Hooks on the gradient arriving for forward output `output_nr` (tensor hooks on non-leaves).
  using GradHook = std::function<Tensor(const Tensor&)>;
  void add_pre_hook(uint32_t output_nr, GradHook hook);
  std::vector<Tensor> run_pre_hooks(std::vector<Tensor>&& grads);

 private:
  std::vector<Edge> next_edges_;
  uint32_t num_outputs_ = 1;
  uint64_t sequence_nr_;
  std::multimap<uint32_t, GradHook> pre_hooks_;
};

// Accumulates incoming gradients into a leaf's .grad, running its hooks around that.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(Tensor leaf);
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) override;
  std::string name() const override { return "AccumulateGrad"; }
  const Tensor& leaf() const { return leaf_; }

 private:
  Tensor leaf_;
};

// The edge a gradient for `t` must flow into: its grad_fn, or its leaf accumulator, or none.
Edge gradient_edge(const Tensor& t);

}  // namespace tessera::autograd
