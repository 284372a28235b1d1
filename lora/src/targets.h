#pragma once
// Which modules a LoraConfig adapts: PEFT's check_target_module_exists (exclude_modules first,
// then target_modules) and _maybe_include_all_linear_layers ("all-linear").
#include <functional>
#include <set>
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

// The modules target_modules and exclude_modules may name (the root, "", among them): all but the
// adapter slots inside LoRA layers, whose paths ("wq.lora_A.0") end in a number as a
// Sequential's layers' do ("0"), the copies of modules_to_save ("output.modules_to_save.0") and
// the rows of trainable tokens ("tok_embeddings.token_adapter").
std::vector<std::pair<std::string, ModulePtr>> lora_targetable_modules(Module& model);

// "target_modules wq, wv; exclude_modules ..." (or the regexes): the selection, for errors.
std::string lora_selection_str(const LoraConfig& config);

// What target entry `entry` of `config` (one of config.target_entries()) adapts among `modules`
// (the model's, but the LoRA slots), as indices into `modules` in the model's order: the modules it
// names (for "all-linear", every Linear but `output` and the LoRA layers other than `own`, the
// caller's LoraModel's layers, none for apply_lora) that exclude_modules does not name and
// layers_to_transform keeps. apply_lora and add_adapter both resolve their targets through it,
// so that they agree on what an entry means. A named entry that matches no module at all, before
// exclude_modules and layers_to_transform apply, is an error, "<context>: target module '<entry>'
// matches no module of <of_model(entry)>"; "all-linear" is not (a model without Linears has
// nothing left to adapt, which the callers say).
std::vector<size_t> lora_entry_targets(
    const LoraConfig& config, const std::string& entry,
    const std::vector<std::pair<std::string, ModulePtr>>& modules, const Module* output,
    const std::set<const Module*>& own, const char* context,
    const std::function<std::string(const std::string&)>& of_model);

// An error naming the first entry of exclude_modules that matches none of `modules` (a typo would
// leave the module it meant adapted).
void check_lora_excludes(const LoraConfig& config,
                         const std::vector<std::pair<std::string, ModulePtr>>& modules,
                         const std::string& context);

// The Linears and Embeddings `config` adapts among `modules` (the model's, but the LoRA slots),
// in the model's order; an error names a target or exclude entry that matches nothing, a match
// that is neither or cannot be wrapped (already wrapped, held by fully_shard, an Embedding whose
// table another module reads too), and a config that leaves nothing to adapt.
std::vector<std::pair<std::string, ModulePtr>> find_targets(
    Module& model, const LoraConfig& config,
    const std::vector<std::pair<std::string, ModulePtr>>& modules);

// The slots apply_lora makes for the first adapter over `found`: max_rank 0 is the largest r it
// uses (rank_pattern gives layers their own), and every layer's r must fit.
LoraSlots resolve_slots(const LoraSlots& slots, const LoraConfig& config, const std::string& name,
                        const std::vector<std::pair<std::string, ModulePtr>>& found);

// Whether `module` is the table a Decoder `model` also projects its output with
// (tie_embeddings).
bool is_tied_output_table(const Module& model, const Module& module);

// An error naming the field when `config` adapts such a table (at `path`) without
// ensure_weight_tying, or with DoRA, which the tied projection does not apply.
void check_tied_target(const LoraConfig& config, const std::string& path, const char* context);

// An error "<at>: ..." when a parameter of `module` (at `path` in `model`) is also read by another
// module: tied by assignment, or a Decoder's tok_embeddings under tie_embeddings, whose output
// projection reads the table outside the embedding's forward, unless `output_projection` (the
// wrapper projects through Embedding::output_projection, which the Decoder calls).
void check_untied(Module& model, const std::string& path, const ModulePtr& module,
                  const std::string& at, bool output_projection = false);

}  // namespace tessera
