// PEFT's add_weighted_adapter for its combinations that need no random numbers: "cat", the
// factor merges "linear", "ties" and "magnitude_prune", and their "_svd" forms over the whole
// updates. The values are combined as global tensors (read_adapter, then write_adapter into the
// new slot), so the result is the same under any mesh, and each rank keeps its window of it.
#include <algorithm>
#include <cmath>
#include <optional>
#include <set>

#include "merge_tasks.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "tessera/lora/lora_model.h"

namespace tessera {

namespace {

using lora_detail::TaskMerge;

// How a combination type merges: "cat" stacks; the others merge the factors or, with `svd`,
// the updates.
struct Combination {
  bool cat = false;
  bool svd = false;
  TaskMerge merge = TaskMerge::Arithmetic;
};

std::optional<Combination> combination_of(const std::string& type) {
  if (type == "cat") return Combination{.cat = true};
  // "svd" is "linear"'s SVD form; the others name theirs with "_svd" ("linear_svd" is none).
  const bool with_svd = type == "svd" || (type.ends_with("_svd") && type != "linear_svd");
  const std::string base = type == "svd" ? "linear"
                           : with_svd    ? type.substr(0, type.size() - 4)
                                         : type;
  if (base == "linear") return Combination{.svd = with_svd, .merge = TaskMerge::Arithmetic};
  if (base == "ties") return Combination{.svd = with_svd, .merge = TaskMerge::Ties};
  if (base == "dare_linear") return Combination{.svd = with_svd, .merge = TaskMerge::DareLinear};
  if (base == "dare_ties") return Combination{.svd = with_svd, .merge = TaskMerge::DareTies};
  if (base == "magnitude_prune")
    return Combination{.svd = with_svd, .merge = TaskMerge::MagnitudePrune};
  return std::nullopt;
}

std::vector<double> host_values(const Tensor& t) {
  return t.to(Device::cpu()).to(DType::Float64).contiguous().to_vector<double>();
}

// One layer's adapters present there: A_i [r_i, in], B_i [out, r_i], scale s_i and weight w_i.
struct LayerSources {
  std::vector<Tensor> a, b;
  std::vector<double> scale, weight;
};

// The merged A [k, in] and B [out, k] of one layer, float64 on the host. The factor merges
// weight A_i by sign(w_i s_i) sqrt(|w_i s_i|) and B_i by sqrt(|w_i s_i|) (PEFT's: the sign on
// one side only, so that one adapter's update is w s B A); the "_svd" forms merge the updates
// s_i B_i A_i with weights w_i and factor the result.
std::pair<Tensor, Tensor> merged_factors(const Combination& how, const LayerSources& in, int64_t k,
                                         const WeightedAdapterOptions& options, uint64_t seed) {
  Generator gen(seed);
  const lora_detail::MergeOptions merge{.density = options.density.value_or(1.0),
                                        .by_frequency = options.majority_sign_method == "frequency",
                                        .gen = &gen};
  const int64_t rows = in.b.front().size(0), cols = in.a.front().size(1);
  if (!how.svd) {
    std::vector<std::vector<double>> as, bs;
    std::vector<double> wa, wb;
    for (size_t i = 0; i < in.a.size(); ++i) {
      const double ws = in.weight[i] * in.scale[i];
      wb.push_back(std::sqrt(std::abs(ws)));
      wa.push_back(ws < 0 ? -wb.back() : wb.back());
      as.push_back(host_values(in.a[i]));
      bs.push_back(host_values(in.b[i]));
    }
    return {from_vector<double>(lora_detail::merge_tasks(how.merge, as, wa, merge), {k, cols}),
            from_vector<double>(lora_detail::merge_tasks(how.merge, bs, wb, merge), {rows, k})};
  }
  if (how.merge == lora_detail::TaskMerge::Arithmetic) {
    // "svd": sum_i w_i s_i B_i A_i is [w_1 s_1 B_1, ...] times [A_1; ...], factored as such
    // without the [out, in] update (a 4096 x 4096 layer's would be 128 MiB and a long SVD).
    std::vector<Tensor> bs, as;
    for (size_t i = 0; i < in.a.size(); ++i) {
      bs.push_back(mul(in.b[i].to(Device::cpu()).to(DType::Float64), in.weight[i] * in.scale[i]));
      as.push_back(in.a[i].to(Device::cpu()).to(DType::Float64));
    }
    const Tensor b_cat = cat(bs, 1), a_cat = cat(as, 0);
    auto [b, a] = lora_detail::svd_factors_of_product(host_values(b_cat), host_values(a_cat), rows,
                                                      b_cat.size(1), cols, k, options.svd_clamp);
    return {from_vector<double>(a, {k, cols}), from_vector<double>(b, {rows, k})};
  }
  std::vector<std::vector<double>> deltas;
  for (size_t i = 0; i < in.a.size(); ++i)
    deltas.push_back(host_values(mul(matmul(in.b[i].to(Device::cpu()).to(DType::Float64),
                                            in.a[i].to(Device::cpu()).to(DType::Float64)),
                                     in.scale[i])));
  const std::vector<double> delta = lora_detail::merge_tasks(how.merge, deltas, in.weight, merge);
  auto [b, a] = lora_detail::svd_factors(delta, rows, cols, k, options.svd_clamp);
  return {from_vector<double>(a, {k, cols}), from_vector<double>(b, {rows, k})};
}

}  // namespace

void LoraModel::add_weighted_adapter(const std::vector<std::string>& adapters,
                                     const std::vector<double>& weights,
                                     const std::string& adapter_name,
                                     const std::string& combination_type,
                                     const WeightedAdapterOptions& options) {
  const char* op = "add_weighted_adapter";
  TESSERA_CHECK(!adapters_.count(adapter_name), "LoRA add_weighted_adapter: adapter '",
                adapter_name,
                "' exists already (PEFT returns without a word); delete it or pick another name");
  TESSERA_CHECK(!adapters.empty() && adapters.size() == weights.size(),
                "LoRA add_weighted_adapter: ", adapters.size(), " adapters (", join(adapters),
                ") and ", weights.size(), " weights: one weight each");
  // One adapter can only be scaled, as in PEFT.
  const std::string type = adapters.size() == 1 ? "linear" : combination_type;
  const std::optional<Combination> how = combination_of(type);
  TESSERA_CHECK(how.has_value(), "LoRA add_weighted_adapter: combination_type '", type,
                "' is no combination type; \"cat\", \"linear\", \"svd\", \"ties\", "
                "\"ties_svd\", \"dare_linear\", \"dare_linear_svd\", \"dare_ties\", "
                "\"dare_ties_svd\", \"magnitude_prune\" and \"magnitude_prune_svd\" are");
  const bool dare = how->merge == TaskMerge::DareLinear || how->merge == TaskMerge::DareTies;
  TESSERA_CHECK(how->merge == TaskMerge::Arithmetic || (options.density && *options.density >= 0),
                "LoRA add_weighted_adapter: \"", type, "\" prunes and needs a density >= 0 (",
                options.density ? std::to_string(*options.density) : std::string("none given"),
                ")");
  // PEFT's would divide every kept value by 0.
  TESSERA_CHECK(!dare || *options.density > 0, "LoRA add_weighted_adapter: \"", type,
                "\" with density 0 keeps nothing and rescales by 1 / 0");
  TESSERA_CHECK(
      options.majority_sign_method == "total" || options.majority_sign_method == "frequency",
      "LoRA add_weighted_adapter: majority_sign_method '", options.majority_sign_method,
      "' is neither \"total\" nor \"frequency\"");
  TESSERA_CHECK(!options.svd_rank || *options.svd_rank >= 1, "LoRA add_weighted_adapter: svd_rank ",
                options.svd_rank.value_or(0), " is not a rank");
  TESSERA_CHECK(!options.svd_clamp || (*options.svd_clamp >= 0 && *options.svd_clamp <= 1),
                "LoRA add_weighted_adapter: svd_clamp ", options.svd_clamp.value_or(0),
                " is not a quantile in [0, 1]");
  std::vector<const Adapter*> src;
  for (size_t i = 0; i < adapters.size(); ++i) {
    src.push_back(&find(adapters[i], op));
    TESSERA_CHECK(!src.back()->config.use_dora, "LoRA add_weighted_adapter: adapter '", adapters[i],
                  "' uses DoRA, whose magnitude no combination here accounts for");
    TESSERA_CHECK(src.back()->tokens.empty(), "LoRA add_weighted_adapter: adapter '", adapters[i],
                  "' has trainable tokens, which PEFT's combinations leave out (only the LoRA "
                  "matrices combine)");
  }
  // Each adapter's rank is its largest, rank_pattern included (PEFT's: the new adapter must
  // hold every layer's); "cat" sums them, the others take the largest.
  int64_t new_rank = 0;
  for (const Adapter* a : src) {
    int64_t r = a->config.r;
    for (const auto& [key, pattern_r] : a->config.rank_pattern)
      r = std::max(r, pattern_r);
    new_rank = how->cat ? new_rank + r : std::max(new_rank, r);
  }
  if (how->svd && options.svd_rank) new_rank = *options.svd_rank;
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
    for (size_t i = 0; i < src.size(); ++i) {
      if (std::find(src[i]->layers.begin(), src[i]->layers.end(), li) == src[i]->layers.end())
        continue;
      const int64_t r = src[i]->config.rank_for(path);
      TESSERA_CHECK(how->cat || how->svd || r == new_rank, "LoRA add_weighted_adapter: \"", type,
                    "\" needs equal ranks, but adapter '", adapters[i], "' has rank ", r, " in ",
                    path, ", not ", new_rank, " (the largest rank among them, rank_pattern's too)");
    }
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
      if (how->cat) {
        out[ka] = zeros_like(out.at(ka));
        out[kb] = zeros_like(out.at(kb));
        int64_t off = 0;
        for (size_t i = 0; i < src.size(); ++i) {
          auto ai = values[i].find(ka);
          if (ai == values[i].end()) continue;
          const int64_t r = ai->second.size(0);
          const double s = weights[i] * layer->slot(src[i]->slot).scale;
          kernels::narrow(out[ka], 0, off, r).copy_(mul(ai->second, s));
          kernels::narrow(out[kb], 1, off, r).copy_(values[i].at(kb));
          off += r;
        }
        continue;
      }
      LayerSources here;
      for (size_t i = 0; i < src.size(); ++i) {
        auto ai = values[i].find(ka);
        if (ai == values[i].end()) continue;
        here.a.push_back(ai->second);
        here.b.push_back(values[i].at(kb));
        here.scale.push_back(layer->slot(src[i]->slot).scale);
        here.weight.push_back(weights[i]);
      }
      // An SVD may differ in its last bits between processes (threads, vector units): it runs
      // on rank 0 alone, whose factors every rank then takes.
      const bool mine = !how->svd || world_rank() == 0;
      auto [a, b] = mine ? merged_factors(*how, here, new_rank, options,
                                          lora_slot_seed(options.seed, adapter_name, path))
                         : std::pair{zeros({new_rank, out.at(ka).size(1)}, DType::Float64),
                                     zeros({out.at(kb).size(0), new_rank}, DType::Float64)};
      if (how->svd && world_size() > 1) {
        world_group()->broadcast(a, 0)->wait();
        world_group()->broadcast(b, 0)->wait();
      }
      out[ka] = a.to(out.at(ka).dtype());
      out[kb] = b.to(out.at(kb).dtype());
    }
    write_adapter(adapter_name, out);
    set_requires_grad({adapter_name}, false);
  } catch (...) {
    delete_adapter(adapter_name);
    throw;
  }
}

}  // namespace tessera
