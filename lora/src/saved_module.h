#pragma once
// PEFT's modules_to_save without its wrapper. PEFT swaps the module for a ModulesToSaveWrapper
// holding the original and one deep copy per adapter; here module slots are typed (a wrapper
// cannot stand where a model expects an Embedding), so the module stays in place and gets a
// child, "modules_to_save", holding per adapter slot a copy of each of its own parameters
// ("output.modules_to_save.<slot>.weight"). The copies are the module's stand-in parameters
// (Module::set_parameter_stand_ins): its forward computes with the active adapter's copy. Being
// ordinary parameters of the model, they are sharded by fully_shard, laid out by
// parallelize_module as the parameters they stand for, and saved in state dicts and checkpoints
// like any other.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/lora/config.h"
#include "tessera/lora/lora_layer.h"
#include "tessera/nn/module.h"

namespace tessera {

// One slot's copies, under the names of the module's own parameters.
class SavedCopy : public Module {
 public:
  // Zero copies laid out as `own` (plain, or a DTensor of its spec), frozen.
  explicit SavedCopy(const std::vector<std::pair<std::string, Parameter*>>& own);
  Module::StandInSet stand_ins();

 private:
  std::vector<std::unique_ptr<Parameter>> values_;
};

// The slots' copies, named "0", "1", ...: the child "modules_to_save" of a saved module.
class SavedCopies : public Module {
 public:
  explicit SavedCopies(std::vector<std::shared_ptr<SavedCopy>> slots);
  const std::vector<std::shared_ptr<SavedCopy>>& slots() const { return slots_; }

 private:
  std::vector<std::shared_ptr<SavedCopy>> slots_;
};

inline constexpr const char* kSavedChild = "modules_to_save";

struct SavedModule {
  std::string path;
  ModulePtr module;
  std::shared_ptr<SavedCopies> copies;
  // Per slot: whether its adapter saves this module (the forward then computes with its copy).
  // Shared with the module's stand-in selector, which must not hold the module itself.
  std::shared_ptr<std::vector<char>> used;

  // The module's own parameters, and slot k's copies of them, in the same order.
  std::vector<std::pair<std::string, Parameter*>> own() const;
  Module::StandInSet slot(int64_t k) const;
  // Copies the module's values into slot k (each rank its own piece: the layouts are the same).
  void fill(int64_t k) const;
  void clear(int64_t k) const;                              // zeroes slot k
  void write_into_module(int64_t k) const;                  // the module's values become slot k's
  void attach(std::shared_ptr<LoraRouting> routing) const;  // the child and the stand-ins
  void detach() const;
};

// The modules `config.modules_to_save` names among `modules` (those LoRA may target), in the
// model's order; an error names an entry that matches nothing.
std::vector<std::pair<std::string, ModulePtr>> find_saved_modules(
    const LoraConfig& config, const std::vector<std::pair<std::string, ModulePtr>>& modules);

// apply_lora's copies of `module` at `path` in `model`, not yet attached: refused, naming the
// module, for a LoRA target (in `targets`), a module with submodules or without parameters of
// its own, one an earlier apply_lora saves, one held by fully_shard (its copies must be sharded
// alike), and one whose weights are tied to another's (a copy would untie them: the other
// module, or a Decoder's tied output projection, would go on reading the original).
std::shared_ptr<SavedModule> make_saved_module(Module& model, const std::string& path,
                                               const ModulePtr& module, int64_t slots,
                                               const std::vector<std::string>& targets);

}  // namespace tessera
