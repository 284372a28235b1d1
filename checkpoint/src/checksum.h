#pragma once
// Block checksums that do not depend on how a tensor was sharded (internal to checkpoint/).
//
// A dataset of N elements is cut into tiles of kTileBytes (the last one short): tile k holds the
// elements whose row-major flat index i lies in [k*T, (k+1)*T). A tile's checksum is the sum,
// modulo 2^64, of term(bits of element i, i) over its elements, where term is a bijection of the
// bits for each i: so any one changed element always changes the sum, and several changes
// cancel only by chance (about 2^-64). Because it is a sum, any ranks holding disjoint pieces of a
// tile can each add up their own elements and the partial sums add to the tile's checksum. The
// writers of a checkpoint do that on the blocks they write; the readers of any other layout do it
// on the blocks they read, exactly once per element, and compare. Resharding costs no extra read.
#include <cstdint>
#include <vector>

#include "tessera/core/shape.h"

namespace tessera::ckpt {

constexpr int64_t kTileBytes = int64_t(1) << 20;

inline int64_t tile_elements(size_t element_size) {
  return kTileBytes / int64_t(element_size);
}
inline int64_t tile_count(int64_t numel, int64_t tile) {
  return (numel + tile - 1) / tile;
}

// Adds the terms of the block [offset, offset + shape) of a dataset of shape `global`, whose
// elements lie densely (row-major, `element_size` bytes each) at `data`, into sums[tile index].
// `sums` has tile_count(numel(global), tile) entries.
void add_block_checksums(const void* data, size_t element_size, const Shape& global,
                         const Shape& offset, const Shape& shape, int64_t tile, uint64_t* sums);

// The checksum of a table of checksums (it guards the table itself).
uint64_t table_checksum(const std::vector<uint64_t>& table);

}  // namespace tessera::ckpt
