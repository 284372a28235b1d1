// The inspection entry points: one process, the local (POSIX) HDF5 driver, no communication.
#include <algorithm>
#include <map>
#include <utility>

#include "checksum.h"
#include "context.h"
#include "file_format.h"
#include "h5/h5.h"
#include "plan.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/core/factory.h"

namespace tessera {

namespace {

using namespace ckpt;

std::string join_path(const std::string& group, const std::string& name) {
  return group == "/" ? "/" + name : group + "/" + name;
}

void read_scalars(const h5::Id& obj, const std::string& group, StateDict& out) {
  for (const std::string& name : h5::attr_names(obj)) {
    if (name.rfind("tessera.", 0) == 0) continue;
    const std::string key = (group == "/" ? "" : group.substr(1) + "/") + name;
    switch (h5::attr_kind(obj, name)) {
      case h5::AttrKind::Int:
        out[key] = h5::read_attr_int(obj, name);
        break;
      case h5::AttrKind::Float:
        out[key] = h5::read_attr_double(obj, name);
        break;
      case h5::AttrKind::String:
        out[key] = h5::read_attr_string(obj, name);
        break;
      default:
        break;
    }
  }
}

void walk(const h5::Id& file, const std::string& group, const std::string& path, size_t table_size,
          CheckpointInfo& info) {
  read_scalars(h5::open_group(file, group), group, info.scalars);
  for (const std::string& name : h5::group_members(h5::open_group(file, group))) {
    const std::string full = join_path(group, name);
    if (full == "/_tessera") continue;
    if (!h5::is_dataset(file, full)) {
      walk(file, full, path, table_size, info);
      continue;
    }
    const std::string key = full.substr(1);
    const DatasetMeta m = dataset_meta(file, path, key, table_size);
    CheckpointEntry e;
    e.key = key;
    e.shape = m.shape;
    e.dtype = m.dtype;
    e.bytes = shape_numel(m.shape) * int64_t(element_size(m.dtype));
    e.saved_mesh = m.mesh;
    e.saved_placements = m.placements;
    info.tensors.push_back(std::move(e));
  }
}

struct OpenCheckpoint {
  h5::Id file;
  std::vector<uint64_t> table;
};

OpenCheckpoint open_local(const std::string& path) {
  OpenCheckpoint o;
  o.file = h5::open_file(path, h5::Driver::Local);
  check_header(o.file, path);
  o.table = read_table(o.file, path);
  return o;
}

// The whole dataset, its checksums compared; problems appended to `bad`.
Tensor read_whole(const OpenCheckpoint& o, const std::string& path, const std::string& key,
                  std::vector<std::string>& bad) {
  const DatasetMeta m = dataset_meta(o.file, path, key, o.table.size());
  Tensor t = empty(m.shape, m.dtype);
  if (t.numel() == 0) return t;
  h5::Id ds = h5::open_dataset(o.file, dataset_path(key));
  h5::read_block(ds, m.dtype, Shape(m.shape.size(), 0), m.shape, t.raw_data(), key);
  std::vector<uint64_t> sums(size_t(m.words), 0);
  add_block_checksums(t.raw_data(), element_size(m.dtype), m.shape, Shape(m.shape.size(), 0),
                      m.shape, m.tile, sums.data());
  for (std::string& b : compare_tiles(key, m, sums.data(), o.table))
    bad.push_back(std::move(b));
  return t;
}

// The save lays the datasets' checksums end to end over the whole table (empty ones hold none),
// so a gap is a dataset removed from the file, which reading the others cannot notice.
void check_table_covered(std::vector<std::pair<int64_t, std::string>> firsts,
                         const std::map<std::string, int64_t>& words, size_t table_size,
                         std::vector<std::string>& bad) {
  std::sort(firsts.begin(), firsts.end(), [&](const auto& a, const auto& b) {
    return std::pair(a.first, words.at(a.second)) < std::pair(b.first, words.at(b.second));
  });
  int64_t next = 0;
  std::string previous;
  for (const auto& [first, key] : firsts) {
    if (first > next)
      bad.push_back("checksums " + std::to_string(next) + " to " + std::to_string(first - 1) +
                    " of the table belong to no dataset (a tensor was removed from the file?)");
    else if (first < next)
      bad.push_back("datasets '" + previous + "' and '" + key + "' claim the same checksums from " +
                    std::to_string(first));
    next = std::max(next, first + words.at(key));
    previous = key;
  }
  if (next < int64_t(table_size))
    bad.push_back("checksums " + std::to_string(next) + " to " + std::to_string(table_size - 1) +
                  " of the table belong to no dataset (a tensor was removed from the file?)");
}

}  // namespace

CheckpointInfo read_checkpoint_info(const std::string& path) {
  wait_for_pending_writer();
  auto session = h5::h5_session();
  OpenCheckpoint o = open_local(path);
  CheckpointInfo info;
  info.path = path;
  info.format_version = h5::read_attr_int(o.file, kAttrFormatVersion);
  if (h5::attr_exists(o.file, kAttrWorldSize))
    info.world_size = h5::read_attr_int(o.file, kAttrWorldSize);
  walk(o.file, "/", path, o.table.size(), info);
  std::sort(info.tensors.begin(), info.tensors.end(),
            [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.key < b.key; });
  return info;
}

std::vector<std::string> verify_checkpoint(const std::string& path) {
  std::vector<std::string> bad;
  CheckpointInfo info;
  try {
    info = read_checkpoint_info(path);
  } catch (const std::exception& e) {
    return {e.what()};
  }
  auto session = h5::h5_session();
  OpenCheckpoint o = open_local(path);
  std::vector<std::pair<int64_t, std::string>> firsts;
  std::map<std::string, int64_t> words;
  for (const CheckpointEntry& e : info.tensors) {
    try {
      const DatasetMeta m = dataset_meta(o.file, path, e.key, o.table.size());
      firsts.emplace_back(m.first, e.key);
      words[e.key] = m.words;
      read_whole(o, path, e.key, bad);
    } catch (const std::exception& ex) {
      bad.push_back("dataset '" + e.key + "' cannot be read: " + ex.what());
    }
  }
  if (bad.empty()) check_table_covered(std::move(firsts), words, o.table.size(), bad);
  return bad;
}

Tensor read_checkpoint_tensor(const std::string& path, const std::string& key) {
  wait_for_pending_writer();
  auto session = h5::h5_session();
  OpenCheckpoint o = open_local(path);
  TESSERA_CHECK(h5::is_dataset(o.file, dataset_path(key)), "checkpoint '", path,
                "' has no tensor '", key, "'");
  std::vector<std::string> bad;
  Tensor t = read_whole(o, path, key, bad);
  TESSERA_CHECK(bad.empty(), "checkpoint '", path, "': ", bad.front());
  return t;
}

}  // namespace tessera
