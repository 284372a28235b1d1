#pragma once
// Base biases are shared by every adapter on a model, also by adapters of two LoraModels that
// apply_lora made on the same model: what each LoraModel trains of them, seen from the others.
#include <string>
#include <vector>

#include "tessera/lora/config.h"
#include "tessera/lora/lora_layer.h"

namespace tessera {

// The bias adapters (LoraRouting::bias_adapters) of the LoraModels on `model`, but the one whose
// layers share `own` (null: every one).
std::vector<LoraRouting::BiasAdapter> other_bias_adapters(Module& model, const LoraRouting* own);

// Refuses, "<context>: bias ... which adapter <other> of another LoraModel on this model trains
// already", a `config` whose bias mode is not "none" beside `others` (other_bias_adapters):
// both would train the same tensors, and each adapter's file would carry the other's changes.
void refuse_second_bias_mode(const std::string& context, const LoraConfig& config,
                             const std::vector<LoraRouting::BiasAdapter>& others);

}  // namespace tessera
