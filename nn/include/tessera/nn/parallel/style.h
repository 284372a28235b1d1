#pragma once
// Tensor-parallel styles (PyTorch's torch.distributed.tensor.parallel): each turns a module's
// parameters into DTensors on a 1-D mesh and says how its inputs and outputs cross into and out
// of DTensors. Layouts are per mesh dim (one entry on the 1-D TP mesh).
#include <memory>

#include "tessera/nn/module.h"

namespace tessera {

class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;
  virtual void apply(Module& module, const DeviceMesh& mesh) const = 0;
  virtual std::string name() const = 0;
};
using ParallelStylePtr = std::shared_ptr<const ParallelStyle>;

// Linear: weight and bias Shard(0), so each rank computes a slice of the output features.
// Embedding: weight Shard(1) (each rank holds a slice of every vector).
struct ColwiseParallel : ParallelStyle {
  Placements input_layouts = {Replicate()};
  Placements output_layouts = {Shard(-1)};
  void apply(Module& module, const DeviceMesh& mesh) const override;
  std::string name() const override { return "ColwiseParallel"; }
};

// Linear: weight Shard(1), bias Replicate; the output is Partial and redistributed to
// output_layouts (Replicate = all-reduce, Shard(1) = reduce-scatter for sequence parallel).
// Embedding: weight Shard(0) (vocabulary parallel); the partial lookups are summed the same way.
struct RowwiseParallel : ParallelStyle {
  Placements input_layouts = {Shard(-1)};
  Placements output_layouts = {Replicate()};
  void apply(Module& module, const DeviceMesh& mesh) const override;
  std::string name() const override { return "RowwiseParallel"; }
};

// Norms over activations sharded on the sequence dim: weights Replicate (their gradients are
// summed over the ranks), input and output Shard(sequence_dim).
struct SequenceParallel : ParallelStyle {
  int64_t sequence_dim = 1;
  void apply(Module& module, const DeviceMesh& mesh) const override;
  std::string name() const override { return "SequenceParallel"; }
};

// Only changes how a module's input arrives (e.g. a block whose input is sequence-sharded but
// whose attention needs it whole).
struct PrepareModuleInput : ParallelStyle {
  Placements input_layouts;
  Placements desired_input_layouts;
  void apply(Module& module, const DeviceMesh& mesh) const override;
  std::string name() const override { return "PrepareModuleInput"; }
};

// Only changes how a module's output leaves it: redistributed from output_layouts to
// desired_output_layouts by a forward hook (an embedding whose replicated output the next
// layers want sequence-sharded).
struct PrepareModuleOutput : ParallelStyle {
  Placements output_layouts;
  Placements desired_output_layouts;
  void apply(Module& module, const DeviceMesh& mesh) const override;
  std::string name() const override { return "PrepareModuleOutput"; }
};

}  // namespace tessera
