#pragma once
// The reference geometry of DTensor layouts, written from the placement semantics alone
// (torch.chunk per level; several shards of one tensor dim nest left to right; a StridedShard nests
// inside the later shards of its dim) without calling the runtime's layout code, so that a test
// built on it can catch the runtime's mistakes as well as the user's.
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/dtensor/placement.h"

namespace tessera::testing {

// [start, start + length) of piece `index` when `n` elements are cut `parts` ways by torch.chunk:
// pieces of ceil(n / parts), the last ones short or empty (5 over 4: 2, 2, 1, 0).
struct IndexRange {
  int64_t start = 0;
  int64_t length = 0;
};
IndexRange chunk_range(int64_t n, int64_t parts, int64_t index);

// The block of a global tensor that one mesh coordinate holds: per tensor dim, the global indices
// [offset[d], offset[d] + shape[d]). Every supported layout gives each coordinate one such block.
struct Window {
  Shape offset;
  Shape shape;

  int64_t numel() const;
  // The global index of the element at `local_index` of the block.
  std::vector<int64_t> global_index(const std::vector<int64_t>& local_index) const;
  std::string str() const;  // "[0:4, 2:3]": the global index ranges, end exclusive
};

// The window that mesh coordinate `coordinate` of a mesh of `mesh_shape` holds of a
// `global_shape`-shaped DTensor with `placements` (Partial and Replicate mesh dims hold the whole
// extent; negative shard dims count from the end). Throws tessera::Error naming the placement
// when a shard dim is out of range or a StridedShard's split factor is not the product of the
// later shards of its dim (the only nesting a DTensor can have).
Window reference_window(const Shape& global_shape, const Shape& mesh_shape,
                        const std::vector<int64_t>& coordinate, const Placements& placements);

// The mesh coordinate of the `index`-th rank of a mesh of `mesh_shape` (row-major, as DeviceMesh
// lays out the world).
std::vector<int64_t> mesh_coordinate(int64_t index, const Shape& mesh_shape);

// A contiguous copy of the elements of `global` inside `window`, in `global`'s dtype.
Tensor cut_window(const Tensor& global, const Window& window);

// Row-major multi-index of flat index `flat` in `shape`, and back.
std::vector<int64_t> unravel_index(int64_t flat, const Shape& shape);
int64_t ravel_index(const std::vector<int64_t>& index, const Shape& shape);

std::string index_str(const std::vector<int64_t>& index);       // "[1, 2]"
std::string coordinate_str(const std::vector<int64_t>& coord);  // "(1, 2)"

}  // namespace tessera::testing
