#pragma once
// State dicts of models and optimizers with the names and meaning of PyTorch's
// torch.distributed.checkpoint.state_dict, for any module: plain, tensor-parallel, FSDP, HSDP,
// FSDP x TP.
//
// A sharded state dict holds each distributed parameter as its DTensor with its real placements
// (the stored shard itself, no copy) and each plain parameter as its tensor. A full state dict
// holds every parameter as the GLOBAL tensor in logical order (full_tensor()), never a local
// shard under a global name. Setting a full state dict copies each rank's window of each global
// tensor; a tensor with a shard's shape instead of the global one is refused with the key, the
// global shape expected and the shape given.
#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "tessera/dtensor/dtensor.h"
#include "tessera/nn/module.h"
#include "tessera/nn/optim.h"

namespace tessera {

// One value: a tensor (a DTensor in sharded dicts, a Tensor in full ones or for plain
// parameters), or a scalar or string (an optimizer's steps and hyperparameters, a user's extras:
// the step, a data position, a configuration).
using StateValue = std::variant<Tensor, DTensor, int64_t, double, std::string>;
// Keys are '/'-separated paths. A model's keys are its parameters' and buffers' fully qualified
// names ("layers.0.attention.wq.weight"); an optimizer's are "state/<fqn>/<name>" (tensors and
// the int64 "step") and "param_groups/<hyperparameter>" (doubles; "param_groups/<g>/<name>" for
// each group of an optimizer of several).
using StateDict = std::map<std::string, StateValue>;

struct StateDictOptions {
  // Global tensors (gathered, in logical order) instead of DTensors with their placements.
  bool full_state_dict = false;
  // With full_state_dict, get_*: only rank 0 keeps the tensors, in host memory; the other ranks
  // get an empty dict (each tensor is gathered, kept or dropped, one at a time). Without
  // full_state_dict it does nothing: the DTensors stay on their mesh's device (PyTorch copies
  // their pieces to the host).
  bool cpu_offload = false;
  // With full_state_dict, set_*: only rank 0's dict is read (the others pass an empty one) and
  // each rank receives just its window of one tensor at a time; rank 0 converts each distinct
  // window once, however many ranks hold it. So besides rank 0's dict no rank holds more than one
  // tensor's worth at a time.
  bool broadcast_from_rank0 = false;
  // Leave out parameters that do not require gradients (get_*), and do not expect them (set_*).
  bool ignore_frozen_params = false;
  // set_*: missing, unexpected and wrong-shape keys are one error listing them all. With false
  // they are returned, and the keys that fit are still loaded; a parameter's optimizer state
  // (its tensors and step) loads whole or not at all, the rest of it returned as mismatched.
  bool strict = true;
};

// set_* and load return what they did not take as IncompatibleKeys (tessera/nn/module.h, shared
// with Module::load_state_dict).

// get_* is collective over the ranks that hold the model's DTensors (every rank for a full dict).
// set_* is collective over every world rank when there is more than one, whatever the values
// (full dicts of plain tensors too): the key check's outcome is agreed, so a problem on one rank
// is the same error on every rank, and every rank must pass the same keys and load the same
// ones (checked, with strict = false too; an error naming the keys and the ranks without them).
StateDict get_model_state_dict(Module& model, const StateDictOptions& options = {});
IncompatibleKeys set_model_state_dict(Module& model, const StateDict& state,
                                      const StateDictOptions& options = {});

// The optimizer's parameters must be parameters of `model` (their names come from it, never from
// their position). The state tensors of parameters that have had no update yet are created as
// zeros first (as PyTorch does before saving), so a checkpoint can be loaded into them. As in
// PyTorch's optimizer.state_dict(), a frozen parameter (requires_grad false) keeps the state it
// has (one frozen after some updates); one that has none is left out by get_*, and set_* gives it
// the dict's state for it when the dict holds some that loads, none otherwise. Tensors carry their
// parameter's placements.
StateDict get_optimizer_state_dict(Module& model, Optimizer& optimizer,
                                   const StateDictOptions& options = {});
IncompatibleKeys set_optimizer_state_dict(Module& model, Optimizer& optimizer,
                                          const StateDict& state,
                                          const StateDictOptions& options = {});

// Nesting by key prefix: {"model": m, "optim": o} as one dict with keys "model/...", "optim/...".
void insert_state_dict(StateDict& into, const std::string& prefix, const StateDict& part);
// The entries under "prefix/", with the prefix removed.
StateDict sub_state_dict(const StateDict& state, const std::string& prefix);

// Describes a value: "DTensor([8, 4] float32 ...)", "Tensor[8, 4] float32 cpu", "int64 3", ...
std::string state_value_str(const StateValue& v);

}  // namespace tessera
