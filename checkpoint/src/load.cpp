// load(): every rank reads its windows of the file into staging buffers, the ranks agree that
// every window read and every checksum matched, and only then is anything in the state dict
// written, so a failed load leaves the caller's tensors as they were.
#include <sys/stat.h>

#include <cstring>
#include <optional>

#include "agree.h"
#include "checksum.h"
#include "context.h"
#include "file_format.h"
#include "h5/h5.h"
#include "plan.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/core/factory.h"
#include "watchdog.h"

namespace tessera::ckpt {

namespace {

// What the file holds for one entry of the state dict.
struct Found {
  bool present = false;
  DatasetMeta meta;                  // tensors
  std::optional<StateValue> scalar;  // scalars and strings
};

std::string kind_text(h5::AttrKind k) {
  switch (k) {
    case h5::AttrKind::Int:
      return "an integer";
    case h5::AttrKind::Float:
      return "a floating-point value";
    case h5::AttrKind::String:
      return "a string";
    default:
      return "a value of another type";
  }
}

// Looks up every entry in the file; wrong shapes and dtypes go to `keys.mismatched_keys`, absent
// entries to `keys.missing_keys`.
std::vector<Found> look_up(const h5::Id& file, const std::string& path,
                           const std::vector<Entry>& entries, size_t table_size,
                           IncompatibleKeys& keys) {
  std::vector<Found> found(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    Found& f = found[i];
    if (e.kind == ValueKind::Tensor) {
      if (!h5::is_dataset(file, dataset_path(e.key))) {
        keys.missing_keys.push_back(e.key);
        continue;
      }
      f.meta = dataset_meta(file, path, e.key, table_size);
      const bool convertible =
          f.meta.dtype == e.dtype || (is_floating(f.meta.dtype) && is_floating(e.dtype));
      if (f.meta.shape != e.global_shape || !convertible) {
        keys.mismatched_keys.push_back(
            e.key + " (expected " + shape_str(e.global_shape) + " " + dtype_name(e.dtype) +
            ", the file holds " + shape_str(f.meta.shape) + " " + dtype_name(f.meta.dtype) + ")");
        continue;
      }
      f.present = true;
      continue;
    }
    const std::string group = group_of(e.key), name = attribute_of(e.key);
    if (!(group == "/" || h5::link_exists(file, group)) ||
        !h5::attr_exists(h5::open_group(file, group), name)) {
      keys.missing_keys.push_back(e.key);
      continue;
    }
    h5::Id g = h5::open_group(file, group);
    const h5::AttrKind k = h5::attr_kind(g, name);
    const h5::AttrKind want = e.kind == ValueKind::Int      ? h5::AttrKind::Int
                              : e.kind == ValueKind::Double ? h5::AttrKind::Float
                                                            : h5::AttrKind::String;
    if (k != want) {
      keys.mismatched_keys.push_back(e.key + " (expected " + kind_text(want) + ", the file holds " +
                                     kind_text(k) + ")");
      continue;
    }
    if (k == h5::AttrKind::Int)
      f.scalar = h5::read_attr_int(g, name);
    else if (k == h5::AttrKind::Float)
      f.scalar = h5::read_attr_double(g, name);
    else
      f.scalar = h5::read_attr_string(g, name);
    f.present = true;
  }
  return found;
}

void check_exists(const std::string& path) {
  struct stat st {};
  TESSERA_CHECK(::stat(path.c_str(), &st) == 0, "checkpoint '", path,
                "' does not exist: ", std::strerror(errno));
  TESSERA_CHECK(S_ISREG(st.st_mode), "checkpoint '", path, "' is not a regular file");
}

}  // namespace

}  // namespace tessera::ckpt

