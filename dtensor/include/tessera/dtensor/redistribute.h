#pragma once
// Redistribution plans: a list of per-mesh-dim steps, each carried out by one transition family
// (redistribute/*.cpp) chosen from an ordered table.
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/dtensor/dtensor_spec.h"

namespace tessera {

struct RedistributeStep {
  int64_t mesh_dim;
  Placements before;  // all placements before the step
  Placements after;   // ... and after it (differ only at mesh_dim)
  const class Transition* transition = nullptr;
  std::string str() const;
};

struct RedistributePlan {
  std::vector<RedistributeStep> steps;
  // Bytes a rank sends over the plan, estimated for an even split (the same on every rank): the
  // cost by which plan_redistribute picks among candidate plans.
  int64_t bytes_moved = 0;
  std::string str() const;
};

// One transition family: which (from, to) changes on a mesh dim it handles and how. apply and
// backward run on this rank's local tensor; they may communicate over step's mesh-dim group.
class Transition {
 public:
  virtual ~Transition() = default;
  virtual const char* name() const = 0;
  virtual bool applies(const Placement& from, const Placement& to) const = 0;
  virtual Tensor apply(const Tensor& local, const DTensorSpec& before,
                       const RedistributeStep& step) const = 0;
  // Gradient w.r.t. the step's input given the gradient of its output, both in grad placements
  // (Partial -> Replicate) of `before` and `after`.
  virtual Tensor backward(const Tensor& grad, const DTensorSpec& before,
                          const RedistributeStep& step) const = 0;
  // Bytes a rank sends for the step, for an even split (summed into
  // RedistributePlan::bytes_moved; the same on every rank).
  virtual int64_t bytes_moved(const DTensorSpec& before, const RedistributeStep& step) const = 0;
};

// The ordered table (the policy); the first transition that applies wins.
const std::vector<const Transition*>& transition_table();

// The plan from src to dst placements: the ordered planner's, or a cheaper one by bytes_moved
// that a search over one-mesh-dim steps finds; cached per (mesh shape, global shape, dtype, src
// and dst placements); thread-safe. The cache keeps the 4096 most recently used plans.
std::shared_ptr<const RedistributePlan> plan_redistribute(const DTensorSpec& src,
                                                          const Placements& dst);
// Plans the cache holds now (for tests and memory accounting).
size_t redistribute_plan_cache_size();
// Drops every cached plan (PyTorch's _gen_transform_infos.cache_clear()), e.g. to free the
// memory of plans for shapes a program will not see again; the next redistribute of each key
// plans anew, the same steps. Plans already handed out stay valid. Not collective: the cache is
// per process and a plan is a function of its key alone, so ranks may clear at different times.
void clear_redistribute_plan_cache();

// Runs a plan on a local tensor without autograd (as the differentiable wrapper does; for code
// that moves gradients or optimizer state). `local` must have the shape src gives this rank.
Tensor redistribute_local(const Tensor& local, const DTensorSpec& src, const Placements& dst);

}  // namespace tessera
