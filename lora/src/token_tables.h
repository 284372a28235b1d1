#pragma once
// Which tables LoraConfig::trainable_token_indices names, for apply_lora (which wraps them) and
// LoraModel (whose adapters train their rows).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/lora/config.h"
#include "tessera/nn/layers.h"
#include "tessera/nn/module.h"

namespace tessera {

// The module the key "" names, PEFT's list form: the model's input embedding, a Decoder's
// tok_embeddings, else the model's only Embedding; an error names the Embeddings when there is
// none or more than one.
std::string input_embedding_path(Module& model);

// The paths the key `key` of trainable_token_indices names among `paths` (those of `model`'s
// modules a key may name).
std::vector<std::string> token_key_matches(Module& model, const std::string& key,
                                           const std::vector<std::string>& paths);

// apply_lora's tables for `config` among `modules` (the model's, but the LoRA slots), in the
// model's order; an error names a key that matches nothing, a match that is not an Embedding,
// a LoRA target (in `targets`) or a module of modules_to_save (in `saved`), a table with trainable
// tokens already, one held by fully_shard, and one whose weight another module reads too.
std::vector<std::pair<std::string, std::shared_ptr<Embedding>>> find_token_tables(
    Module& model, const LoraConfig& config,
    const std::vector<std::pair<std::string, ModulePtr>>& modules,
    const std::vector<std::string>& targets, const std::vector<std::string>& saved);

// Rows per slot: slots.max_trainable_tokens, or the most ids config lists for one table.
int64_t resolve_max_tokens(const LoraSlots& slots, const LoraConfig& config);

}  // namespace tessera
