// PEFT's add_weighted_adapter for its two exact combinations, "cat" and "linear". The values are
// combined as global tensors (read_adapter, then write_adapter into the new slot), so the result
// is the same under any mesh, and each rank keeps its window of it.
#include <algorithm>
#include <cmath>
#include <set>

#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "tessera/lora/lora_model.h"

namespace tessera {

namespace {

// PEFT's combination types that need an SVD or a pruning of the updates.
bool peft_only(const std::string& type) {
  static const std::set<std::string> kTypes = {"svd",
                                               "ties",
                                               "ties_svd",
                                               "dare_linear",
                                               "dare_ties",
                                               "dare_linear_svd",
                                               "dare_ties_svd",
                                               "magnitude_prune",
                                               "magnitude_prune_svd"};
  return kTypes.count(type) > 0;
}

}  // namespace

void LoraModel::add_weighted_adapter(const std::vector<std::string>& adapters,
                                     const std::vector<double>& weights,
                                     const std::string& adapter_name,
                                     const std::string& combination_type) {
  const char* op = "add_weighted_adapter";
  TESSERA_CHECK(!adapters_.count(adapter_name), "LoRA add_weighted_adapter: adapter '",
                adapter_name,
                "' exists already (PEFT returns without a word); delete it or pick another name");
  TESSERA_CHECK(!adapters.empty() && adapters.size() == weights.size(),
                "LoRA add_weighted_adapter: ", adapters.size(), " adapters (", join(adapters),
                ") and ", weights.size(), " weights: one weight each");
  // One adapter can only be scaled, as in PEFT.
  const std::string type = adapters.size() == 1 ? "linear" : combination_type;
  TESSERA_CHECK(type == "cat" || type == "linear", "LoRA add_weighted_adapter: combination_type '",
                type, "' ",
                peft_only(type) ? "is PEFT's but not built here" : "is no combination type",
                "; \"cat\" and \"linear\" are");
  std::vector<const Adapter*> src;
  for (size_t i = 0; i < adapters.size(); ++i) {
    src.push_back(&find(adapters[i], op));
    TESSERA_CHECK(!src.back()->config.use_dora, "LoRA add_weighted_adapter: adapter '", adapters[i],
                  "' uses DoRA, whose magnitude no combination here accounts for");
    TESSERA_CHECK(src.back()->tokens.empty(), "LoRA add_weighted_adapter: adapter '", adapters[i],
                  "' has trainable tokens, which PEFT's combinations leave out (only the LoRA "
                  "matrices combine)");
    TESSERA_CHECK(type == "cat" || weights[i] >= 0, "LoRA add_weighted_adapter: weight ",
                  weights[i], " of adapter '", adapters[i],
                  "' is negative; \"linear\" scales A and B by its square root");
  }
  int64_t new_rank = 0;
  for (const Adapter* a : src)
    new_rank = type == "cat" ? new_rank + a->config.r : std::max(new_rank, a->config.r);
  TESSERA_CHECK(new_rank <= slots_.max_rank,
                "LoRA add_weighted_adapter: the combined adapter has rank ", new_rank,
                " but the slots hold at most rank ", slots_.max_rank, " (LoraSlots::max_rank)");
  // The layers any of them covers, in the model's order, each checked before anything changes.
  std::set<size_t> covered;
  for (const Adapter* a : src)
    covered.insert(a->layers.begin(), a->layers.end());
  LoraConfig config = src.front()->config;
  config.target_modules.clear();
  for (size_t li : covered) {
    const std::string& path = layers_[li].first;
    int64_t sum = 0;
    for (size_t i = 0; i < src.size(); ++i) {
      if (std::find(src[i]->layers.begin(), src[i]->layers.end(), li) == src[i]->layers.end())
        continue;
      const int64_t r = src[i]->config.rank_for(path);
      TESSERA_CHECK(type == "cat" || r == new_rank,
                    "LoRA add_weighted_adapter: \"linear\" needs equal ranks, but adapter '",
                    adapters[i], "' has rank ", r, " in ", path, ", not ", new_rank,
                    " (the largest r among them)");
      sum += r;
    }
    TESSERA_CHECK(type != "cat" || sum <= new_rank, "LoRA add_weighted_adapter: the ranks in ",
                  path, " add up to ", sum, ", past the combined rank ", new_rank,
                  " (a rank_pattern)");
    config.target_modules.push_back(path);
  }
  config.r = new_rank;
  config.lora_alpha = double(new_rank);
  config.use_rslora = false;
  config.rank_pattern.clear();
  config.alpha_pattern.clear();
  config.target_modules_regex.clear();
  config.exclude_modules.clear();
  config.exclude_modules_regex.clear();
  config.layers_to_transform.clear();
  config.layers_pattern.clear();
  // The values are written below; the init only draws what they replace (and the orthogonal
  // one would refuse an odd rank, which "cat" can make).
  config.init_lora_weights = LoraInit::Kaiming;
  std::vector<std::map<std::string, Tensor>> values;
  for (const std::string& name : adapters)
    values.push_back(read_adapter(name));
  add_adapter(adapter_name, config);
  try {
    NoGradGuard no_grad;
    std::map<std::string, Tensor> out = read_adapter(adapter_name);
    for (size_t li : covered) {
      const auto& [path, layer] = layers_[li];
      const std::string ka = path + "." + layer->adapter_key(true);
      const std::string kb = path + "." + layer->adapter_key(false);
      Tensor a = zeros_like(out.at(ka)), b = zeros_like(out.at(kb));
      int64_t off = 0;
      for (size_t i = 0; i < src.size(); ++i) {
        auto ai = values[i].find(ka);
        if (ai == values[i].end()) continue;
        const Tensor& bi = values[i].at(kb);
        const double s = weights[i] * layer->slot(src[i]->slot).scale;
        if (type == "cat") {
          const int64_t r = ai->second.size(0);
          kernels::narrow(a, 0, off, r).copy_(mul(ai->second, s));
          kernels::narrow(b, 1, off, r).copy_(bi);
          off += r;
        } else {
          a = add(a, mul(ai->second, std::sqrt(s)));
          b = add(b, mul(bi, std::sqrt(s)));
        }
      }
      out[ka] = a;
      out[kb] = b;
    }
    write_adapter(adapter_name, out);
    set_requires_grad({adapter_name}, false);
  } catch (...) {
    delete_adapter(adapter_name);
    throw;
  }
}

}  // namespace tessera
