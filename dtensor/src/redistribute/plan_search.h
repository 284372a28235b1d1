#pragma once
// The cheapest plan by estimated bytes: a search over the placement lists reachable by one-mesh-dim
// steps of the transition table, for the redistributions the ordered planner routes through
// Replicate when a cheaper sequence exists (shards of one tensor dim nested on several mesh
// dims, StridedShard layouts).
#include <optional>

#include "tessera/dtensor/redistribute.h"

namespace tessera::redistribute_detail {

// A plan cheaper than `bound` (bytes moved plus a fixed cost per collective, then number of
// steps), or nothing. Every rank finds
// the same plan: costs are estimates for an even split, the same on every rank.
std::optional<RedistributePlan> cheaper_plan(const DTensorSpec& src, const Placements& dst,
                                             const RedistributePlan& bound);

}  // namespace tessera::redistribute_detail
