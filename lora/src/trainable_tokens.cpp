// LoraModel's side of trainable tokens: which tables an adapter's trainable_token_indices
// names, and the checks apply_lora makes before wrapping them.
#include <algorithm>

#include "targets.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/lora/lora_model.h"
#include "tessera/nn/transformer.h"
#include "token_tables.h"

namespace tessera {

namespace {

std::string key_str(const std::string& key) {
  return key.empty() ? std::string("the input embedding (key \"\")") : "'" + key + "'";
}

}  // namespace

std::string input_embedding_path(Module& model) {
  const auto modules = model.named_modules();
  if (auto* decoder = dynamic_cast<Decoder*>(&model))
    for (const auto& [path, m] : modules)
      if (m == std::static_pointer_cast<Module>(decoder->tok_embeddings)) return path;
  std::vector<std::string> tables;
  for (const auto& [path, m] : modules)
    if (std::dynamic_pointer_cast<Embedding>(m)) tables.push_back(path);
  TESSERA_CHECK(tables.size() == 1,
                "LoRA trainable_token_indices: the key \"\" (PEFT's list form) names the "
                "model's input embedding, but the model has ",
                tables.empty() ? std::string("no Embedding") : "the Embeddings " + join(tables),
                "; name the table with its path as the key");
  return tables.front();
}

std::vector<std::string> token_key_matches(Module& model, const std::string& key,
                                           const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  const std::string input = key.empty() ? input_embedding_path(model) : std::string();
  for (const std::string& path : paths)
    if (key.empty() ? path == input : lora_target_matches(key, path)) out.push_back(path);
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Embedding>>> find_token_tables(
    Module& model, const LoraConfig& config,
    const std::vector<std::pair<std::string, ModulePtr>>& modules,
    const std::vector<std::string>& targets, const std::vector<std::string>& saved) {
  std::vector<std::string> paths;
  for (const auto& [path, m] : modules)
    paths.push_back(path);
  std::vector<std::string> named;
  std::vector<const std::vector<int64_t>*> ids_of;  // per entry of `named`
  for (const auto& [key, ids] : config.trainable_token_indices) {
    const std::vector<std::string> found = token_key_matches(model, key, paths);
    TESSERA_CHECK(!found.empty(), "LoRA trainable_token_indices: ", key_str(key),
                  " matches no module of the model");
    for (const std::string& p : found) {
      TESSERA_CHECK(std::find(named.begin(), named.end(), p) == named.end(),
                    "LoRA trainable_token_indices: '", p,
                    "' is named by two keys; list its token ids under one");
      named.push_back(p);
      ids_of.push_back(&ids);
    }
  }
  std::vector<std::pair<std::string, std::shared_ptr<Embedding>>> out;
  for (const auto& [path, m] : modules) {
    const auto it = std::find(named.begin(), named.end(), path);
    if (it == named.end()) continue;
    const std::string at = "LoRA trainable_token_indices: '" + path + "' (" + m->type_name() + ")";
    auto table = std::dynamic_pointer_cast<Embedding>(m);
    TESSERA_CHECK(table != nullptr, at, " is not an Embedding");
    for (int64_t id : *ids_of[size_t(it - named.begin())])
      TESSERA_CHECK(id < table->num_embeddings(), at, ": token id ", id,
                    " is out of range for num_embeddings ", table->num_embeddings());
    TESSERA_CHECK(std::find(targets.begin(), targets.end(), path) == targets.end() &&
                      !std::dynamic_pointer_cast<LoraLayer>(m),
                  at, " is adapted by LoRA; a table either has LoRA adapters or trainable tokens");
    TESSERA_CHECK(std::find(saved.begin(), saved.end(), path) == saved.end(), at,
                  " is in modules_to_save, which trains the whole table already");
    TESSERA_CHECK(!std::dynamic_pointer_cast<TokenEmbedding>(m), at,
                  " has trainable tokens of an earlier apply_lora already");
    // The wrapper takes the table over; an FSDP group would go on gathering the old one.
    TESSERA_CHECK(!is_fully_sharded(table->weight), at,
                  " is sharded by fully_shard; apply LoRA before fully_shard (adapters can still "
                  "be added after it, into the rows LoraSlots preallocates)");
    // A Decoder's tied output layer projects through the wrapper (output_projection).
    check_untied(model, path, m, at, /*output_projection=*/true);
    out.emplace_back(path, table);
  }
  return out;
}

int64_t resolve_max_tokens(const LoraSlots& slots, const LoraConfig& config) {
  TESSERA_CHECK(slots.max_trainable_tokens >= 0, "LoraSlots: max_trainable_tokens is ",
                slots.max_trainable_tokens, " (0: the first adapter's most ids for one table)");
  int64_t most = 0;
  for (const auto& [key, ids] : config.trainable_token_indices)
    most = std::max(most, int64_t(ids.size()));
  if (slots.max_trainable_tokens == 0) return most;
  TESSERA_CHECK(most <= slots.max_trainable_tokens, "LoRA trainable_token_indices: ", most,
                " token ids for one table, but LoraSlots::max_trainable_tokens is ",
                slots.max_trainable_tokens);
  return slots.max_trainable_tokens;
}

std::vector<std::pair<size_t, std::vector<int64_t>>> LoraModel::token_targets(
    const LoraConfig& config) const {
  std::vector<std::string> paths;
  for (const auto& [path, t] : tokens_)
    paths.push_back(path);
  std::vector<std::pair<size_t, std::vector<int64_t>>> out;
  for (const auto& [key, ids] : config.trainable_token_indices) {
    const std::vector<std::string> found = token_key_matches(*model_, key, paths);
    if (found.empty()) {
      // Distinguish a typo from a table apply_lora was not told about.
      std::vector<std::string> all;
      for (const auto& [path, m] : model_->named_modules())
        all.push_back(path);
      TESSERA_CHECK(token_key_matches(*model_, key, all).empty(),
                    "LoRA trainable_token_indices: ", key_str(key),
                    " names a table apply_lora did not wrap for trainable tokens (an adapter can "
                    "only train tokens of tables the first adapter's trainable_token_indices "
                    "named)");
      TESSERA_FAIL("LoRA trainable_token_indices: ", key_str(key),
                   " matches no module of the model");
    }
    for (const std::string& p : found) {
      const size_t i = size_t(std::find(paths.begin(), paths.end(), p) - paths.begin());
      TESSERA_CHECK(
          std::none_of(out.begin(), out.end(), [&](const auto& o) { return o.first == i; }),
          "LoRA trainable_token_indices: '", p,
          "' is named by two keys; list its token ids under one");
      out.emplace_back(i, ids);
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

std::vector<std::pair<std::string, Parameter*>> LoraModel::token_parameters(
    const Adapter& a) const {
  std::vector<std::pair<std::string, Parameter*>> out;
  for (const auto& [i, ids] : a.tokens)
    out.emplace_back(tokens_[i].first + ".token_adapter.trainable_tokens_delta",
                     &tokens_[i].second->trainable_tokens_delta(a.slot));
  return out;
}

}  // namespace tessera
