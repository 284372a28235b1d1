#pragma once
// Gradients that stay partial until something needs them reduced.
//
// A node whose backward would end in a reduction across ranks (a sum over a mesh dim: the
// gradient of an input replicated there, used by an op whose output is split there) may hand its
// gradient back unreduced, as this rank's term, with the reduction still to do. The engine then
// adds the terms that arrive at one input with the same reduction locally, and reduces their sum
// once, just before the input's node runs; it starts that reduction as soon as the last term has
// arrived and waits for it only when the node is taken to run, so other ready nodes run
// meanwhile. Three projections that read one replicated activation (q, k and v) thus reduce its
// gradient once instead of three times, as Megatron does.
//
// Invariant: a slot's value is reduced before anything but the engine's addition sees it (hooks,
// a leaf's .grad, a node's backward), except a backward that asks for the terms
// (Node::takes_partial_gradient) and finishes the reduction itself. Partial terms are added only to
// partial terms of the same reduction; a term meeting a full gradient is reduced first. Ranks reach
// every reduction in the same order because the engine's order depends only on the graph, which is
// the same on every rank.
#include <functional>
#include <memory>
#include <string>

#include "tessera/core/tensor.h"

namespace tessera::autograd {

class Node;

class GradientReduction {
 public:
  virtual ~GradientReduction() = default;
  // Whether terms of this reduction and of `other` may be added before reducing once (the same
  // collective over the same ranks).
  virtual bool same_as(const GradientReduction& other) const = 0;
  // Starts reducing this rank's term (which the reduction may overwrite); the function returned
  // waits for it and gives the reduced gradient.
  virtual std::function<Tensor()> start(Tensor term) const = 0;
  virtual std::string str() const = 0;
};
using GradientReductionPtr = std::shared_ptr<const GradientReduction>;

// For the backward of `node`: returns `term` marked for the engine to reduce later when `node` is
// the node the engine is running, otherwise reduces it now. Only a gradient that `node`'s
// backward returns as it is may be marked.
Tensor reduce_later(const Node& node, Tensor term, GradientReductionPtr reduction);

}  // namespace tessera::autograd
