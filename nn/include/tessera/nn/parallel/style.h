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
  // Every check apply() makes, without changing anything: parallelize_module checks all its
  // targets before applying any style, so a refused plan leaves the model as it was. `path` is
  // the module's path in the model parallelize_module was given, for errors (those of the
  // forward too); applied to a module directly, errors name the module's type only.
  virtual void check(const Module& module, const DeviceMesh& mesh,
                     const std::string& path = "") const = 0;
  virtual void apply(Module& module, const DeviceMesh& mesh,
                     const std::string& path = "") const = 0;
  virtual std::string name() const = 0;
  // The name and the layouts it was given ("ColwiseParallel(input [R], output [S(-1)])"): what
  // the ranks compare before parallelize_module changes anything, since ranks given different
  // layouts would run different collectives in every forward.
  virtual std::string str() const { return name(); }
  // Whether it turns the module's own parameters into DTensors (and sets how its input and
  // output cross into DTensors: at most one such style per module).
  virtual bool distributes_parameters() const { return false; }
};
using ParallelStylePtr = std::shared_ptr<const ParallelStyle>;

// Linear: weight and bias Shard(0), so each rank computes a slice of the output features.
// Embedding: weight Shard(1) (each rank holds a slice of every vector).
struct ColwiseParallel : ParallelStyle {
  Placements input_layouts = {Replicate()};
  Placements output_layouts = {Shard(-1)};
  void check(const Module& module, const DeviceMesh& mesh,
             const std::string& path = "") const override;
  void apply(Module& module, const DeviceMesh& mesh, const std::string& path = "") const override;
  std::string name() const override { return "ColwiseParallel"; }
  std::string str() const override;
  bool distributes_parameters() const override { return true; }
};

// Linear: weight Shard(1), bias Replicate; the output is Partial and redistributed to
// output_layouts (Replicate = all-reduce, Shard(1) = reduce-scatter for sequence parallel).
// Embedding: weight Shard(0) (vocabulary parallel); the partial lookups are summed the same way.
struct RowwiseParallel : ParallelStyle {
  Placements input_layouts = {Shard(-1)};
  Placements output_layouts = {Replicate()};
  void check(const Module& module, const DeviceMesh& mesh,
             const std::string& path = "") const override;
  void apply(Module& module, const DeviceMesh& mesh, const std::string& path = "") const override;
  std::string name() const override { return "RowwiseParallel"; }
  std::string str() const override;
  bool distributes_parameters() const override { return true; }
};

// Norms over activations sharded on the sequence dim: weights Replicate (their gradients are
// summed over the ranks), input and output Shard(sequence_dim). A norm's sequence_dim may not be
// the dim it normalises over (the last): -1 is refused when parallelizing, and a dim that is the
// last of the input at the forward fails there, as does a dim the input does not have.
struct SequenceParallel : ParallelStyle {
  int64_t sequence_dim = 1;
  void check(const Module& module, const DeviceMesh& mesh,
             const std::string& path = "") const override;
  void apply(Module& module, const DeviceMesh& mesh, const std::string& path = "") const override;
  std::string name() const override { return "SequenceParallel"; }
  std::string str() const override;
  bool distributes_parameters() const override { return true; }
};

// Only changes how a module's input arrives (e.g. a block whose input is sequence-sharded but
// whose attention needs it whole). The desired layouts hold no StridedShard, and no Partial the
// input is not already in (the module would take one term of a sum for its input; PyTorch's
// redistribute refuses to make a Partial too): both refused when parallelizing. A desired Shard
// dim the input does not have fails at the forward.
struct PrepareModuleInput : ParallelStyle {
  Placements input_layouts;
  Placements desired_input_layouts;
  void check(const Module& module, const DeviceMesh& mesh,
             const std::string& path = "") const override;
  void apply(Module& module, const DeviceMesh& mesh, const std::string& path = "") const override;
  std::string name() const override { return "PrepareModuleInput"; }
  std::string str() const override;
};

// Only changes how a module's output leaves it: redistributed from output_layouts to
// desired_output_layouts by a forward hook (an embedding whose replicated output the next
// layers want sequence-sharded). The desired layouts are checked as PrepareModuleInput's.
struct PrepareModuleOutput : ParallelStyle {
  Placements output_layouts;
  Placements desired_output_layouts;
  void check(const Module& module, const DeviceMesh& mesh,
             const std::string& path = "") const override;
  void apply(Module& module, const DeviceMesh& mesh, const std::string& path = "") const override;
  std::string name() const override { return "PrepareModuleOutput"; }
  std::string str() const override;
};

}  // namespace tessera
