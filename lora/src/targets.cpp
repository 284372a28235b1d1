#include "targets.h"

#include <algorithm>

#include "saved_module.h"
#include "tessera/core/error.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/lora/lora_layer.h"
#include "tessera/lora/token_embedding.h"
#include "tessera/nn/layers.h"
#include "tessera/nn/module_path.h"
#include "tessera/nn/transformer.h"

namespace tessera {

const Module* lora_output_layer(Module& model) {
  auto* decoder = dynamic_cast<Decoder*>(&model);
  return decoder ? decoder->output.get() : nullptr;
}

std::vector<std::pair<std::string, ModulePtr>> lora_targetable_modules(Module& model) {
  std::vector<std::pair<std::string, ModulePtr>> modules = model.named_modules(), out;
  std::vector<std::string> inside;
  for (const auto& [path, m] : modules) {
    if (std::dynamic_pointer_cast<LoraLayer>(m) || std::dynamic_pointer_cast<TokenEmbedding>(m))
      inside.push_back(path.empty() ? "" : path + ".");
    if (std::dynamic_pointer_cast<SavedCopies>(m)) inside.push_back(path);
  }
  for (auto& [path, m] : modules)
    if (path.empty() || std::none_of(inside.begin(), inside.end(), [&](const std::string& p) {
          return path.compare(0, p.size(), p) == 0;
        }))
      out.emplace_back(path, std::move(m));
  return out;
}

std::string lora_selection_str(const LoraConfig& config) {
  std::string s = config.target_modules_regex.empty()
                      ? "target_modules " + join(config.target_modules)
                      : "target_modules_regex '" + config.target_modules_regex + "'";
  s += "; exclude_modules " + join(config.exclude_modules);
  if (!config.exclude_modules_regex.empty())
    s += "; exclude_modules_regex '" + config.exclude_modules_regex + "'";
  return s;
}

namespace {

// Whether `config` adapts the module `m` at `path`: exclude_modules does not name it, and
// target_modules does, or is "all-linear" and `m` is a Linear other than `output`.
bool lora_targets_module(const LoraConfig& config, const std::string& path, const Module& m,
                         const Module* output) {
  if (path.empty()) return false;
  auto names = [&](const std::vector<std::string>& entries) {
    return std::any_of(entries.begin(), entries.end(),
                       [&](const std::string& e) { return lora_target_matches(e, path); });
  };
  if (names(config.exclude_modules) || config.regex_excludes(path)) return false;
  if (config.all_linear()) return dynamic_cast<const Linear*>(&m) != nullptr && &m != output;
  if (!config.target_modules_regex.empty()) return config.regex_targets(path);
  return names(config.target_modules) && config.in_transformed_layers(path);
}

}  // namespace

std::vector<size_t> lora_entry_targets(
    const LoraConfig& config, const std::string& entry,
    const std::vector<std::pair<std::string, ModulePtr>>& modules, const Module* output,
    const std::set<const Module*>& own, const char* context,
    const std::function<std::string(const std::string&)>& of_model) {
  LoraConfig one = config;
  if (config.target_modules_regex.empty()) one.target_modules = {entry};
  // Matched without exclude_modules and layers_to_transform too: an entry they empty still names
  // modules (no typo), and the callers say when nothing is left to adapt.
  LoraConfig unexcluded = one;
  unexcluded.exclude_modules.clear();
  unexcluded.exclude_modules_regex.clear();
  unexcluded.layers_to_transform.clear();
  std::vector<size_t> out;
  bool any = false;
  for (size_t i = 0; i < modules.size(); ++i) {
    const auto& [path, m] = modules[i];
    any |= lora_targets_module(unexcluded, path, *m, output);
    if (!lora_targets_module(one, path, *m, output)) continue;
    // Another LoraModel's layer: its slots are that model's, which a layer named outright is
    // refused for (find_targets, targets); "all-linear" names no layer outright, so passes over it.
    if (one.all_linear() && dynamic_cast<const LoraLayer*>(m.get()) && !own.count(m.get()))
      continue;
    out.push_back(i);
  }
  TESSERA_CHECK(any || config.target_modules_regex.empty(), context, ": target_modules_regex '",
                entry, "' matches the whole path of no module");
  TESSERA_CHECK(any || one.all_linear(), context, ": target module '", entry,
                "' matches no module of ", of_model(entry));
  return out;
}

void check_lora_excludes(const LoraConfig& config,
                         const std::vector<std::pair<std::string, ModulePtr>>& modules,
                         const std::string& context) {
  for (const std::string& entry : config.exclude_modules) {
    const bool any = std::any_of(modules.begin(), modules.end(), [&](const auto& pm) {
      return !pm.first.empty() && lora_target_matches(entry, pm.first);
    });
    TESSERA_CHECK(any, context, ": exclude_modules entry '", entry, "' matches no module; ",
                  module_path_candidates(
                      entry.find('.') != std::string::npos ? entry : "*." + entry, modules));
  }
  if (config.exclude_modules_regex.empty()) return;
  const bool any = std::any_of(modules.begin(), modules.end(), [&](const auto& pm) {
    return !pm.first.empty() && config.regex_excludes(pm.first);
  });
  TESSERA_CHECK(any, context, ": exclude_modules_regex '", config.exclude_modules_regex,
                "' matches the whole path of no module");
}

void check_untied(Module& model, const std::string& path, const ModulePtr& module,
                  const std::string& at, bool output_projection) {
  const std::string prefix = path + ".";
  const auto own = module->named_parameters(/*recurse=*/false, /*remove_duplicate=*/false);
  for (const auto& [other, q] : model.named_parameters(/*recurse=*/true, false))
    for (const auto& [name, p] : own)
      TESSERA_CHECK(
          other.compare(0, prefix.size(), prefix) == 0 || q->stored().impl() != p->stored().impl(),
          at, ": its '", name, "' is tied to '", other,
          "', which would go on reading the original; untie them first");
  const auto* decoder = dynamic_cast<const Decoder*>(&model);
  TESSERA_CHECK(output_projection || !decoder || !decoder->config().tie_embeddings ||
                    module != std::static_pointer_cast<Module>(decoder->tok_embeddings),
                at,
                " is tied to the Decoder's output projection (tie_embeddings), which reads "
                "its weight outside its forward and would go on reading the original");
}

bool is_tied_output_table(const Module& model, const Module& module) {
  const auto* decoder = dynamic_cast<const Decoder*>(&model);
  return decoder && decoder->config().tie_embeddings && decoder->tok_embeddings.get() == &module;
}

void check_tied_target(const LoraConfig& config, const std::string& path, const char* context) {
  TESSERA_CHECK(config.ensure_weight_tying, context, ": '", path,
                "' is also the Decoder's output projection (tie_embeddings); set "
                "LoraConfig::ensure_weight_tying (PEFT's) so that its adapter applies to both "
                "uses, or leave it out of target_modules");
  TESSERA_CHECK(!config.use_dora, context, ": '", path,
                "' is also the Decoder's output projection (tie_embeddings), where DoRA is not "
                "built; adapt it with LoRA");
}

// The Linears and Embeddings `config` adapts among `modules`, in the model's order; an error
// names a target or exclude entry that matches nothing, and a match that cannot be wrapped.
std::vector<std::pair<std::string, ModulePtr>> find_targets(
    Module& model, const LoraConfig& config,
    const std::vector<std::pair<std::string, ModulePtr>>& modules) {
  auto of_model = [&](const std::string& entry) {
    return model.type_name() + "; " +
           module_path_candidates(entry.find('.') != std::string::npos ? entry : "*." + entry,
                                  modules);
  };
  const Module* output = lora_output_layer(model);
  std::vector<bool> targeted(modules.size(), false);
  for (const std::string& entry : config.target_entries())
    for (size_t i : lora_entry_targets(config, entry, modules, output, {}, "apply_lora", of_model))
      targeted[i] = true;
  check_lora_excludes(config, modules, "apply_lora");
  std::vector<std::pair<std::string, ModulePtr>> found;
  for (size_t i = 0; i < modules.size(); ++i) {
    if (!targeted[i]) continue;
    const auto& [path, m] = modules[i];
    auto linear = std::dynamic_pointer_cast<Linear>(m);
    auto table = std::dynamic_pointer_cast<Embedding>(m);
    TESSERA_CHECK(linear || table, "apply_lora: target_modules match '", path, "', a ",
                  m->type_name(), ", not a Linear or an Embedding");
    TESSERA_CHECK(std::dynamic_pointer_cast<LoraLayer>(m) == nullptr, "apply_lora: '", path,
                  "' already has LoRA slots; add adapters with LoraModel::add_adapter");
    TESSERA_CHECK(std::dynamic_pointer_cast<TokenEmbedding>(m) == nullptr, "apply_lora: '", path,
                  "' has trainable tokens of an earlier apply_lora; a table either has LoRA "
                  "adapters or trainable tokens");
    // The wrapper takes the weight over; an FSDP group would go on gathering the old one.
    TESSERA_CHECK(!is_fully_sharded(linear ? linear->weight : table->weight), "apply_lora: '", path,
                  "' is already sharded by fully_shard; apply LoRA before fully_shard (adapters "
                  "can still be added after it, into the slots LoraSlots preallocates)");
    // An adapter changes the table's lookups, not another module's reads of the same weight,
    // which a merge would then change too.
    if (table) {
      const bool tied = is_tied_output_table(model, *m);
      if (tied) check_tied_target(config, path, "apply_lora");
      check_untied(model, path, m,
                   "apply_lora: '" + path + "' (" + m->type_name() + ", a LoRA target)",
                   /*output_projection=*/tied);
    }
    found.emplace_back(path, m);
  }
  TESSERA_CHECK(!found.empty() || !config.has_targets(), "apply_lora: no module of ",
                model.type_name(), " is left to adapt (", lora_selection_str(config), ")");
  return found;
}

// max_rank 0 is the first adapter's largest r over the layers it adapts (rank_pattern gives
// them their own), or its r where it adapts none (trainable tokens alone: no layer holds slots
// then, but a LoraSlots keeps one meaning); every layer's r must fit the slots.
LoraSlots resolve_slots(const LoraSlots& slots, const LoraConfig& config, const std::string& name,
                        const std::vector<std::pair<std::string, ModulePtr>>& found) {
  LoraSlots s = slots;
  if (s.max_rank == 0)
    for (const auto& [path, linear] : found)
      s.max_rank = std::max(s.max_rank, config.rank_for(path));
  if (s.max_rank == 0) s.max_rank = config.r;
  TESSERA_CHECK(s.max_adapters >= 1, "apply_lora: slots for ", s.max_adapters,
                " adapters cannot hold adapter '", name, "'");
  for (const auto& [path, linear] : found)
    TESSERA_CHECK(config.rank_for(path) <= s.max_rank, "apply_lora: slots of rank ", s.max_rank,
                  " cannot hold adapter '", name, "' of rank ", config.rank_for(path), " at '",
                  path, "'");
  return s;
}

}  // namespace tessera
