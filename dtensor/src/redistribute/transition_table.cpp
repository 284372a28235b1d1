#include "transitions.h"

namespace tessera {

// The redistribution policy in one place: for a change on one mesh dim, the first family that
// applies carries it out. The planner only asks for changes these cover (S->S between plain
// shards, S->R, P->R, P->S, R->S, R->P); anything else it routes through Replicate.
const std::vector<const Transition*>& transition_table() {
  using namespace redistribute_detail;
  static const std::vector<const Transition*> table = {
      shard_to_shard(),        // S(i) -> S(j): all-to-all
      shard_to_replicate(),    // S -> R: all-gather
      partial_to_replicate(),  // P -> R: all-reduce
      partial_to_shard(),      // P -> S: reduce-scatter
      replicate_to_shard(),    // R -> S: local chunk
      replicate_to_partial(),  // R -> P: local zero / keep
  };
  return table;
}

namespace redistribute_detail {
int64_t local_bytes(const DTensorSpec& spec) {
  return shape_numel(spec.local_layout().local_shape) * int64_t(element_size(spec.dtype));
}
}  // namespace redistribute_detail

}  // namespace tessera
