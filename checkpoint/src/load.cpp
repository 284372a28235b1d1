// load(): every rank opens the file (a descriptor of its own, then HDF5, checked to have opened
// the same file) and reads its windows, in place where it can and staged otherwise; the ranks
// agree on every step and on the checksums, and only then are the staged values and the scalars
// written into the state dict.
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <string_view>

#include "checksum.h"
#include "context.h"
#include "file_format.h"
#include "h5/h5.h"
#include "mapped_file.h"
#include "plan.h"
#include "slots.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/comm/agree.h"
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
    case h5::AttrKind::Several:
      return "an array of values";
    default:
      return "a value of another type";
  }
}

// set_optimizer_state_dict loads a parameter's optimizer state whole or not at all (a step
// without its moments would scale the next updates wrongly), but after load() it sees only the
// dict, whose keys the file lacked keep their old values: with strict = false, a unit of which
// the file lacks a key, or holds one that does not fit, is not read at all.
void keep_optimizer_units_whole(const std::vector<Entry>& entries, std::vector<Found>& found,
                                IncompatibleKeys& keys) {
  std::vector<std::pair<std::string, std::string>> units;
  std::set<std::string> present;
  for (size_t i = 0; i < entries.size(); ++i) {
    units.emplace_back(entries[i].key, optimizer_unit_of(entries[i].key));
    if (found[i].present) present.insert(entries[i].key);
  }
  const std::set<std::string> left_out = leave_out_broken_units(
      units, [&](const std::string& key) { return present.count(key) > 0; }, keys);
  for (size_t i = 0; i < entries.size(); ++i)
    if (left_out.count(entries[i].key)) found[i].present = false;
  std::sort(keys.mismatched_keys.begin(), keys.mismatched_keys.end());
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
    if (group != "/" && h5::is_dataset(file, group)) {
      // The dict's scalar lives where the file holds a tensor ("model/w/lr" against tensor
      // "model/w"): another layout, not a group to open.
      keys.mismatched_keys.push_back(e.key + " (expected " +
                                     std::string(e.kind == ValueKind::Int      ? "an int64"
                                                 : e.kind == ValueKind::Double ? "a double"
                                                                               : "a string") +
                                     " in group '" + group +
                                     "', which the file holds as a tensor)");
      continue;
    }
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

Tensor local_of(const StateValue& v) {
  return std::holds_alternative<DTensor>(v) ? std::get<DTensor>(v).to_local().detach()
                                            : std::get<Tensor>(v).detach();
}

// Bytes per piece of a window read: about a checksum tile, so that it is still in cache when its
// checksum is added.
constexpr int64_t kPieceBytes = int64_t(1) << 20;

struct Piece {
  Shape offset, shape;
  int64_t first_row = 0;  // of the window
};

// The pieces of this rank's window of `e`: runs of whole dim-0 indices of about kPieceBytes.
std::vector<Piece> pieces_of(const Entry& e, size_t es) {
  const Shape& shape = e.window.shape;
  std::vector<Piece> out;
  if (shape.empty()) return {Piece{{}, {}, 0}};
  const int64_t local_row = shape_numel(shape) / std::max<int64_t>(1, shape[0]);
  const int64_t per =
      std::max<int64_t>(1, kPieceBytes / std::max<int64_t>(1, local_row * int64_t(es)));
  const int64_t lo = e.window.offset[0], hi = lo + shape[0];
  for (int64_t r = lo; r < hi; r += per) {
    const int64_t a = std::max(r, lo), b = std::min(r + per, hi);
    Piece p{e.window.offset, shape, 0};
    p.offset[0] = b > a ? a : lo;
    p.shape[0] = std::max<int64_t>(0, b - a);
    p.first_row = p.offset[0] - lo;
    out.push_back(std::move(p));
  }
  return out;
}

// Reads this rank's window of `e` into the dense `buf`, piece by piece, with independent reads,
// adding each piece's checksum to `sums` (when given) while it is in cache. Windows that are not
// runs of the file were once read collectively, for MPI-IO's two-phase I/O; on 4 ranks (2 per
// core, 128 MiB of [rows, 1024] float32 windows cut by columns) that took 0.076 s where
// independent reads took 0.048.
void read_window(const h5::Id& ds, const DatasetMeta& meta, const Entry& e, const Tensor& buf,
                 uint64_t* sums) {
  const size_t es = element_size(meta.dtype);
  auto* base = static_cast<unsigned char*>(buf.raw_data());
  const int64_t row = e.window.shape.empty()
                          ? 1
                          : shape_numel(e.window.shape) / std::max<int64_t>(1, e.window.shape[0]);
  for (const Piece& p : pieces_of(e, es)) {
    if (shape_numel(p.shape) == 0) continue;
    unsigned char* at = base + size_t(p.first_row * row) * es;
    h5::read_block(ds, meta.dtype, p.offset, p.shape, at, e.key);
    if (sums) add_block_checksums(at, es, e.global_shape, p.offset, p.shape, meta.tile, sums);
  }
}

// Copies this rank's window of `e` out of the mapped file (its dataset starts at byte `at`) into
// the dense `buf`, adding the checksums to `sums` (when given) in the same pass.
void copy_window(const MappedFile& mapped, int64_t at, const DatasetMeta& meta, const Entry& e,
                 const Tensor& buf, uint64_t* sums) {
  const size_t es = element_size(meta.dtype);
  const ByteSpan span = block_span(es, e.global_shape, e.window.offset, e.window.shape);
  const int64_t whole = shape_numel(meta.shape) * int64_t(es);
  // The whole dataset must lie inside the file, not only this window: every rank then names a
  // truncated file alike.
  mapped.check_range(at, whole, "dataset '" + e.key + "'");
  const MappedRange range =
      mapped.map(at + span.first, span.last - span.first, "dataset '" + e.key + "'");
  copy_block(range.data(), buf.raw_data(), es, e.global_shape, e.window.offset, e.window.shape,
             meta.tile, sums);
}

// In-place reads write through raw_data(), which no kernel counts. Each storage they wrote
// counts one write when load() returns or throws (a failed read may have written part of it),
// so that autograd refuses a graph that saved the tensor before the load, and FSDP sees that a
// shard changed.
class InPlaceWrites {
 public:
  InPlaceWrites() = default;
  InPlaceWrites(const InPlaceWrites&) = delete;
  InPlaceWrites& operator=(const InPlaceWrites&) = delete;
  ~InPlaceWrites() {
    for (const Storage& s : storages_)
      s.impl()->bump_version();
  }
  // A tied tensor is read under each of its keys: its storage counts once.
  void add(const Tensor& t) {
    for (const Storage& s : storages_)
      if (s.is_same(t.storage())) return;
    storages_.push_back(t.storage());
  }
  bool any() const { return !storages_.empty(); }

 private:
  std::vector<Storage> storages_;
};

void check_exists(const std::string& path) {
  struct stat st {};
  TESSERA_CHECK(::stat(path.c_str(), &st) == 0, "checkpoint '", path,
                "' does not exist: ", std::strerror(errno));
  TESSERA_CHECK(S_ISREG(st.st_mode), "checkpoint '", path, "' is not a regular file");
}

// The ranks read the file's tables and offsets each for itself, and verify against their own
// checksum table: they must have opened the same version of it. Its size and a digest of the
// checksum table (which covers every dataset's contents) are compared, not its inode, which
// differs between identical copies on the disks of different hosts. Every rank sees the same
// figures, so every rank throws the same error or none does.
void check_same_file(const ProcessGroupPtr& pg, const std::string& ctx, const std::string& path,
                     int64_t size, const std::vector<uint64_t>& table) {
  const std::string_view bytes(reinterpret_cast<const char*>(table.data()),
                               table.size() * sizeof(uint64_t));
  const std::vector<int64_t> mine = {size, int64_t(std::hash<std::string_view>()(bytes))};
  Tensor all = empty({2 * int64_t(pg->size())}, DType::Int64);
  pg->all_gather_into_tensor(all, from_vector<int64_t>(mine, {2}))->wait();
  const std::vector<int64_t> a = all.to_vector<int64_t>();
  for (int r = 1; r < pg->size(); ++r) {
    const int64_t other = a[size_t(2 * r)];
    if (other == a[0] && a[size_t(2 * r + 1)] == a[1]) continue;
    throw Error(ctx + ": checkpoint '" + path + "' is not the same file on every rank (rank 0 " +
                "opened one of " + std::to_string(a[0]) + " bytes, rank " + std::to_string(r) +
                " one of " + std::to_string(other) + " bytes" +
                (other == a[0] ? " with another checksum table" : "") +
                "): it was replaced while the ranks opened it, or differs between hosts");
  }
}

// Where each present tensor entry's checksum words start among those this rank adds up; returns
// how many there are.
int64_t lay_out_sums(const std::vector<Entry>& entries, const std::vector<Found>& found,
                     std::vector<int64_t>& first) {
  int64_t words = 0;
  first.assign(entries.size(), 0);
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!found[i].present || entries[i].kind != ValueKind::Tensor) continue;
    first[i] = words;
    words += found[i].meta.words;
  }
  return words;
}

