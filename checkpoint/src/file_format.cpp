#include "file_format.h"

#include "checksum.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/core/error.h"

namespace tessera::ckpt {

std::string temp_path(const std::string& path) {
  return path + kTempSuffix;
}

DType parse_dtype(const std::string& name, const std::string& what) {
  for (DType d : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16, DType::Int64,
                  DType::Int32, DType::Bool})
    if (name == dtype_name(d)) return d;
  TESSERA_FAIL(what, ": unknown dtype '", name, "'");
}

void check_header(const h5::Id& file, const std::string& path) {
  const std::string suffix = kTempSuffix;
  TESSERA_CHECK(path.size() < suffix.size() ||
                    path.compare(path.size() - suffix.size(), suffix.size(), suffix) != 0,
                "'", path, "' is the temporary file of a checkpoint save that never committed; ",
                "load the checkpoint '", path.substr(0, path.size() - suffix.size()),
                "' instead (or delete this file)");
  TESSERA_CHECK(h5::attr_exists(file, kAttrFormatVersion), "'", path,
                "' is an HDF5 file but not a Tessera checkpoint (no ", kAttrFormatVersion,
                " attribute)");
  TESSERA_CHECK(h5::attr_kind(file, kAttrFormatVersion) == h5::AttrKind::Int, "checkpoint '", path,
                "': ", kAttrFormatVersion, " is not an integer");
  const int64_t v = h5::read_attr_int(file, kAttrFormatVersion);
  TESSERA_CHECK(v == kCheckpointFormatVersion, "checkpoint '", path, "' has format version ", v,
                "; this Tessera reads version ", kCheckpointFormatVersion);
  TESSERA_CHECK(h5::attr_exists(file, kAttrComplete), "checkpoint '", path,
                "' is incomplete: its save did not finish (no ", kAttrComplete, " attribute)");
}

std::vector<uint64_t> read_table(const h5::Id& file, const std::string& path) {
  TESSERA_CHECK(h5::is_dataset(file, kTableDataset), "checkpoint '", path,
                "' has no checksum table ", kTableDataset);
  h5::Id ds = h5::open_dataset(file, kTableDataset);
  std::vector<uint64_t> table = h5::read_u64(ds);
  TESSERA_CHECK(h5::attr_exists(file, kAttrTable), "checkpoint '", path, "' lacks ", kAttrTable);
  const uint64_t want = h5::read_attr_u64(file, kAttrTable);
  TESSERA_CHECK(table_checksum(table) == want, "checkpoint '", path, "': the checksum table ",
                kTableDataset, " is damaged (its own checksum does not match)");
  return table;
}

DatasetMeta dataset_meta(const h5::Id& file, const std::string& path, const std::string& key,
                         size_t table_size) {
  const std::string where = "checkpoint '" + path + "', dataset '" + key + "'";
  h5::Id ds = h5::open_dataset(file, "/" + key);
  DatasetMeta m;
  m.shape = h5::dataset_shape(ds);
  for (const char* a : {kAttrDtype, kAttrFirst, kAttrTile})
    TESSERA_CHECK(h5::attr_exists(ds, a), where, ": attribute ", a, " is missing");
  m.dtype = parse_dtype(h5::read_attr_string(ds, kAttrDtype), where);
  m.first = h5::read_attr_int(ds, kAttrFirst);
  m.tile = h5::read_attr_int(ds, kAttrTile);
  TESSERA_CHECK(m.tile > 0 && m.first >= 0, where, ": invalid checksum attributes (first ", m.first,
                ", tile ", m.tile, ")");
  const int64_t nbytes = shape_numel(m.shape) * int64_t(element_size(m.dtype));
  TESSERA_CHECK(m.tile % int64_t(element_size(m.dtype)) == 0, where, ": a tile of ", m.tile,
                " bytes is not a whole number of ", dtype_name(m.dtype), " elements");
  m.tiles = tile_count(nbytes, m.tile);
  m.words = checksum_words(nbytes, m.tile);
  TESSERA_CHECK(m.first + m.words <= int64_t(table_size), where, ": its ", m.words,
                " checksums from index ", m.first, " lie outside the table of ", table_size);
  if (h5::attr_exists(ds, kAttrMesh)) m.mesh = h5::read_attr_string(ds, kAttrMesh);
  if (h5::attr_exists(ds, kAttrPlacements))
    m.placements = h5::read_attr_string(ds, kAttrPlacements);
  return m;
}

std::string tile_text(const std::string& key, const DatasetMeta& meta, int64_t tile) {
  const int64_t per = meta.tile / int64_t(element_size(meta.dtype));
  const int64_t lo = tile * per, hi = std::min(shape_numel(meta.shape), lo + per) - 1;
  return "dataset '" + key + "' block " + std::to_string(tile) + " of " +
         std::to_string(meta.tiles) + " (elements " + std::to_string(lo) + " to " +
         std::to_string(hi) + " of " + shape_str(meta.shape) + ")";
}

std::vector<std::string> compare_tiles(const std::string& key, const DatasetMeta& meta,
                                       const uint64_t* sums, const std::vector<uint64_t>& table) {
  std::vector<std::string> bad;
  for (int64_t t = 0; t < meta.tiles; ++t) {
    const size_t at = size_t(meta.first + kWordsPerTile * t);
    if (sums[kWordsPerTile * t] == table[at] && sums[kWordsPerTile * t + 1] == table[at + 1])
      continue;
    bad.push_back(tile_text(key, meta, t) + ": checksum mismatch, the data is damaged");
  }
  return bad;
}

}  // namespace tessera::ckpt
