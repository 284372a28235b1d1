#pragma once
// Which modules a LoraConfig adapts: PEFT's check_target_module_exists (exclude_modules first,
// then target_modules) and _maybe_include_all_linear_layers ("all-linear").
#include <string>
#include <utility>
#include <vector>

#include "tessera/lora/config.h"
#include "tessera/nn/layers.h"
#include "tessera/nn/module.h"

namespace tessera {

// The layer "all-linear" leaves out, as PEFT leaves out a model's output embeddings: a Decoder's
// `output` (its lm_head; null when tied), none for any other model.
const Module* lora_output_layer(Module& model);

// Whether `config` adapts the module `m` at `path`: exclude_modules does not name it, and
// target_modules does, or is "all-linear" and `m` is a Linear other than `output`.
bool lora_targets_module(const LoraConfig& config, const std::string& path, const Module& m,
                         const Module* output);

// An error naming the first entry of exclude_modules that matches none of `modules` (a typo would
// leave the module it meant adapted).
void check_lora_excludes(const LoraConfig& config,
                         const std::vector<std::pair<std::string, ModulePtr>>& modules,
                         const std::string& context);

// The Linears `config` adapts among `modules` (the model's, but the LoRA slots), in the model's
// order; an error names a target or exclude entry that matches nothing, a match that is not a
// Linear or cannot be wrapped (already wrapped, or held by fully_shard), and a config that leaves
// nothing to adapt.
std::vector<std::pair<std::string, std::shared_ptr<Linear>>> find_targets(
    Module& model, const LoraConfig& config,
    const std::vector<std::pair<std::string, ModulePtr>>& modules);

// The slots apply_lora makes for the first adapter over `found`: max_rank 0 is the largest r it
// uses (rank_pattern gives layers their own), and every layer's r must fit.
LoraSlots resolve_slots(const LoraSlots& slots, const LoraConfig& config, const std::string& name,
                        const std::vector<std::pair<std::string, std::shared_ptr<Linear>>>& found);

}  // namespace tessera