// What the reading step fills in.
struct Reads {
  std::vector<Tensor> staged;  // by entry: what was not read in place
  Tensor sums;                 // the checksum words this rank added up (int64 bit patterns)
  std::vector<int64_t> first;  // by entry: its first word in `sums`
  InPlaceWrites in_place;
};

// Reads this rank's windows of every present tensor entry, each in pieces of about a tile that
// it adds up (when verifying) while they are still in cache: from `mapped` when
// given, through HDF5 otherwise. Without `transactional`, a dense window of the file's dtype is
// read straight into its tensor; the others are staged.
void read_tensors(const h5::Id& file, const MappedFile* mapped, const std::vector<Entry>& entries,
                  const std::vector<Found>& found, const StateDict& state,
                  const LoadOptions& options, Reads& r) {
  auto* sum = static_cast<uint64_t*>(r.sums.raw_data());
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    const Found& f = found[i];
    if (!f.present || e.kind != ValueKind::Tensor || shape_numel(e.window.shape) == 0) continue;
    h5::Id ds = h5::open_dataset(file, dataset_path(e.key));
    Tensor dst = local_of(state.at(e.key));
    // HDF5 writes host memory: a device piece is read into a host buffer first.
    const bool direct = !options.transactional && dst.device().is_cpu() && dst.is_contiguous() &&
                        dst.dtype() == f.meta.dtype;
    Tensor buf = direct ? dst : empty(e.window.shape, f.meta.dtype);
    if (direct)
      r.in_place.add(dst);
    else
      r.staged[i] = buf;
    // Every reader adds up what it read, replicas too: theirs are compared with the owner's.
    uint64_t* sums = options.verify ? sum + r.first[i] : nullptr;
    // A dataset another tool rewrote chunked or compressed has no one place in the file to map:
    // HDF5 reads it.
    const int64_t at = mapped ? h5::dataset_file_offset(file, ds) : -1;
    if (at >= 0)
      copy_window(*mapped, at, f.meta, e, buf, sums);
    else
      read_window(ds, f.meta, e, buf, sums);
  }
}

