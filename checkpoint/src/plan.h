#pragma once
// What each rank writes or reads, agreed by all ranks before any file is touched (internal to
// checkpoint/).
//
// Every rank describes its entries: key, kind, dtype, global shape and the window of the global
// tensor it holds (for a DTensor, its layout's block; for a plain tensor, the whole). The
// descriptions are exchanged, so every rank sees every rank's windows and can check that all ranks
// passed the same keys, shapes, dtypes and scalar values, that each tensor's windows tile it, and
// choose, for each distinct window, the one rank that accounts for it: it writes that block on
// save, and on load its checksums of the window are the ones added up for the table. Ranks
// holding the same window are replicas (a plain tensor, Replicate placements, HSDP replicas,
// data-parallel copies of a TP model on separate sub-meshes); the block goes to the replica that
// has been given the fewest bytes so far, so ranks write similar amounts. Every rank computes the
// same choice from the same descriptions. The other replicas add up their own copy's checksums
// too, compared with the owner's (gather_sums): a save refuses replicas that differ, a load a
// replica's reading that differs from its owner's.
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tessera/checkpoint/state_dict.h"
#include "tessera/comm/process_group.h"

namespace tessera::ckpt {

enum class ValueKind { Tensor, Int, Double, String };
const char* kind_name(ValueKind k);
ValueKind kind_of(const StateValue& v);

struct Window {
  Shape offset, shape;
  bool operator==(const Window& o) const { return offset == o.offset && shape == o.shape; }
};

// One entry as this rank holds it, and what the agreement decided for it.
struct Entry {
  std::string key;
  ValueKind kind = ValueKind::Tensor;
  // Tensors:
  DType dtype = DType::Float32;
  Shape global_shape;
  Window window;                 // this rank's piece of the global tensor
  bool owner = false;            // this rank writes (save) or checksums (load) the window
  int window_owner = -1;         // the rank that does, for this rank's window (-1: it is empty)
  std::string mesh, placements;  // of the DTensor, for the file's information ("" if plain)
  // Scalars and strings: the value.
  StateValue scalar;
};

// Checks the keys of a state dict (non-empty '/'-separated parts, no tensor key above another
// key, "_tessera" and "tessera.*" reserved) and describes this rank's entries, in key order.
// Local: no communication.
std::vector<Entry> describe(const StateDict& state, const std::string& context, bool for_load);

// A distinct window of one tensor and the ranks holding it.
struct Holders {
  Window window;
  std::vector<int> ranks;
};

// The distinct non-empty windows of one tensor among `windows` (rank r's at [r]), each with the
// ranks holding it, in the order of their first holders; an error naming `key` and the ranks
// unless they tile the global tensor (two that overlap without being the same block, or pieces
// that cover less). O(n log n) in the ranks. Local: no communication.
std::vector<Holders> distinct_windows(const std::vector<Window>& windows, const std::string& key,
                                      const Shape& global, const std::string& context);

// Exchanges the descriptions over `pg` and fills in `owner`; an inconsistency anywhere (a key,
// shape, dtype or value differing between ranks, windows that do not tile a tensor) is an error
// on every rank naming the key and the ranks. Collective.
void agree_on_entries(std::vector<Entry>& entries, const ProcessGroupPtr& pg,
                      const std::string& context);

// A window whose replica added up other checksum words than the window's owner: the tiles
// (of the dataset) where they differ.
struct ReplicaMismatch {
  size_t entry = 0;
  int rank = 0, owner = 0;
  std::vector<int64_t> tiles;
};

struct GatheredSums {
  std::vector<uint64_t> total;  // laid out as the ranks' words: each window's counted once
  std::vector<ReplicaMismatch> mismatches;
};

// Gathers every rank's checksum words of its windows (`sums`: entry i's at [first[i], first[i] +
// count[i]), count 0 for entries not summed) and returns the totals over the distinct windows,
// each added by its owner only, and every replica whose words differ from its owner's. Every rank
// gets the same result. Collective over `pg`.
GatheredSums gather_sums(const ProcessGroupPtr& pg, const std::vector<Entry>& entries,
                         const std::vector<int64_t>& first, const std::vector<int64_t>& count,
                         std::span<const uint64_t> sums);

// The path of a key in the file: "/model/layers.0.w"; for a scalar, its group and attribute name.
std::string dataset_path(const std::string& key);
std::string group_of(const std::string& key);
std::string attribute_of(const std::string& key);

}  // namespace tessera::ckpt
