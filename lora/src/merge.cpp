// merge_adapter, unmerge_adapter and taking the adapters out of the model (merge_and_unload,
// unload).
#include "saved_module.h"
#include "tessera/comm/agree.h"
#include "tessera/comm/runtime.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/lora/lora_model.h"

namespace tessera {

void LoraModel::merge_adapter(const std::string& name, bool safe_merge) {
  const Adapter& a = find(name, "merge_adapter");
  // Merged, an adapter applies to every sample: on top of the active adapter, or of the others
  // in a mixed batch.
  TESSERA_CHECK(name == active_, "LoRA merge_adapter '", name, "': it is not the active adapter (",
                active_.empty() ? std::string("none is") : "'" + active_ + "'",
                "), and merged it would apply to every sample on top of the active one; call "
                "set_adapter(\"",
                name, "\") first");
  TESSERA_CHECK(!routing_->sample_slots, "LoRA merge_adapter '", name,
                "': a mixed batch is set, whose every sample it would apply to once merged; "
                "clear it with set_batch_adapters(Tensor()) first");
  if (safe_merge) check_merge_is_finite(name, a);
  for (size_t i : a.layers)
    layers_[i].second->merge_slot(a.slot, /*unmerge=*/false);
  for (const auto& [t, ids] : a.tokens)
    tokens_[t].second->merge_slot(a.slot, /*unmerge=*/false);
}

// Each rank sees only its windows of the weights, so the ranks agree on the outcome; PEFT, which
// checks layer by layer while merging, leaves the layers before a broken one merged.
void LoraModel::check_merge_is_finite(const std::string& name, const Adapter& a) {
  std::vector<std::string> broken;
  for (size_t i : a.layers)
    if (!layers_[i].second->merge_is_finite(a.slot)) broken.push_back(layers_[i].first);
  for (const auto& [t, ids] : a.tokens)
    if (!tokens_[t].second->merge_is_finite(a.slot))
      broken.push_back(tokens_[t].first + " (trainable tokens)");
  const std::string context = "LoRA merge_adapter '" + name + "' (safe_merge)";
  std::string error;
  if (!broken.empty())
    error = context + ": merged, the weights of " + join(broken) +
            " would hold NaN or infinite values (the adapter seems broken); nothing was merged";
  if (world_size() > 1)
    agree(world_group(), context, error);
  else
    TESSERA_CHECK(error.empty(), error);
}

void LoraModel::unmerge_adapter(const std::string& name) {
  const Adapter& a = find(name, "unmerge_adapter");
  for (size_t i : a.layers)
    TESSERA_CHECK(layers_[i].second->can_unmerge(a.slot), "LoRA unmerge_adapter '", name,
                  "': the DoRA adapter was merged when its checkpoint was saved, and the weight "
                  "norms that undo a DoRA merge are not in a checkpoint (PEFT keeps them in "
                  "memory too); '",
                  layers_[i].first, "' stays merged");
  for (size_t i : a.layers)
    layers_[i].second->merge_slot(a.slot, /*unmerge=*/true);
  for (const auto& [t, ids] : a.tokens)
    tokens_[t].second->merge_slot(a.slot, /*unmerge=*/true);
}

// merge_and_unload and unload change the model only once every layer is known to be where
// apply_lora put it and unsharded.
void LoraModel::check_unwrappable(const char* op) const {
  for (const auto& [path, l] : layers_) {
    TESSERA_CHECK(!is_fully_sharded(l->base_weight()), "LoRA ", op, ": '", path,
                  "' is sharded by fully_shard, whose groups hold the adapter slots; call it "
                  "before fully_shard, or keep the layers (merge_adapter)");
    TESSERA_CHECK(model_->get_submodule(path) == l->module_ptr(), "LoRA ", op, ": '", path,
                  "' no longer holds the layer apply_lora put there");
  }
  for (const auto& s : saved_) {
    for (const auto& [name, p] : s->own())
      TESSERA_CHECK(!is_fully_sharded(*p), "LoRA ", op, ": '", s->path,
                    "' (modules_to_save) is sharded by fully_shard, whose groups hold its "
                    "copies; call it before fully_shard");
    TESSERA_CHECK(model_->get_submodule(s->path) == s->module, "LoRA ", op, ": '", s->path,
                  "' no longer holds the module apply_lora saved");
  }
  for (const auto& [path, t] : tokens_) {
    TESSERA_CHECK(!is_fully_sharded(t->weight), "LoRA ", op, ": '", path,
                  "' (trainable tokens) is sharded by fully_shard, whose groups hold its rows; "
                  "call it before fully_shard");
    TESSERA_CHECK(model_->get_submodule(path) == std::static_pointer_cast<Module>(t), "LoRA ", op,
                  ": '", path, "' no longer holds the table apply_lora put there");
  }
}

ModulePtr LoraModel::merge_and_unload(bool safe_merge) {
  check_unwrappable("merge_and_unload");
  if (!active_.empty() && !merged(find(active_, "merge_and_unload")))
    merge_adapter(active_, safe_merge);
  // PEFT puts the active adapter's copy of each module it saves in the module's place.
  if (!active_.empty())
    for (size_t i : adapters_.at(active_).saved)
      saved_[i]->write_into_module(adapters_.at(active_).slot);
  return unwrap();
}

ModulePtr LoraModel::unload() {
  check_unwrappable("unload");
  for (const std::string& m : merged_adapters())
    unmerge_adapter(m);
  return unwrap();
}

ModulePtr LoraModel::unwrap() {
  // The returned base model is frozen, the biases a `bias` mode trained too.
  for (const auto& [name, a] : adapters_)
    for (auto& [key, p] : trained_biases(a))
      p->set_requires_grad(false);
  for (const auto& [path, l] : layers_) {  // checked by check_unwrappable
    model_->replace_submodule(path, l->unwrapped());
    retired_.push_back(l);
  }
  layers_.clear();
  for (const auto& s : saved_)
    s->detach();
  saved_.clear();
  for (const auto& [path, t] : tokens_) {  // checked by check_unwrappable
    model_->replace_submodule(path, t->unwrapped());
    retired_tokens_.push_back(t);
  }
  tokens_.clear();
  adapters_.clear();
  active_.clear();
  routing_->active_slot = -1;
  routing_->sample_slots.reset();
  routing_->masks.clear();
  return model_;
}

}  // namespace tessera
