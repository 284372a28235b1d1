// apply_lora and the adapter operations of LoraModel.
#include "tessera/lora/lora_model.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "bias_adapters.h"
#include "saved_module.h"
#include "targets.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/factory.h"
#include "token_tables.h"

namespace tessera {

std::vector<std::string> LoraModel::adapters() const {
  std::vector<std::pair<int64_t, std::string>> v;
  for (const auto& [name, a] : adapters_)
    v.emplace_back(a.slot, name);
  std::sort(v.begin(), v.end());
  std::vector<std::string> out;
  for (auto& [slot, name] : v)
    out.push_back(name);
  return out;
}

const LoraModel::Adapter& LoraModel::find(const std::string& name, const char* op) const {
  auto it = adapters_.find(name);
  TESSERA_CHECK(it != adapters_.end(), "LoRA ", op, ": no adapter '", name,
                "' (the model has: ", adapters_.empty() ? std::string("none") : join(adapters()),
                ")");
  return it->second;
}

// The layers and tables merge and unmerge an adapter together, so its first one speaks for
// all (an adapter without targets has tables only).
bool LoraModel::merged(const Adapter& a) const {
  if (!a.layers.empty()) return layers_[a.layers.front()].second->slot(a.slot).merged;
  return !a.tokens.empty() && tokens_[a.tokens.front().first].second->merged(a.slot);
}

std::vector<std::string> LoraModel::merged_adapters() const {
  std::vector<std::string> out;
  for (const std::string& name : adapters())
    if (merged(adapters_.at(name))) out.push_back(name);
  return out;
}

const LoraConfig& LoraModel::config(const std::string& adapter) const {
  return find(adapter, "config").config;
}

std::vector<size_t> LoraModel::targets(const LoraConfig& config) const {
  std::vector<size_t> out;
  const auto modules = lora_targetable_modules(*model_);
  check_lora_excludes(config, modules, "LoRA");
  const Module* output = lora_output_layer(*model_);
  auto wrapped_at = [&](const std::string& path) {
    for (size_t i = 0; i < layers_.size(); ++i)
      if (layers_[i].first == path) return i;
    return layers_.size();
  };
  auto of_model = [](const std::string&) { return std::string("the model"); };
  std::set<const Module*> own;
  for (const auto& [path, l] : layers_)
    own.insert(&l->module());
  for (const std::string& entry : config.target_entries()) {
    std::vector<std::string> unwrapped;
    for (size_t k : lora_entry_targets(config, entry, modules, output, own, "LoRA", of_model)) {
      const size_t i = wrapped_at(modules[k].first);
      if (i == layers_.size())
        unwrapped.push_back(modules[k].first);
      else if (std::find(out.begin(), out.end(), i) == out.end())
        out.push_back(i);
    }
    // PEFT's "wq" means every wq: an adapter silently missing from some would not be that.
    TESSERA_CHECK(unwrapped.empty(), "LoRA: target module '", entry, "' names ", join(unwrapped),
                  ", where apply_lora put no slots (adapters can only go where it did: list "
                  "every module any adapter targets in apply_lora's config)");
  }
  TESSERA_CHECK(!out.empty() || !config.has_targets(),
                "LoRA: no module of the model is left to adapt (", lora_selection_str(config), ")");
  for (size_t i : out)
    if (is_tied_output_table(*model_, layers_[i].second->module()))
      check_tied_target(config, layers_[i].first, "LoRA");
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::pair<std::string, Parameter*>> LoraModel::bias_parameters(
    const LoraConfig& config, const std::vector<size_t>& layers) const {
  std::vector<std::pair<std::string, Parameter*>> out;
  if (config.bias == "lora_only") {
    for (size_t i : layers)
      if (Parameter* bias = layers_[i].second->base_bias())
        out.emplace_back(layers_[i].first + ".base_layer.bias", bias);
  } else if (config.bias == "all") {
    // PEFT's rule is the name: every parameter whose name says "bias", wherever it is, but in
    // modules_to_save, whose copies train whole and whose originals stand aside.
    std::set<const Parameter*> seen;
    for (const auto& [name, p] : model_->named_parameters()) {
      if (name.find("bias") == std::string::npos || !seen.insert(p).second) continue;
      if (in_saved_module(p)) continue;
      std::string key = name;
      for (const auto& [path, l] : layers_)
        if (l->base_bias() == p) key = path + ".base_layer.bias";
      out.emplace_back(std::move(key), p);
    }
  }
  return out;
}

// The biases are the base model's: two adapters training them would train the same tensors, and
// each adapter's file would carry the other's changes.
void LoraModel::check_bias_adapters(const std::string& name, const LoraConfig& config) const {
  refuse_second_bias_mode("LoRA add_adapter '" + name + "'", config,
                          other_bias_adapters(*model_, routing_.get()));
  if (adapters_.empty()) return;
  std::vector<std::string> with_bias;
  for (const auto& [n, a] : adapters_)
    if (a.config.bias != "none") with_bias.push_back(n + " (bias \"" + a.config.bias + "\")");
  if (config.bias != "none") with_bias.push_back(name + " (bias \"" + config.bias + "\")");
  TESSERA_CHECK(with_bias.empty(), "LoRA add_adapter '", name,
                "': a model with several adapters cannot have one that trains the base biases, "
                "which every adapter shares (as in PEFT); set bias \"none\" for ",
                join(with_bias));
}

std::vector<LoraRouting::BiasAdapter> LoraModel::bias_adapters() const {
  std::vector<LoraRouting::BiasAdapter> out;
  for (const auto& [name, a] : adapters_) {
    if (a.config.bias == "none") continue;
    LoraRouting::BiasAdapter b{name, a.config.bias, {}};
    for (const auto& [key, p] : trained_biases(a))
      b.trained.push_back(p);
    out.push_back(std::move(b));
  }
  return out;
}

std::vector<std::pair<std::string, Parameter*>> LoraModel::trained_biases(const Adapter& a) const {
  if (a.config.inference_mode) return {};
  return bias_parameters(a.config, a.layers);
}

// A slot's matrices train unless its adapter is in inference mode; a freed slot's train again, so
// that the next adapter in it does.
void LoraModel::set_trainable(const Adapter& a, bool holds) {
  for (size_t i : a.layers) {
    const bool train = !holds || !a.config.inference_mode;
    for (Parameter* p : layers_[i].second->slot_parameters(a.slot))
      p->set_requires_grad(train);
  }
  for (auto& [key, p] : trained_biases(a))
    p->set_requires_grad(holds);
  for (auto& [key, p] : token_parameters(a))
    p->set_requires_grad(!holds || !a.config.inference_mode);
}

void LoraModel::add_adapter(const std::string& name, const LoraConfig& config) {
  config.validate();
  TESSERA_CHECK(!name.empty(), "LoRA add_adapter: an adapter needs a name");
  TESSERA_CHECK(!adapters_.count(name), "LoRA add_adapter: adapter '", name,
                "' exists already (delete it first)");
  check_bias_adapters(name, config);
  TESSERA_CHECK(!config.use_dora || slots_.use_dora, "LoRA add_adapter: adapter '", name,
                "' uses DoRA but apply_lora made slots without magnitude vectors (pass "
                "LoraSlots::use_dora to apply_lora, or apply it with a DoRA adapter)");
  std::set<int64_t> used;
  for (const auto& [n, a] : adapters_)
    used.insert(a.slot);
  int64_t slot = 0;
  while (used.count(slot))
    ++slot;
  TESSERA_CHECK(slot < slots_.max_adapters, "LoRA add_adapter: all ", slots_.max_adapters,
                " adapter slots are in use (", join(adapters()),
                "; LoraSlots::max_adapters, fixed by apply_lora)");
  Adapter a;
  a.slot = slot;
  a.config = config;
  a.layers = targets(config);
  a.saved = saved_targets(config);
  a.tokens = token_targets(config);
  for (const auto& [t, ids] : a.tokens)
    TESSERA_CHECK(int64_t(ids.size()) <= tokens_[t].second->max_tokens(),
                  "LoRA add_adapter: adapter '", name, "' trains ", ids.size(), " token ids of '",
                  tokens_[t].first, "' but the slots hold at most ",
                  tokens_[t].second->max_tokens(),
                  " (LoraSlots::max_trainable_tokens, fixed by apply_lora)");
  for (size_t i : a.layers)
    TESSERA_CHECK(config.rank_for(layers_[i].first) <= slots_.max_rank,
                  "LoRA add_adapter: adapter '", name, "' has r ",
                  config.rank_for(layers_[i].first), " at '", layers_[i].first,
                  "' but the slots hold at most rank ", slots_.max_rank,
                  " (LoraSlots::max_rank, fixed by apply_lora)");
  // All or nothing: a layer that refuses (a merged slot) or fails leaves no layer holding part
  // of an adapter that adapters() does not list.
  size_t done = 0, tokens_done = 0;
  try {
    for (; done < a.layers.size(); ++done)
      layers_[a.layers[done]].second->init_slot(slot, name,
                                                config.for_module(layers_[a.layers[done]].first),
                                                layers_[a.layers[done]].first);
    for (; tokens_done < a.tokens.size(); ++tokens_done) {
      const auto& [t, ids] = a.tokens[tokens_done];
      tokens_[t].second->init_slot(slot, ids, tokens_[t].first);
    }
  } catch (...) {
    // The failing layer too, unless its slot is merged (then it refused before writing).
    for (size_t k = 0; k <= done && k < a.layers.size(); ++k) {
      LoraLayer& layer = *layers_[a.layers[k]].second;
      if (!layer.slot(slot).merged) layer.clear_slot(slot);
    }
    for (size_t k = 0; k <= tokens_done && k < a.tokens.size(); ++k) {
      TokenEmbedding& table = *tokens_[a.tokens[k].first].second;
      if (!table.merged(slot)) table.clear_slot(slot);
    }
    throw;
  }
  for (size_t i : a.saved)
    saved_[i]->fill(slot);  // PEFT's deep copy of the module as it is now
  set_trainable(a, true);
  adapters_[name] = std::move(a);
  update_saved();
}

void LoraModel::delete_adapter(const std::string& name) {
  const Adapter& a = find(name, "delete_adapter");
  // The mixed batch's ids are slots: once freed, this one would route those samples to
  // whichever adapter takes the slot next.
  if (routing_->sample_slots)
    TESSERA_CHECK(std::find(routing_->sample_slots->begin(), routing_->sample_slots->end(),
                            a.slot) == routing_->sample_slots->end(),
                  "LoRA delete_adapter '", name,
                  "': the mixed batch set with set_batch_adapters routes samples to it; set "
                  "another (or clear it with set_batch_adapters(Tensor())) first");
  // Freed while merged, the slot would leave its values in the base weight for good.
  if (merged(a)) unmerge_adapter(name);
  for (size_t i : a.layers)
    layers_[i].second->clear_slot(a.slot);
  for (size_t i : a.saved)
    saved_[i]->clear(a.slot);
  for (const auto& [t, ids] : a.tokens)
    tokens_[t].second->clear_slot(a.slot);
  set_trainable(a, false);
  adapters_.erase(name);
  update_saved();
  if (active_ != name) return;
  // As PEFT: the first remaining adapter by name (its deterministic choice) becomes active, with
  // a warning, so that a model with an active adapter keeps one; with none left, none is.
  const std::string next = adapters_.empty() ? std::string() : adapters_.begin()->first;
  set_adapter(next);
  if (next.empty()) return;
  const std::string line = "[rank " + std::to_string(world_rank()) + "] tessera: LoRA adapter '" +
                           name + "' was active and is now deleted; the active adapter is now '" +
                           next + "'\n";
  std::fputs(line.c_str(), stderr);
}

void LoraModel::set_adapter(const std::string& name) {
  const int64_t slot = name.empty() ? -1 : find(name, "set_adapter").slot;
  // A merged adapter is in the weight of every sample's layer: it would apply under `name` too.
  for (const std::string& m : merged_adapters())
    if (m != name) unmerge_adapter(m);
  routing_->active_slot = slot;
  active_ = name;
}

std::map<std::string, int64_t> LoraModel::adapter_slots() const {
  std::map<std::string, int64_t> out;
  for (const auto& [name, adapter] : adapters_)
    out[name] = adapter.slot;
  return out;
}

DisabledAdapters::DisabledAdapters(LoraModel& model)
    : model_(model), active_(model.active_), sample_slots_(model.routing_->sample_slots) {
  model_.set_adapter("");
  slots_ = model_.adapter_slots();
  model_.routing_->sample_slots.reset();
  model_.routing_->masks.clear();
}

DisabledAdapters::~DisabledAdapters() {
  // Restored only onto the state the guard made: the same adapters in the same slots (a slot's
  // id could name another adapter now), none active and no mixed batch set since. Then nothing
  // is merged (only the active adapter merges), so set_adapter neither communicates nor throws.
  const bool untouched =
      model_.active_.empty() && !model_.routing_->sample_slots && model_.adapter_slots() == slots_;
  if (!untouched) return;
  if (!active_.empty()) model_.set_adapter(active_);
  model_.routing_->masks.clear();
  model_.routing_->sample_slots = sample_slots_;
}

int64_t LoraModel::adapter_id(const std::string& name) const {
  return find(name, "adapter_id").slot;
}

void LoraModel::set_batch_adapters(const Tensor& ids) {
  if (!ids.defined()) {
    routing_->masks.clear();
    routing_->sample_slots.reset();
    return;
  }
  TESSERA_CHECK(ids.dtype() == DType::Int64 && ids.dim() == 1,
                "LoRA set_batch_adapters: ids must be int64 [rows], got ", ids.str());
  const std::vector<std::string> merged = merged_adapters();
  TESSERA_CHECK(merged.empty(), "LoRA set_batch_adapters: '", join(merged),
                "' is merged into the base weights and would apply to every sample; call "
                "unmerge_adapter first");
  std::vector<int64_t> host = ids.to_vector<int64_t>();  // once per batch, not per layer
  for (int64_t id : host) {
    bool known = id == -1;
    for (const auto& [n, a] : adapters_)
      known |= a.slot == id;
    TESSERA_CHECK(known, "LoRA set_batch_adapters: id ", id, " is no adapter's (", join(adapters()),
                  " have ids from adapter_id(); -1 is the base model)");
    for (const auto& [n, a] : adapters_)
      TESSERA_CHECK(a.slot != id || !a.config.use_dora, "LoRA set_batch_adapters: adapter '", n,
                    "' (id ", id,
                    ") uses DoRA, which mixed batches do not run (PEFT refuses DoRA with "
                    "adapter_names too)");
  }
  routing_->masks.clear();
  routing_->sample_slots = std::move(host);
}

void LoraModel::set_batch_adapters(const std::vector<std::string>& adapter_names) {
  std::vector<int64_t> ids;
  for (const std::string& name : adapter_names)
    ids.push_back(name == "__base__" ? -1 : find(name, "set_batch_adapters").slot);
  set_batch_adapters(from_vector<int64_t>(ids, {int64_t(ids.size())}));
}

void LoraModel::set_requires_grad(const std::vector<std::string>& names, bool requires_grad) {
  for (const std::string& name : names)
    find(name, "set_requires_grad");
  for (const std::string& name : names) {
    Adapter& a = adapters_.at(name);
    set_trainable(a, false);  // the biases a mode trained freeze; trained again below if asked
    a.config.inference_mode = !requires_grad;
    set_trainable(a, true);
  }
  update_saved();
}

std::vector<Parameter*> LoraModel::adapter_parameters(const std::string& name) {
  const Adapter& a = find(name, "adapter_parameters");
  std::vector<Parameter*> out;
  for (size_t i : a.layers)
    for (Parameter* p : layers_[i].second->slot_parameters(a.slot, a.config.use_dora))
      out.push_back(p);
  for (auto& [key, p] : trained_biases(a))
    out.push_back(p);
  for (auto& [key, p] : saved_parameters(a))
    out.push_back(p);
  for (auto& [key, p] : token_parameters(a))
    out.push_back(p);
  return out;
}

std::vector<Parameter*> LoraModel::parameters() {
  std::vector<Parameter*> out;
  for (auto& [path, l] : layers_)
    for (int64_t s = 0; s < l->num_slots(); ++s)
      for (Parameter* p : l->slot_parameters(s))
        out.push_back(p);
  for (const auto& [name, a] : adapters_)
    for (auto& [key, p] : trained_biases(a))
      out.push_back(p);
  for (const auto& s : saved_)
    for (int64_t k = 0; k < slots_.max_adapters; ++k)
      for (auto& [n, p] : s->slot(k))
        out.push_back(p);
  for (const auto& [path, t] : tokens_)
    for (int64_t k = 0; k < t->num_slots(); ++k)
      out.push_back(&t->trainable_tokens_delta(k));
  return out;
}

std::pair<int64_t, int64_t> LoraModel::get_nb_trainable_parameters() const {
  int64_t trainable = 0, all = 0;
  for (const auto& [name, p] : model_->named_parameters()) {
    const int64_t n = shape_numel(p->global_shape());
    all += n;
    if (p->requires_grad()) trainable += n;
  }
  return {trainable, all};
}

namespace {

std::string with_thousands(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

void LoraModel::print_trainable_parameters(std::ostream& out) const {
  const auto [trainable, all] = get_nb_trainable_parameters();
  char percent[32];
  std::snprintf(percent, sizeof(percent), "%.4f",
                all == 0 ? 0.0 : 100.0 * double(trainable) / double(all));
  out << "trainable params: " << with_thousands(trainable)
      << " || all params: " << with_thousands(all) << " || trainable%: " << percent << "\n";
}

std::shared_ptr<LoraModel> apply_lora(const ModulePtr& model, const LoraConfig& config,
                                      const std::string& adapter_name, const LoraSlots& slots) {
  TESSERA_CHECK(model != nullptr, "apply_lora: null model");
  config.validate();
  const std::vector<LoraRouting::BiasAdapter> earlier = other_bias_adapters(*model, nullptr);
  refuse_second_bias_mode("apply_lora: adapter '" + adapter_name + "'", config, earlier);
  const auto modules = lora_targetable_modules(*model);
  // Every target resolved before anything changes; the layers in the model's order.
  const std::vector<std::pair<std::string, ModulePtr>> found =
      find_targets(*model, config, modules);
  LoraSlots s = resolve_slots(slots, config, adapter_name, found);
  s.use_dora |= config.use_dora;
  std::shared_ptr<LoraModel> lm(new LoraModel());
  lm->model_ = model;
  lm->routing_ = std::make_shared<LoraRouting>();
  lm->routing_->bias_adapters = [weak = std::weak_ptr<LoraModel>(lm)] {
    auto self = weak.lock();
    return self ? self->bias_adapters() : std::vector<LoraRouting::BiasAdapter>();
  };
  lm->slots_ = s;
  // PEFT freezes the base model: only adapters train, those of an earlier apply_lora (its slots,
  // its copies of modules_to_save and the biases its bias mode trains) included.
  std::set<const Parameter*> adapters;
  for (const auto& b : earlier)
    adapters.insert(b.trained.begin(), b.trained.end());
  for (const auto& [path, m] : model->named_modules()) {
    if (auto l = std::dynamic_pointer_cast<LoraLayer>(m))
      for (int64_t i = 0; i < l->num_slots(); ++i)
        for (Parameter* p : l->slot_parameters(i))
          adapters.insert(p);
    if (std::dynamic_pointer_cast<SavedCopies>(m))
      for (Parameter* p : m->parameters())
        adapters.insert(p);
    if (auto t = std::dynamic_pointer_cast<TokenEmbedding>(m))
      for (int64_t i = 0; i < t->num_slots(); ++i)
        adapters.insert(&t->trainable_tokens_delta(i));
  }
  // The wrappers and copies are all made before the model changes: one that cannot be made
  // leaves the model unfrozen and unwrapped.
  std::vector<std::string> target_paths;
  for (auto& [path, m] : found) {
    if (auto linear = std::dynamic_pointer_cast<Linear>(m))
      lm->layers_.emplace_back(path, std::make_shared<LoraLinear>(*linear, s, lm->routing_));
    else
      lm->layers_.emplace_back(
          path, std::make_shared<LoraEmbedding>(dynamic_cast<Embedding&>(*m), s, lm->routing_));
    target_paths.push_back(path);
  }
  std::vector<std::string> saved_paths;
  for (const auto& [path, m] : find_saved_modules(config, modules)) {
    lm->saved_.push_back(make_saved_module(*model, path, m, s.max_adapters, target_paths));
    saved_paths.push_back(path);
  }
  const auto tables = find_token_tables(*model, config, modules, target_paths, saved_paths);
  const int64_t max_tokens = tables.empty() ? 0 : resolve_max_tokens(slots, config);
  for (const auto& [path, table] : tables)
    lm->tokens_.emplace_back(
        path, std::make_shared<TokenEmbedding>(*table, s.max_adapters, max_tokens, lm->routing_));
  for (auto& [path, p] : model->named_parameters())
    if (!adapters.count(p)) p->set_requires_grad(false);
  for (auto& [path, l] : lm->layers_)
    model->replace_submodule(path, l->module_ptr());
  for (auto& [path, t] : lm->tokens_)
    model->replace_submodule(path, t);
  for (const auto& saved : lm->saved_)
    saved->attach(lm->routing_);
  lm->add_adapter(adapter_name, config);
  lm->set_adapter(adapter_name);
  return lm;
}

}  // namespace tessera
