#pragma once
// The layout of a checkpoint file, shared by the writer, the reader and the inspection tools
// (internal to checkpoint/; docs/checkpoint.md describes it for readers without Tessera).
//
//   /<key>                   one dataset per tensor entry, at its global shape and in its dtype
//     @tessera.dtype          the Tessera dtype name ("bfloat16", ...)
//     @tessera.saved_mesh     the mesh and placements it was saved with (information only)
//     @tessera.saved_placements
//     @tessera.checksum_first where its tiles' sums start in the checksum table
//     @tessera.checksum_tile_bytes bytes per checksum tile
//   /<group>@<name>          one attribute per scalar or string entry "<group>/<name>"
//   /_tessera/checksums      uint64 [2 x tiles of every dataset]: the tiles' sums (checksum.h)
//   /@tessera.format_version, @tessera.world_size, @tessera.writer,
//    @tessera.checksum_table (the table's own checksum), @tessera.complete (written last)
#include <string>
#include <vector>

#include "h5/h5.h"
#include "tessera/core/dtype.h"
#include "tessera/core/shape.h"

namespace tessera::ckpt {

inline constexpr const char* kTableDataset = "/_tessera/checksums";
inline constexpr const char* kTempSuffix = ".tessera-tmp";
inline constexpr const char* kAttrFormatVersion = "tessera.format_version";
inline constexpr const char* kAttrWorldSize = "tessera.world_size";
inline constexpr const char* kAttrWriter = "tessera.writer";
inline constexpr const char* kAttrTable = "tessera.checksum_table";
inline constexpr const char* kAttrComplete = "tessera.complete";
inline constexpr const char* kAttrDtype = "tessera.dtype";
inline constexpr const char* kAttrMesh = "tessera.saved_mesh";
inline constexpr const char* kAttrPlacements = "tessera.saved_placements";
inline constexpr const char* kAttrFirst = "tessera.checksum_first";
inline constexpr const char* kAttrTile = "tessera.checksum_tile_bytes";

// Where a save writes before it commits: beside `path`, so that the rename stays on one file
// system and is atomic.
std::string temp_path(const std::string& path);

// The dtype of a Tessera dtype name; an error naming `what` otherwise.
DType parse_dtype(const std::string& name, const std::string& what);

// Checks that an open file is a committed checkpoint of a version this library reads.
void check_header(const h5::Id& file, const std::string& path);
// The checksum table, checked against its own checksum.
std::vector<uint64_t> read_table(const h5::Id& file, const std::string& path);

struct DatasetMeta {
  DType dtype = DType::Float32;
  Shape shape;
  int64_t first = 0, tile = 1, tiles = 0;  // tile: bytes per tile
  int64_t words = 0;                       // its entries in the table: kWordsPerTile per tile
  std::string mesh, placements;
};
// The metadata of tensor entry `key`, checked against the table's size.
DatasetMeta dataset_meta(const h5::Id& file, const std::string& path, const std::string& key,
                         size_t table_size);
// "dataset 'model/w' block 2 of 4 (elements 524288 to 786431 of [1024, 1024])".
std::string tile_text(const std::string& key, const DatasetMeta& meta, int64_t tile);
// One line per tile whose sum differs from the table's ("'model/w' block 2 of 4 (elements
// 524288 to 786431 of [1024, 1024]): checksum mismatch").
std::vector<std::string> compare_tiles(const std::string& key, const DatasetMeta& meta,
                                       const uint64_t* sums, const std::vector<uint64_t>& table);

}  // namespace tessera::ckpt
