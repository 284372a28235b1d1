#pragma once
// Modules own parameters, buffers and child modules under ordered, deterministic names, so a
// parameter's fully qualified name ("layers.0.attention.wq.weight") is the same in every process
// and every parallelism. Modules are held by shared_ptr and are not copyable.
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/nn/parameter.h"

namespace tessera {

class Module;
using ModulePtr = std::shared_ptr<Module>;

// How a module's forward crosses into DTensors, set by a parallel style: the local input is
// taken as a DTensor with input_layouts, redistributed to desired_input_layouts, passed to
// forward_dtensor, and the result redistributed to output_layouts and returned as its local piece
// (always: PyTorch's use_local_output=True; the next module is told the layout by its own style,
// which trusts it).
struct DTensorIO {
  DeviceMesh mesh;
  Placements input_layouts;
  Placements desired_input_layouts;
  Placements output_layouts;
  // Who set it, for the forward's errors ("SequenceParallel on 'norm' (RMSNorm)"); empty, the
  // module's type.
  std::string owner = {};
  // The style's own check of the input, run once the ranks agree on its global shape, so that
  // all of them fail together (a norm's sequence dim that is the dim it normalises over).
  std::function<void(const DTensor& input)> check_input = {};
};

// What a load did not take: PyTorch's _IncompatibleKeys (missing_keys, unexpected_keys), plus
// mis-shaped keys for the distributed checkpoint's loads, which return those too. Each list is
// sorted; a wrong shape reads "key (expected [8, 4], got [4, 4])".
struct IncompatibleKeys {
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
  std::vector<std::string> mismatched_keys;
  bool empty() const {
    return missing_keys.empty() && unexpected_keys.empty() && mismatched_keys.empty();
  }
  // "missing keys: a, b; unexpected keys: c" (at most 8 keys of each kind, then how many more)
  std::string str() const;
};

class Module : public std::enable_shared_from_this<Module> {
 public:
  explicit Module(std::string type_name) : type_name_(std::move(type_name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Runs forward pre-hooks, forward (or the DTensor path when a style set one), forward hooks.
  Tensor operator()(const Tensor& x);
  virtual Tensor forward(const Tensor& x);
  // The forward on DTensors, for modules that support a parallel style.
  virtual DTensor forward_dtensor(const DTensor& x);

  const std::string& type_name() const { return type_name_; }

  // Called by ColwiseParallel and RowwiseParallel once the module's own parameters (a Linear's
  // weight and bias, an Embedding's table) are distributed on `mesh`, so that a subclass holding
  // more parameters (a LoRA layer) lays them out to match.
  virtual void after_tensor_parallel(const DeviceMesh& mesh) { (void)mesh; }
  // What after_tensor_parallel takes from this rank alone, as (name, description) per tensor:
  // parallelize_module has the ranks agree on it before any style changes the model, as on the
  // parameters. None for a module that takes nothing.
  virtual std::vector<std::pair<std::string, std::string>> tensor_parallel_inputs() const {
    return {};
  }

  // --- names (all in registration order, recursively, "a.b.c") ---
  // With remove_duplicate (PyTorch's default), a module registered under two names and a tensor
  // held by two Parameters or buffers (weights tied by assignment, `head->weight =
  // emb->weight`) are listed once, under their first name: optimizers and clip_grad_norm_ must
  // see each tensor once, or they update and count it once per name. state_dict() lists every
  // name, as PyTorch's does.
  std::vector<std::pair<std::string, Parameter*>> named_parameters(bool recurse = true,
                                                                   bool remove_duplicate = true);
  std::vector<Parameter*> parameters(bool recurse = true);
  std::vector<std::pair<std::string, Tensor*>> named_buffers(bool recurse = true,
                                                             bool remove_duplicate = true);
  std::vector<std::pair<std::string, ModulePtr>> named_children();
  // Every module below and including this one ("" is this one).
  std::vector<std::pair<std::string, ModulePtr>> named_modules(bool remove_duplicate = true);
  // The module at a dotted path ("layers.3.attention"); an error names the missing part.
  ModulePtr get_submodule(const std::string& path);
  // Replaces the child at `path` (apply_lora wraps layers this way); the new module must be
  // of a type the parent's slot accepts.
  void replace_submodule(const std::string& path, ModulePtr module);
  // PyTorch's add_module: `module` becomes a child under `name`, held by this module, for
  // children added from outside (LoRA's modules_to_save copies); a module's own structure
  // registers its typed members instead. replace_submodule may put any module in its place.
  void add_module(const std::string& name, ModulePtr module);
  // Removes a child add_module added (PyTorch's `del module.name`); refused, naming it, for one
  // of the module's own members, which its forward uses.
  void delete_module(const std::string& name);

  // --- stand-in parameters (LoRA's modules_to_save) ---
  // Sets of parameters held elsewhere (by a child, typically) that may take the place of this
  // module's own in a forward: set k maps some of this module's parameter names to parameters
  // of the same global shape and dtype. `select` is asked at each forward which set applies (-1:
  // none), and the forward then computes with that set's parameters wherever it reads its own,
  // so they are the ones that receive gradients; when it returns or throws, every parameter
  // holds its own value again. With `per_row` (a mixed batch), row i of the input's first dim
  // (the sample) takes set per_row[i]: the forward runs once per distinct set on the rows that
  // chose it (as PEFT's mixed batches), and the output's rows (first dim too) are put back in
  // the input's order. Activation checkpointing's
  // recomputation runs the forward again and asks `select` again: what it answers must not
  // change between a forward and its backward. parallelize_module lays each stand-in out as it
  // lays out the parameter it stands for. An error names a set's unknown name or mismatched
  // shape or dtype, and a choice that does not fit the sets or the input's rows.
  using StandInSet = std::vector<std::pair<std::string, Parameter*>>;
  struct StandInChoice {
    int64_t set = -1;
    std::optional<std::vector<int64_t>> per_row = {};
  };
  void set_parameter_stand_ins(std::vector<StandInSet> sets, std::function<StandInChoice()> select);
  void clear_parameter_stand_ins();
  const std::vector<StandInSet>& parameter_stand_ins() const { return stand_ins_; }

  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Pre-hooks may return a replacement input (undefined keeps it); hooks a replacement output.
  using ForwardPreHook = std::function<Tensor(Module&, const Tensor&)>;
  using ForwardHook = std::function<Tensor(Module&, const Tensor& input, const Tensor& output)>;
  void register_forward_pre_hook(ForwardPreHook hook);
  void register_forward_hook(ForwardHook hook);

  // Global tensors under fully qualified names (DTensors are gathered), buffers included. Every
  // name of a shared module or tied tensor has its key ("embed.weight" and "lm_head.weight"),
  // as in PyTorch, so that dicts load between the two strictly.
  std::map<std::string, Tensor> state_dict();
  // Strict by default: missing, unexpected and mis-shaped keys are all listed in the error, and
  // nothing is written. Not strict, the keys that fit are loaded and the missing and unexpected
  // ones returned (mis-shaped keys are still an error, as in PyTorch). Each rank copies its own
  // window of every global tensor.
  IncompatibleKeys load_state_dict(const std::map<std::string, Tensor>& state, bool strict = true);
  // The same names without gathering anything: each distributed parameter as its DTensor (the
  // stored shard, sharing its storage, as for checkpointing a sharded model), and each plain
  // parameter or buffer as a DTensor replicated on a 1-D mesh over the world of its own device
  // type, whose piece is that tensor (on its device, sharing its storage, as PyTorch's
  // state_dict keeps tensors where they are). Collective.
  std::map<std::string, DTensor> sharded_state_dict();
  // Loads DTensors of the right global shapes in any placements and on any mesh: each parameter
  // takes its own piece (redistributed when the mesh is its own, else gathered and cut). Checked
  // like load_state_dict before anything is written. Collective.
  IncompatibleKeys load_sharded_state_dict(const std::map<std::string, DTensor>& state,
                                           bool strict = true);

  // Every parameter's gradient, as Optimizer::zero_grad (PyTorch's Module.zero_grad).
  void zero_grad(bool set_to_none = true);
  // PyTorch's module.to(device): moves every parameter (Parameter::to) and buffer, recursively.
  // Returns this module for chaining.
  Module& to(Device device);

  // Activation checkpointing of this module (see checkpoint(ModulePtr) below).
  void set_activation_checkpointing(bool on) { activation_checkpointing_ = on; }
  bool activation_checkpointing() const { return activation_checkpointing_; }

  // Set by parallel styles.
  void set_dtensor_io(DTensorIO io) { dtensor_io_ = std::move(io); }
  const std::optional<DTensorIO>& dtensor_io() const { return dtensor_io_; }

 protected:
  // For a module built to take another's place (a wrapper): it runs in `other`'s training mode.
  // Not train(), which walks the module tree through shared pointers a constructor lacks; this
  // module's children keep their own flags.
  void copy_training_from(const Module& other) { training_ = other.training_; }
  // The same for `other`'s forward pre-hooks and hooks (a parallel plan's, the user's), appended
  // to this module's own: they then run around this module's forward, with it as their module.
  void copy_hooks_from(const Module& other);
  void register_parameter(const std::string& name, Parameter* slot);
  void register_buffer(const std::string& name, Tensor* slot);
  template <class T>
  void register_module(const std::string& name, std::shared_ptr<T>& slot) {
    ModuleSlot s;
    s.get = [&slot]() -> ModulePtr { return slot; };
    s.set = [&slot, name](ModulePtr m) {
      auto typed = std::dynamic_pointer_cast<T>(m);
      TESSERA_CHECK(typed != nullptr, "replace_submodule: '", name, "' holds a ",
                    slot ? slot->type_name() : std::string("module"), "; got a ",
                    m ? m->type_name() : std::string("null"), " that is not one");
      slot = std::move(typed);
    };
    add_child(name, std::move(s));
  }
  // A child that is part of this module's own structure (the decoder's list of blocks, whose
  // slots are this module's members): listed and reached like any other, but replace_submodule
  // refuses to replace it, naming `remedy` (what to replace instead).
  void register_fixed_module(const std::string& name, ModulePtr module, std::string remedy);

 private:
  struct ModuleSlot {
    std::function<ModulePtr()> get;
    std::function<void(ModulePtr)> set;
  };
  void add_child(const std::string& name, ModuleSlot slot);
  // forward, or the DTensor path a style set, with the chosen stand-in parameters in place
  Tensor run_forward(const Tensor& x);
  Tensor run_own_forward(const Tensor& x);  // the same with the module's own parameters
  Tensor run_with_stand_ins(int64_t set, const Tensor& x);  // run_own_forward with set `set`
  Tensor run_per_row(const std::vector<int64_t>& per_row, const Tensor& x);
  void check_new_name(const std::string& name) const;

  std::string type_name_;
  bool training_ = true;
  std::vector<std::pair<std::string, Parameter*>> params_;
  std::vector<std::pair<std::string, Tensor*>> buffers_;
  std::vector<std::pair<std::string, ModuleSlot>> children_;
  std::vector<ForwardPreHook> pre_hooks_;
  std::vector<ForwardHook> hooks_;
  std::optional<DTensorIO> dtensor_io_;
  bool activation_checkpointing_ = false;
  std::vector<StandInSet> stand_ins_;
  std::function<StandInChoice()> select_stand_ins_;
  std::vector<std::string> added_children_;  // by add_module: the ones delete_module may remove
};

// PyTorch's composable checkpoint(module): from now on the module's forward (the DTensor path
// included, not its forward pre-hooks and hooks, so fully_shard's stay outside) is a checkpointed
// region (autograd/checkpoint.h): its activations are not kept for backward but recomputed there.
// The state dict's keys do not change. Returns the module.
ModulePtr checkpoint(const ModulePtr& module);

}  // namespace tessera
