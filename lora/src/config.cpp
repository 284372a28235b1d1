#include "tessera/lora/config.h"

#include <cmath>

#include "tessera/core/error.h"

namespace tessera {

double LoraConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(double(r)) : lora_alpha / double(r);
}

void LoraConfig::validate() const {
  TESSERA_CHECK(r > 0, "LoraConfig: r must be positive, got ", r);
  TESSERA_CHECK(lora_alpha > 0, "LoraConfig: lora_alpha must be positive, got ", lora_alpha);
  TESSERA_CHECK(lora_dropout >= 0 && lora_dropout < 1,
                "LoraConfig: lora_dropout must be in [0, 1), got ", lora_dropout);
  TESSERA_CHECK(!target_modules.empty(),
                "LoraConfig: target_modules is empty (name the Linear "
                "modules to adapt, e.g. {\"wq\", \"wv\"})");
  for (const std::string& t : target_modules)
    TESSERA_CHECK(!t.empty(), "LoraConfig: an empty name in target_modules");
  TESSERA_CHECK(bias == "none", "LoraConfig: bias '", bias,
                "' is not supported; only \"none\" (the base biases stay frozen)");
}

}  // namespace tessera
