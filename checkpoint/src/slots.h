#pragma once
// The tensors a state dict gets and sets, whatever owns them (internal to checkpoint/): a
// module's parameters and buffers, an optimizer's state. Each is a slot: where this rank's piece
// lives and how it lies in the global tensor. get_* and set_* of models and optimizers are the
// same two functions over different slots.
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tessera/checkpoint/state_dict.h"

namespace tessera::ckpt {

struct Slot {
  std::string key;
  Tensor local;                             // this rank's piece (a view: writes land in place)
  std::shared_ptr<const DTensorSpec> spec;  // null for a plain tensor (local is the whole)
  Shape global_shape;
  DType dtype = DType::Float32;
  // Keys of one unit load together or not at all (a parameter's optimizer state: a step without
  // its moments would scale the next updates wrongly); empty for none.
  std::string unit;
  bool sharded() const { return spec != nullptr; }
};

// A slot over a parameter's stored piece (its stored DTensor, or its tensor).
Slot parameter_slot(const std::string& key, const Parameter& p);
// A slot over `local` laid out like parameter `p` (an optimizer's state of it), in local's dtype.
Slot slot_like(const std::string& key, const Tensor& local, const Parameter& p);
Slot plain_slot(const std::string& key, const Tensor& t);

// The slots' values: DTensors (their pieces, no copy) and plain tensors, or with full_state_dict
// the global tensors, kept on rank 0 only with cpu_offload.
void get_slots(const std::vector<Slot>& slots, const StateDictOptions& options, StateDict& out);

enum class ScalarKind { Int64, Double, String };

// A scalar a state dict may set (an optimizer's step or hyperparameter, or what a group holds),
// and how to apply it.
struct ScalarSlot {
  std::string key;
  ScalarKind kind = ScalarKind::Int64;
  std::function<void(const StateValue&)> apply;
  // A key that dicts saved before it existed lack (a hyperparameter added later): when absent it
  // is neither missing nor applied, and what it would set keeps its value.
  bool optional = false;
  std::string unit;  // as Slot::unit
  // Why a value of the right kind does not fit (a negative step), or "" when it does: the key is
  // then mismatched, found with the others before anything is copied.
  std::function<std::string(const StateValue&)> problem = nullptr;
};

// Slots a state dict may hold or leave out as a whole (the optimizer state of a frozen parameter
// that has none): `add` appends them, creating what they write into, only when the dict holds a
// key starting with `prefix` (with broadcast_from_rank0: rank 0's dict), and then they are
// checked like the others.
struct OptionalSlots {
  std::string prefix;
  std::function<void(std::vector<Slot>&, std::vector<ScalarSlot>&)> add;
};

// Checks `state` against the slots (missing, unexpected and mis-shaped keys, all at once), then
// copies every value into its slot: each rank its window. Collective over every world rank when
// there is more than one, whatever the values: the check's outcome and the keys passed and
// loaded are agreed, so a problem on one rank is the same error on every rank and no rank loads
// a key another leaves out. `what` names the operation in errors ("set_model_state_dict into
// Decoder").
IncompatibleKeys set_slots(std::vector<Slot> slots, std::vector<ScalarSlot> scalars,
                           const StateDict& state, const StateDictOptions& options,
                           const std::string& what,
                           const std::vector<OptionalSlots>& optional = {});

// A unit loads whole or not at all: of `keys` ({key, unit}; unit "" for none), each key that
// `present` says the source holds, and whose unit has a key missing or mismatched in `k`, is
// added to k's mismatched keys ("not loaded: ..."). Returns the keys so left out.
std::set<std::string> leave_out_broken_units(
    const std::vector<std::pair<std::string, std::string>>& keys,
    const std::function<bool(const std::string&)>& present, IncompatibleKeys& k);

// Whether `key` is a hyperparameter, or a group's "params", of an optimizer state dict
// ("[<prefix>/]param_groups/[<g>/]<name>") that dicts saved before it existed lack: load()
// leaves such a key as it is when the file lacks it, as set_optimizer_state_dict does.
bool added_later_optimizer_key(const std::string& key);

// The unit of an optimizer state key ("[<prefix>/]state/<fqn>/<name>" with <name> a state
// tensor's name or "step"): the key without <name>, whose keys load together or not at all
// (set_optimizer_state_dict's rule, which load() keeps too). "" for any other key.
std::string optimizer_unit_of(const std::string& key);

}  // namespace tessera::ckpt
