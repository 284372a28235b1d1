#pragma once
// Block checksums that do not depend on how a tensor was sharded (internal to checkpoint/).
//
// A dataset's bytes, row-major, are cut into tiles of kTileBytes (the last one short), and read
// as little-endian 32-bit words w_i (i counting words from the dataset's start; whatever the
// dtype). A tile's checksum is two sums modulo 2^64 over its words: of w_i and of w_i * (2i + 1).
//   - one changed byte always changes the first sum;
//   - two changes that cancel in the first (d and -d at words i and j) change the second by
//     2d(i - j), never 0 in datasets of under 8 GiB;
//   - more changes cancel only by chance, and words swapped in place change the second sum.
// Because they are sums of words, and a word split between two ranks' pieces is the sum of its
// two parts (each with zeros for the other's bytes), ranks holding disjoint pieces of a tile
// each add up their own bytes and the partial sums add to the tile's checksum. The writers of a
// checkpoint do that on the blocks they write; the readers of any other layout on the blocks
// they read, exactly once per byte, and compare: resharding costs no extra read. The sums are
// linear, so they run at memory speed (no per-word hashing).
#include <cstdint>
#include <vector>

#include "tessera/core/shape.h"

namespace tessera::ckpt {

constexpr int64_t kTileBytes = int64_t(1) << 20;
// Table entries per tile: the two sums, side by side.
constexpr int64_t kWordsPerTile = 2;

inline int64_t tile_count(int64_t nbytes, int64_t tile_bytes) {
  return (nbytes + tile_bytes - 1) / tile_bytes;
}
inline int64_t checksum_words(int64_t nbytes, int64_t tile_bytes) {
  return kWordsPerTile * tile_count(nbytes, tile_bytes);
}

// Adds the sums of the block [offset, offset + shape) of a dataset of shape `global`, whose
// elements lie densely (row-major, `element_size` bytes each) at `data`, into sums[2k], sums[2k+1]
// for each tile k it touches. `sums` has checksum_words(the dataset's bytes, tile_bytes) entries.
void add_block_checksums(const void* data, size_t element_size, const Shape& global,
                         const Shape& offset, const Shape& shape, int64_t tile_bytes,
                         uint64_t* sums);

// The bytes [first, last) of a row-major dataset of shape `global` that hold the block
// [offset, offset + shape); {0, 0} for an empty block.
struct ByteSpan {
  int64_t first = 0, last = 0;
};
ByteSpan block_span(size_t element_size, const Shape& global, const Shape& offset,
                    const Shape& shape);

// Copies the block [offset, offset + shape) of a dataset of shape `global` densely to `out`,
// adding its sums into `sums` as add_block_checksums would, in the same pass over the data (with
// `sums` null it only copies). `span` holds the dataset's bytes block_span(...) (row-major, a
// mapped file).
void copy_block(const void* span, void* out, size_t element_size, const Shape& global,
                const Shape& offset, const Shape& shape, int64_t tile_bytes, uint64_t* sums);

// The checksum of a table of checksums (it guards the table itself).
uint64_t table_checksum(const std::vector<uint64_t>& table);

}  // namespace tessera::ckpt
