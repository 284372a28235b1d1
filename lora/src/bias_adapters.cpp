#include "bias_adapters.h"

#include <set>

#include "tessera/core/error.h"

namespace tessera {

std::vector<LoraRouting::BiasAdapter> other_bias_adapters(Module& model, const LoraRouting* own) {
  std::vector<LoraRouting::BiasAdapter> out;
  std::set<const LoraRouting*> seen{own};
  for (const auto& [path, m] : model.named_modules()) {
    auto l = std::dynamic_pointer_cast<LoraLayer>(m);
    if (!l || !l->routing() || !seen.insert(l->routing().get()).second) continue;
    if (l->routing()->bias_adapters)
      for (auto& b : l->routing()->bias_adapters())
        out.push_back(std::move(b));
  }
  return out;
}

void refuse_second_bias_mode(const std::string& context, const LoraConfig& config,
                             const std::vector<LoraRouting::BiasAdapter>& others) {
  if (config.bias == "none" || others.empty()) return;
  std::vector<std::string> names;
  for (const auto& b : others)
    names.push_back(b.name + " (bias \"" + b.bias + "\")");
  TESSERA_FAIL(context, ": bias \"", config.bias,
               "\" would train the base biases, which every adapter shares and adapter ",
               join(names),
               " of another LoraModel on this model trains already; set bias \"none\" for one "
               "of them");
}

}  // namespace tessera
