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
// For an even split (rounded up), not this rank's piece: every rank must estimate alike, since
// plans are chosen by these estimates and must be the same on every rank.
int64_t local_bytes(const DTensorSpec& spec) {
  int64_t pieces = 1;
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (spec.placements[m].is_shard()) pieces *= spec.mesh.size(int64_t(m));
  const int64_t numel = shape_numel(spec.global_shape);
  return (numel + pieces - 1) / pieces * int64_t(element_size(spec.dtype));
}
}  // namespace redistribute_detail

}  // namespace tessera