// Adds up the owners' checksum words and compares the totals with the table, and each replica's
// words with its owner's: so every element any rank read is verified. The ranks compute the same
// totals and comparisons, and checked that they read the same table; the verdicts are compared
// all the same, so that every rank throws or none does.
void verify_sums(const ProcessGroupPtr& pg, const std::string& ctx,
                 const std::vector<Entry>& entries, const std::vector<Found>& found,
                 const std::vector<uint64_t>& table, const Reads& r) {
  std::vector<int64_t> count(entries.size(), 0);
  for (size_t i = 0; i < entries.size(); ++i)
    if (found[i].present && entries[i].kind == ValueKind::Tensor) count[i] = found[i].meta.words;
  const auto* mine = static_cast<const uint64_t*>(r.sums.raw_data());
  const GatheredSums g = gather_sums(pg, entries, r.first, count, {mine, size_t(r.sums.numel())});
  std::vector<std::string> bad;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (count[i] == 0) continue;
    for (std::string& b :
         compare_tiles(entries[i].key, found[i].meta, g.total.data() + r.first[i], table))
      bad.push_back(std::move(b));
  }
  for (const ReplicaMismatch& m : g.mismatches)
    for (int64_t t : m.tiles) {
      const DatasetMeta& meta = found[m.entry].meta;
      const uint64_t* sum = g.total.data() + r.first[m.entry] + kWordsPerTile * t;
      const size_t at = size_t(meta.first + kWordsPerTile * t);
      const bool owner_right = sum[0] == table[at] && sum[1] == table[at + 1];
      bad.push_back(tile_text(entries[m.entry].key, meta, t) + ": checksum mismatch, rank " +
                    std::to_string(m.rank) + " read other bytes than rank " +
                    std::to_string(m.owner) + " from the same window" +
                    (owner_right
                         ? " (rank " + std::to_string(m.owner) + "'s match the checksums: rank " +
                               std::to_string(m.rank) + "'s are damaged)"
                         : ""));
    }
  std::string msg;
  for (size_t k = 0; k < bad.size() && k < 8; ++k)
    msg += (k ? "; " : "") + bad[k];
  if (bad.size() > 8) msg += "; and " + std::to_string(bad.size() - 8) + " more";
  const std::vector<std::string> verdicts = all_gather_strings(pg, msg);
  if (std::all_of(verdicts.begin(), verdicts.end(), [](const std::string& v) { return v.empty(); }))
    return;
  // Whether any rank read in place: every rank says the same.
  Tensor flag = full({1}, r.in_place.any() ? 1.0 : 0.0, DType::Int64);
  pg->all_reduce(flag, ReduceOp::Max)->wait();
  const std::string note =
      flag.item<int64_t>() != 0
          ? " (tensors read in place now hold the file's values, damaged ones included; "
            "LoadOptions::transactional leaves them untouched instead)"
          : "";
  if (std::all_of(verdicts.begin(), verdicts.end(),
                  [&](const std::string& v) { return v == verdicts[0]; }))
    throw Error(ctx + ": " + verdicts[0] + note);
  std::string each;
  for (size_t q = 0; q < verdicts.size(); ++q)
    each += (q ? "; rank " : "rank ") + std::to_string(q) + ": " +
            (verdicts[q].empty() ? "no mismatch" : verdicts[q]);
  throw Error(ctx + ": the ranks found different checksum mismatches (" + each + ")" + note);
}

