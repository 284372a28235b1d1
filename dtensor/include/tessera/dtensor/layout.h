#pragma once
// The one function that says which block of a global tensor a mesh coordinate holds. Scatter,
// gather, checkpoint hyperslabs and random windows all use it.
#include <vector>

#include "tessera/core/shape.h"
#include "tessera/dtensor/placement.h"

namespace tessera {

struct LocalLayout {
  Shape local_shape;
  Shape global_offset;
};

// torch.chunk semantics on each level (chunk ceil(n/k); last pieces short or empty); several
// mesh dims sharding one tensor dim nest left to right, a StridedShard nested inside the later
// shards of its dim. Placements must be normalized (non-negative dims).
LocalLayout compute_local_layout(const Shape& global_shape, const Shape& mesh_shape,
                                 const std::vector<int64_t>& coordinate,
                                 const Placements& placements);

// [start, start + length) of chunk `index` of `n` elements split `parts` ways (torch.chunk).
struct Chunk {
  int64_t start;
  int64_t length;
};
Chunk chunk_of(int64_t n, int64_t parts, int64_t index);

// The order in which mesh dims are applied when cutting tensor dims: left to right, except that
// each StridedShard comes after the later shards of its dim that it is nested in. Validates
// placements against the tensor rank and mesh (shard dims in range, split factors matching).
std::vector<int64_t> shard_application_order(const Shape& global_shape, const Shape& mesh_shape,
                                             const Placements& placements);

}  // namespace tessera
