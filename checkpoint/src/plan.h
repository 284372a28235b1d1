#pragma once
// What each rank writes or reads, agreed by all ranks before any file is touched (internal to
// checkpoint/).
//
// Every rank describes its entries: key, kind, dtype, global shape and the window of the global
// tensor it holds (for a DTensor, its layout's block; for a plain tensor, the whole). The
// descriptions are exchanged, so every rank sees every rank's windows and can check that all ranks
// passed the same keys, shapes, dtypes and scalar values, that each tensor's windows tile it, and
// choose, for each distinct window, the one rank that accounts for it: it writes that block on
// save and adds up its checksum on load. Ranks holding the same window are replicas (Replicate
// placements, HSDP replicas, data-parallel copies of a TP model on separate sub-meshes); the
// block goes to the replica that has been given the fewest bytes so far, so ranks write similar
// amounts. Every rank computes the same choice from the same descriptions.
#include <optional>
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
  std::string mesh, placements;  // of the DTensor, for the file's information ("" if plain)
  // Scalars and strings: the value.
  StateValue scalar;
};

// Checks the keys of a state dict (non-empty '/'-separated parts, no tensor key above another
// key, "_tessera" and "tessera.*" reserved) and describes this rank's entries, in key order.
// Local: no communication.
std::vector<Entry> describe(const StateDict& state, const std::string& context, bool for_load);

// Exchanges the descriptions over `pg` and fills in `owner`; an inconsistency anywhere (a key,
// shape, dtype or value differing between ranks, windows that do not tile a tensor) is an error
// on every rank naming the key and the ranks. Collective.
void agree_on_entries(std::vector<Entry>& entries, const ProcessGroupPtr& pg,
                      const std::string& context);

// The path of a key in the file: "/model/layers.0.w"; for a scalar, its group and attribute name.
std::string dataset_path(const std::string& key);
std::string group_of(const std::string& key);
std::string attribute_of(const std::string& key);

}  // namespace tessera::ckpt