// Writes what was staged, and the scalars, into the state dict.
void commit(StateDict& state, const std::vector<Entry>& entries, const std::vector<Found>& found,
            const Reads& r) {
  NoGradGuard no_grad;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!found[i].present) continue;
    StateValue& v = state.at(entries[i].key);
    if (entries[i].kind != ValueKind::Tensor)
      v = *found[i].scalar;
    else if (r.staged[i].defined())
      local_of(v).copy_(r.staged[i]);
  }
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
  // This rank's own handle on the file, opened before HDF5 opens it by name. The mapping reads
  // through it, and HDF5's file is checked to be this one, so a checkpoint renamed over `path`
  // during the load (a newer save committing) is either not seen at all or an error: its bytes
  // never meet the old file's offsets.
  std::optional<MappedFile> pinned;
  run_agreed(pg, ctx, [&] {
    entries = describe(state, "load from '" + path + "'", /*for_load=*/true);
    check_exists(path);
    pinned.emplace(path);
  });
  agree_on_entries(entries, pg, ctx);

  auto session = h5::h5_session();
  Steps steps(pg, ctx);
  h5::Id file;
  std::vector<uint64_t> table;
  std::vector<Found> found;
  IncompatibleKeys keys;
  steps.run("opening", [&] {
    file = h5::open_file(path, h5::Driver::MpiIo, c.file_comm);
    pinned->check_still_at_path("HDF5 opened it");
  });
  steps.run("reading the metadata", [&] {
    check_header(file, path);
    table = read_table(file, path);
    found = look_up(file, path, entries, table.size(), keys);
    std::erase_if(keys.missing_keys, added_later_optimizer_key);
    keep_optimizer_units_whole(entries, found, keys);
    if (options.strict && (!keys.missing_keys.empty() || !keys.mismatched_keys.empty()))
      TESSERA_FAIL("checkpoint '", path, "' does not match the state dict: ", keys.str());
  });
  check_same_file(pg, ctx, path, pinned->size(), table);

  Reads reads;
  reads.staged.resize(entries.size());
  reads.sums = zeros({lay_out_sums(entries, found, reads.first)}, DType::Int64);
  // Read from the mapping unless the options say otherwise on some rank, and verify when any
  // rank asks for it: one decision for all ranks, as the steps are agreed and the verification
  // is collective. (The mapping's bytes are the file's little-endian ones, as are the host's:
  // the library builds for little-endian hosts only.)
  LoadOptions agreed = options;
  Tensor flags = from_vector<int64_t>({options.memory_map ? 0 : 1, options.verify ? 1 : 0}, {2});
  pg->all_reduce(flags, ReduceOp::Max)->wait();
  agreed.memory_map = flags.to_vector<int64_t>()[0] == 0;
  agreed.verify = flags.to_vector<int64_t>()[1] != 0;
  const MappedFile* mapped = agreed.memory_map ? &*pinned : nullptr;
  // One agreed step for all entries: each rank reads its own windows with no collective call (a
  // mapping, or HDF5's independent reads), so no rank can wait on another inside it. With an
  // agreement per entry (16 of them) a load on 4 ranks sharing 2 cores took 1.45-1.47x the raw
  // read, with one 1.29-1.30x.
  steps.run_local("reading the tensors",
                  [&] { read_tensors(file, mapped, entries, found, state, agreed, reads); });
  steps.run("closing", [&] { file.close("closing '" + path + "'"); });
  if (agreed.verify) verify_sums(pg, ctx, entries, found, table, reads);
  commit(state, entries, found, reads);
  return keys;
}

}  // namespace tessera
