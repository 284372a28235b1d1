#include "tessera/lora/config.h"

#include <cmath>

#include "tessera/core/error.h"
#include "tessera/nn/module_path.h"

namespace tessera {

double LoraConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(double(r)) : lora_alpha / double(r);
}

void LoraConfig::validate() const {
  TESSERA_CHECK(r > 0, "LoraConfig: r must be positive, got ", r);
  TESSERA_CHECK(lora_alpha > 0 && std::isfinite(lora_alpha),
                "LoraConfig: lora_alpha must be positive and finite, got ", lora_alpha);
  TESSERA_CHECK(lora_dropout >= 0 && lora_dropout < 1,
                "LoraConfig: lora_dropout must be in [0, 1), got ", lora_dropout);
  TESSERA_CHECK(!target_modules.empty(),
                "LoraConfig: target_modules is empty (name the Linear "
                "modules to adapt, e.g. {\"wq\", \"wv\"})");
  for (const std::string& t : target_modules)
    TESSERA_CHECK(!t.empty(), "LoraConfig: an empty name in target_modules");
  // PEFT's orthogonal init pairs Q's even rows (A) with its odd ones (B).
  TESSERA_CHECK(init_lora_weights != LoraInit::Orthogonal || r % 2 == 0,
                "LoraConfig: init_lora_weights \"orthogonal\" needs an even r, got ", r);
  TESSERA_CHECK(bias == "none" || bias == "all" || bias == "lora_only", "LoraConfig: bias '", bias,
                "' is not one of PEFT's \"none\", \"all\", \"lora_only\"");
}

// The path's last components, as many as the entry has: PEFT's suffix rule, patterns included.
bool lora_target_matches(const std::string& entry, const std::string& path) {
  const std::vector<std::string> want = split_module_path(entry);
  const std::vector<std::string> have = split_module_path(path);
  if (path.empty() || have.size() < want.size()) return false;
  std::string tail;
  for (size_t i = have.size() - want.size(); i < have.size(); ++i)
    tail += (tail.empty() ? "" : ".") + have[i];
  return module_path_matches(entry, tail);
}

}  // namespace tessera
