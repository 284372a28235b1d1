#pragma once
#include "tessera/dtensor/redistribute.h"

namespace tessera::redistribute_detail {

// One family per file; transition_table() orders them.
const Transition* shard_to_shard();
const Transition* shard_to_replicate();
const Transition* partial_to_replicate();
const Transition* partial_to_shard();
const Transition* replicate_to_shard();
const Transition* replicate_to_partial();

// Bytes of a rank's piece under `spec` for an even split (the same on every rank).
int64_t local_bytes(const DTensorSpec& spec);

// Runs `plan` on this rank's piece under `src`, or a gradient back through it. A step on a mesh
// dim of one rank only relabels (the piece is whole along it, its only term, its only copy) and
// is skipped, as the plan search, which counts such steps as free, assumes; a plan of steps
// returns a tensor of its own all the same (one copy where every step was skipped).
Tensor run_plan(const RedistributePlan& plan, const DTensorSpec& src, const Tensor& local);
Tensor run_plan_backward(const RedistributePlan& plan, const DTensorSpec& src, const Tensor& grad);

}  // namespace tessera::redistribute_detail
