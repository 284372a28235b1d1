// modules_to_save: the copies, and how a saved module computes with them.
#include "saved_module.h"

#include <algorithm>

#include "targets.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/core/factory.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/nn/transformer.h"

namespace tessera {

namespace {

Parameter zero_copy(const Parameter& own) {
  Tensor local = zeros_like(own.stored());
  if (!own.is_dtensor()) return Parameter(local, /*requires_grad=*/false);
  return Parameter(DTensor(own.stored_dtensor().spec_ptr(), local), /*requires_grad=*/false);
}

}  // namespace

SavedCopy::SavedCopy(const std::vector<std::pair<std::string, Parameter*>>& own)
    : Module("SavedCopy") {
  for (const auto& [name, p] : own) {
    values_.push_back(std::make_unique<Parameter>(zero_copy(*p)));
    register_parameter(name, values_.back().get());
  }
}

Module::StandInSet SavedCopy::stand_ins() {
  return named_parameters(/*recurse=*/false, /*remove_duplicate=*/false);
}

SavedCopies::SavedCopies(std::vector<std::shared_ptr<SavedCopy>> slots)
    : Module("SavedCopies"), slots_(std::move(slots)) {
  for (size_t i = 0; i < slots_.size(); ++i)
    register_module(std::to_string(i), slots_[i]);
}

std::vector<std::pair<std::string, Parameter*>> SavedModule::own() const {
  return module->named_parameters(/*recurse=*/false, /*remove_duplicate=*/false);
}

Module::StandInSet SavedModule::slot(int64_t k) const {
  return copies->slots().at(size_t(k))->stand_ins();
}

namespace {

// Each parameter of `to` takes its counterpart's values in `from` (same order and layouts: each
// rank copies its own piece).
void copy_values(const Module::StandInSet& from, const Module::StandInSet& to) {
  NoGradGuard no_grad;
  for (size_t i = 0; i < from.size(); ++i) {
    Tensor dst = to[i].second->stored();  // a handle on the parameter's storage
    dst.copy_(from[i].second->stored());
  }
}

}  // namespace

void SavedModule::fill(int64_t k) const {
  copy_values(own(), slot(k));
}

void SavedModule::clear(int64_t k) const {
  NoGradGuard no_grad;
  for (const auto& [name, p] : slot(k))
    p->fill_(0.0);
}

void SavedModule::write_into_module(int64_t k) const {
  copy_values(slot(k), own());
}

void SavedModule::attach(std::shared_ptr<LoraRouting> routing) const {
  module->add_module(kSavedChild, copies);
  std::vector<Module::StandInSet> sets;
  for (size_t k = 0; k < copies->slots().size(); ++k)
    sets.push_back(slot(int64_t(k)));
  // A slot whose adapter does not save this module (or none: the base model) takes the original.
  module->set_parameter_stand_ins(
      std::move(sets), [routing, used = used]() -> Module::StandInChoice {
        auto pick = [&](int64_t s) { return s >= 0 && (*used)[size_t(s)] ? s : -1; };
        if (!routing->sample_slots) return {pick(routing->active_slot)};
        std::vector<int64_t> rows;
        for (int64_t s : *routing->sample_slots)
          rows.push_back(pick(s));
        return {-1, std::move(rows)};
      });
}

void SavedModule::detach() const {
  module->clear_parameter_stand_ins();
  module->delete_module(kSavedChild);
}

std::vector<std::pair<std::string, ModulePtr>> find_saved_modules(
    const LoraConfig& config, const std::vector<std::pair<std::string, ModulePtr>>& modules) {
  std::vector<std::pair<std::string, ModulePtr>> out;
  for (const std::string& entry : config.modules_to_save) {
    bool any = false;
    for (const auto& [path, m] : modules) {
      if (!lora_target_matches(entry, path)) continue;
      any = true;
      if (std::none_of(out.begin(), out.end(), [&](const auto& o) { return o.first == path; }))
        out.emplace_back(path, m);
    }
    TESSERA_CHECK(any, "LoRA: modules_to_save entry '", entry, "' matches no module of the model");
  }
  // The model's order, whatever the entries' order.
  std::vector<std::pair<std::string, ModulePtr>> ordered;
  for (const auto& [path, m] : modules)
    if (std::any_of(out.begin(), out.end(), [&](const auto& o) { return o.first == path; }))
      ordered.emplace_back(path, m);
  return ordered;
}

std::shared_ptr<SavedModule> make_saved_module(Module& model, const std::string& path,
                                               const ModulePtr& module, int64_t slots,
                                               const std::vector<std::string>& targets) {
  const std::string at = "LoRA modules_to_save: '" + path + "' (" + module->type_name() + ")";
  TESSERA_CHECK(std::find(targets.begin(), targets.end(), path) == targets.end() &&
                    !std::dynamic_pointer_cast<LoraLayer>(module),
                at, " is adapted by LoRA; a module is either adapted or trained in full");
  TESSERA_CHECK(module->parameter_stand_ins().empty(), at,
                " is saved by an earlier apply_lora already");
  const auto children = module->named_children();
  TESSERA_CHECK(children.empty(), at, " has submodules (", children.front().first,
                "); name the modules below it that hold parameters");
  auto own = module->named_parameters(/*recurse=*/false, /*remove_duplicate=*/false);
  TESSERA_CHECK(!own.empty(), at, " has no parameters to train");
  for (const auto& [name, p] : own)
    TESSERA_CHECK(!is_fully_sharded(*p), at, " is held by fully_shard (its '", name,
                  "'); apply LoRA before fully_shard, so that the copies are sharded alike");
  check_untied(model, path, module, at);
  auto saved = std::make_shared<SavedModule>();
  saved->path = path;
  saved->module = module;
  std::vector<std::shared_ptr<SavedCopy>> copies;
  for (int64_t k = 0; k < slots; ++k)
    copies.push_back(std::make_shared<SavedCopy>(own));
  saved->copies = std::make_shared<SavedCopies>(std::move(copies));
  saved->used = std::make_shared<std::vector<char>>(size_t(slots), 0);
  return saved;
}

}  // namespace tessera
