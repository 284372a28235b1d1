#pragma once
// LoRA adapters: LoraConfig, LoraLinear, LoraEmbedding, TokenEmbedding (trainable tokens),
// apply_lora and LoraModel (adapters, routing, merge, PEFT files).
#include "tessera/lora/config.h"
#include "tessera/lora/lora_embedding.h"
#include "tessera/lora/lora_linear.h"
#include "tessera/lora/lora_model.h"
#include "tessera/lora/token_embedding.h"