namespace tessera {

IncompatibleKeys load(StateDict& state, const std::string& path, const LoadOptions& options) {
  using namespace ckpt;
  wait_for_pending_save();
  const Context& c = context();
  const ProcessGroupPtr& pg = c.group;
  const std::string ctx = "checkpoint load from '" + path + "'";
  std::vector<Entry> entries;
  run_agreed(pg, ctx, [&] {
    entries = describe(state, "load from '" + path + "'", /*for_load=*/true);
    check_exists(path);
  });
  agree_on_entries(entries, pg, ctx);

  auto session = h5::h5_session();
  Steps steps(pg, ctx);
  h5::Id file;
  std::vector<uint64_t> table;
  std::vector<Found> found;
  IncompatibleKeys keys;
  steps.run("opening", [&] { file = h5::open_file(path, h5::Driver::MpiIo, c.file_comm); });
  steps.run("reading the metadata", [&] {
    check_header(file, path);
    table = read_table(file, path);
    found = look_up(file, path, entries, table.size(), keys);
    if (options.strict && (!keys.missing_keys.empty() || !keys.mismatched_keys.empty()))
      TESSERA_FAIL("checkpoint '", path, "' does not match the state dict: ", keys.str());
  });

  // Every rank reads its windows, in key order, collectively; the owners of the distinct windows
  // add up their checksums.
  std::vector<Tensor> staged(entries.size());
  std::vector<int64_t> first(entries.size(), 0);
  int64_t tiles = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!found[i].present || entries[i].kind != ValueKind::Tensor) continue;
    first[i] = tiles;
    tiles += found[i].meta.tiles;
  }
  Tensor sums = zeros({tiles}, DType::Int64);
  auto* sum = static_cast<uint64_t*>(sums.raw_data());
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    const Found& f = found[i];
    if (!f.present || e.kind != ValueKind::Tensor || shape_numel(e.global_shape) == 0) continue;
    steps.run("reading '" + e.key + "'", [&] {
      staged[i] = empty(e.window.shape, f.meta.dtype);
      const bool active = shape_numel(e.window.shape) > 0;
      h5::Id ds = h5::open_dataset(file, dataset_path(e.key));
      h5::read_block(ds, f.meta.dtype, e.window.offset, e.window.shape, staged[i].raw_data(),
                     active, h5::Transfer::Collective);
      if (options.verify && e.owner && active)
        add_block_checksums(staged[i].raw_data(), element_size(f.meta.dtype), e.global_shape,
                            e.window.offset, e.window.shape, f.meta.tile, sum + first[i]);
    });
  }
  steps.run("closing", [&] { file.close("closing '" + path + "'"); });

  if (options.verify) {
    Tensor all = empty({int64_t(pg->size()) * tiles}, DType::Int64);
    pg->all_gather_into_tensor(all, sums)->wait();
    std::vector<uint64_t> total(size_t(tiles), 0);
    const auto* a = static_cast<const uint64_t*>(all.raw_data());
    for (int r = 0; r < pg->size(); ++r)
      for (int64_t t = 0; t < tiles; ++t)
        total[size_t(t)] += a[size_t(r * tiles + t)];
    std::vector<std::string> bad;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (!found[i].present || entries[i].kind != ValueKind::Tensor) continue;
      for (std::string& b :
           compare_tiles(entries[i].key, found[i].meta, total.data() + first[i], table))
        bad.push_back(std::move(b));
    }
    // Every rank computed the same totals: all throw the same error, nothing is written.
    if (!bad.empty()) {
      std::string msg;
      for (size_t k = 0; k < bad.size() && k < 8; ++k)
        msg += (k ? "; " : "") + bad[k];
      if (bad.size() > 8) msg += "; and " + std::to_string(bad.size() - 8) + " more";
      throw Error(ctx + ": " + msg);
    }
  }

  // Commit.
  NoGradGuard no_grad;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    if (!found[i].present) continue;
    StateValue& v = state.at(e.key);
    if (e.kind != ValueKind::Tensor) {
      v = *found[i].scalar;
      continue;
    }
    if (!staged[i].defined()) continue;  // an empty tensor
    Tensor dst = std::holds_alternative<DTensor>(v) ? std::get<DTensor>(v).to_local().detach()
                                                    : std::get<Tensor>(v).detach();
    dst.copy_(staged[i]);
  }
  return keys;
}

}  // namespace tessera
