// LoraModel's side of modules_to_save: which adapter saves which module, and what trains.
#include <algorithm>

#include "saved_module.h"
#include "tessera/lora/lora_model.h"

namespace tessera {

std::vector<size_t> LoraModel::saved_targets(const LoraConfig& config) const {
  std::vector<size_t> out;
  for (const std::string& entry : config.modules_to_save) {
    bool any = false;
    for (size_t i = 0; i < saved_.size(); ++i)
      if (lora_target_matches(entry, saved_[i]->path)) {
        any = true;
        if (std::find(out.begin(), out.end(), i) == out.end()) out.push_back(i);
      }
    if (any) continue;
    // Distinguish a typo from a module apply_lora was not told about.
    bool in_model = false;
    for (const auto& [path, m] : model_->named_modules())
      in_model |= lora_target_matches(entry, path);
    TESSERA_CHECK(!in_model, "LoRA: modules_to_save entry '", entry,
                  "' names a module apply_lora made no copies for (an adapter can only save "
                  "modules the first adapter's modules_to_save named)");
    TESSERA_FAIL("LoRA: modules_to_save entry '", entry, "' matches no module of the model");
  }
  std::sort(out.begin(), out.end());
  return out;
}

void LoraModel::update_saved() {
  for (const auto& s : saved_) {
    std::fill(s->used->begin(), s->used->end(), 0);
    for (int64_t k = 0; k < int64_t(s->used->size()); ++k)
      for (const auto& [name, p] : s->slot(k))
        p->set_requires_grad(false);
  }
  for (const auto& [name, a] : adapters_)
    for (size_t i : a.saved) {
      (*saved_[i]->used)[size_t(a.slot)] = 1;
      for (const auto& [n, p] : saved_[i]->slot(a.slot))
        p->set_requires_grad(!a.config.inference_mode);
    }
}

std::vector<std::pair<std::string, Parameter*>> LoraModel::saved_parameters(
    const Adapter& a) const {
  std::vector<std::pair<std::string, Parameter*>> out;
  for (size_t i : a.saved)
    for (const auto& [name, p] : saved_[i]->slot(a.slot))
      out.emplace_back(saved_[i]->path + "." + name, p);
  return out;
}

bool LoraModel::in_saved_module(const Parameter* p) const {
  for (const auto& s : saved_) {
    for (const auto& [name, own] : s->own())
      if (own == p) return true;
    for (int64_t k = 0; k < int64_t(s->used->size()); ++k)
      for (const auto& [name, c] : s->slot(k))
        if (c == p) return true;
  }
  return false;
}

}  // namespace tessera
