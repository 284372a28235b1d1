// PEFT's adapter files: adapter_model.safetensors and adapter_config.json.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <type_traits>

#include "saved_module.h"
#include "targets.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/checkpoint/safetensors.h"
#include "tessera/comm/agree.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/digest.h"
#include "tessera/core/factory.h"
#include "tessera/lora/lora_model.h"

namespace tessera {

namespace {

constexpr const char* kWeights = "adapter_model.safetensors";
constexpr const char* kConfig = "adapter_config.json";
constexpr const char* kPrefix = "base_model.model.";
// A table's rows: under LoRA's wrapper in PEFT's LoRA files and here, on the layer itself in
// PEFT's TrainableTokens files.
constexpr const char* kLoraRows = ".token_adapter.trainable_tokens_delta";
constexpr const char* kOwnRows = ".trainable_tokens_delta";

// Runs `f` on rank 0 only; every rank then throws rank 0's error, if any (nobody is left
// waiting for a rank that failed).
void on_rank0(const std::string& what, const std::function<void()>& f) {
  std::string error;
  if (world_rank() == 0) {
    try {
      f();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  ProcessGroupPtr world = world_group();
  Tensor len = full({1}, double(error.size()), DType::Int64);
  world->broadcast(len, 0)->wait();
  const int64_t n = len.item<int64_t>();
  if (n == 0) return;
  Tensor bytes = zeros({(n + 3) / 4}, DType::Int32);
  if (world_rank() == 0) std::memcpy(bytes.raw_data(), error.data(), size_t(n));
  world->broadcast(bytes, 0)->wait();
  throw Error(what +
              ": on rank 0: " + std::string(static_cast<const char*>(bytes.raw_data()), size_t(n)));
}

// A pattern as PEFT's dict, in its order (the first key that matches wins).
template <class T>
nlohmann::ordered_json pattern_json(const std::vector<std::pair<std::string, T>>& pattern) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [key, value] : pattern)
    j[key] = value;
  return j;
}

// PEFT's trainable_token_indices: its list form for the key "" alone (the input embedding, which
// PEFT finds itself), else an object of table -> ids; `tables` replaces the keys (PEFT reads
// names and dotted suffixes, not patterns), or with none they stay.
nlohmann::ordered_json tokens_json(
    const LoraConfig& c, const std::vector<std::pair<std::string, std::vector<int64_t>>>& tables) {
  const auto& t = c.trainable_token_indices;
  if (t.empty()) return nullptr;
  if (t.size() == 1 && t.front().first.empty()) return t.front().second;
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [key, ids] : tables.empty() ? t : tables)
    j[key] = ids;
  return j;
}

// `targets`, `saved` and `excluded` replace c.target_modules, c.modules_to_save and
// c.exclude_modules: PEFT reads names and dotted suffixes, not patterns.
nlohmann::ordered_json to_peft(const LoraConfig& c, const std::vector<std::string>& targets,
                               const std::vector<std::string>& saved,
                               const std::vector<std::string>& excluded,
                               const nlohmann::ordered_json& tokens) {
  nlohmann::ordered_json j;
  j["peft_type"] = "LORA";
  j["task_type"] = nullptr;
  j["r"] = c.r;
  j["lora_alpha"] = c.lora_alpha;
  j["lora_dropout"] = c.lora_dropout;
  if (c.target_modules_regex.empty())
    j["target_modules"] = targets;
  else
    j["target_modules"] = c.target_modules_regex;
  j["bias"] = c.bias;
  j["use_rslora"] = c.use_rslora;
  if (c.init_lora_weights == LoraInit::Gaussian)
    j["init_lora_weights"] = "gaussian";
  else if (c.init_lora_weights == LoraInit::Orthogonal)
    j["init_lora_weights"] = "orthogonal";
  else
    j["init_lora_weights"] = c.init_lora_weights == LoraInit::Kaiming;
  j["fan_in_fan_out"] = false;
  if (saved.empty())
    j["modules_to_save"] = nullptr;
  else
    j["modules_to_save"] = saved;
  j["base_model_name_or_path"] = nullptr;
  j["revision"] = nullptr;
  j["inference_mode"] = c.inference_mode;
  if (c.layers_to_transform.empty())
    j["layers_to_transform"] = nullptr;
  else
    j["layers_to_transform"] = c.layers_to_transform;
  if (c.layers_pattern.empty())
    j["layers_pattern"] = nullptr;
  else
    j["layers_pattern"] = c.layers_pattern;
  j["rank_pattern"] = pattern_json(c.rank_pattern);
  j["alpha_pattern"] = pattern_json(c.alpha_pattern);
  if (!c.exclude_modules_regex.empty())
    j["exclude_modules"] = c.exclude_modules_regex;
  else if (excluded.empty())
    j["exclude_modules"] = nullptr;
  else
    j["exclude_modules"] = excluded;
  j["use_dora"] = c.use_dora;
  j["trainable_token_indices"] = tokens;
  j["ensure_weight_tying"] = c.ensure_weight_tying;
  return j;
}

// An adapter of token rows alone as PEFT's TrainableTokensConfig (PEFT loads no LoRA adapter
// without targets): one token_indices for every table in target_modules, which is null (PEFT's
// default, the input embedding) for the key "" alone. `tables` are the paths the keys matched.
nlohmann::ordered_json to_peft_tokens(
    const LoraConfig& c, const std::vector<std::pair<std::string, std::vector<int64_t>>>& tables,
    const std::string& name) {
  for (const auto& [path, ids] : tables)
    TESSERA_CHECK(ids == tables.front().second, "LoRA save_adapter '", name,
                  "': an adapter of trainable tokens alone is saved as PEFT's "
                  "TrainableTokensConfig, whose one token_indices serves every table, but '",
                  tables.front().first, "' and '", path,
                  "' train different ids (name target modules too to save it as a LoRA adapter)");
  nlohmann::ordered_json j;
  j["peft_type"] = "TRAINABLE_TOKENS";
  j["task_type"] = nullptr;
  j["token_indices"] = tables.front().second;
  const bool input =
      c.trainable_token_indices.size() == 1 && c.trainable_token_indices.front().first.empty();
  std::vector<std::string> paths;
  for (const auto& [path, ids] : tables)
    paths.push_back(path);
  if (input)
    j["target_modules"] = nullptr;
  else
    j["target_modules"] = paths;
  j["init_weights"] = true;
  j["base_model_name_or_path"] = nullptr;
  j["revision"] = nullptr;
  j["inference_mode"] = c.inference_mode;
  return j;
}

// PEFT's TrainableTokensConfig as an adapter of token rows alone.
LoraConfig tokens_config_from(const nlohmann::ordered_json& j,
                              const std::function<void(std::string)>& bad) {
  LoraConfig c;
  const auto& ids = j.contains("token_indices") ? j["token_indices"] : nlohmann::ordered_json();
  if (!ids.is_array()) bad("token_indices is missing or not a list of token ids");
  std::vector<int64_t> list;
  for (const auto& e : ids) {
    if (!e.is_number_integer()) bad("token_indices holds " + e.dump() + ", not a token id");
    list.push_back(e.get<int64_t>());
  }
  const auto& t = j.contains("target_modules") ? j["target_modules"] : nlohmann::ordered_json();
  if (t.is_null()) {
    c.trainable_token_indices.emplace_back("", list);  // PEFT's: the input embedding
  } else if (t.is_array()) {
    for (const auto& e : t) {
      if (!e.is_string()) bad("target_modules holds a non-string");
      c.trainable_token_indices.emplace_back(e.get<std::string>(), list);
    }
  } else {
    bad("target_modules is " + t.dump() +
        ", not a list of module names (a regular expression is not supported for trainable "
        "tokens: name the tables)");
  }
  if (j.contains("init_weights") && !j["init_weights"].is_boolean())
    bad("init_weights is not a boolean");  // either way the file holds the rows
  return c;
}

// PEFT's trainable_token_indices: a list of ids (the input embedding: the key ""), or an object
// of module name -> ids.
void tokens_from(const nlohmann::ordered_json& j, LoraConfig& c,
                 const std::function<void(std::string)>& bad) {
  if (!j.contains("trainable_token_indices") || j["trainable_token_indices"].is_null()) return;
  const auto& t = j["trainable_token_indices"];
  auto ids_of = [&](const nlohmann::ordered_json& list, const std::string& what) {
    if (!list.is_array())
      bad("trainable_token_indices" + what + " is " + list.dump() + ", not a list of token ids");
    std::vector<int64_t> ids;
    for (const auto& e : list) {
      if (!e.is_number_integer())
        bad("trainable_token_indices" + what + " holds " + e.dump() + ", not a token id");
      ids.push_back(e.get<int64_t>());
    }
    return ids;
  };
  if (t.is_array()) {
    if (!t.empty()) c.trainable_token_indices.emplace_back("", ids_of(t, ""));
    return;
  }
  if (!t.is_object())
    bad("trainable_token_indices is " + t.dump() + ", not a list of ids or an object");
  for (const auto& [key, list] : t.items())
    c.trainable_token_indices.emplace_back(key, ids_of(list, "['" + key + "']"));
}

// PEFT's rank_pattern or alpha_pattern: an object of key -> value, read in its order.
template <class T>
std::vector<std::pair<std::string, T>> pattern_from(const nlohmann::ordered_json& j,
                                                    const char* name,
                                                    const std::function<void(std::string)>& bad) {
  std::vector<std::pair<std::string, T>> out;
  if (!j.contains(name) || j[name].is_null()) return out;
  if (!j[name].is_object()) bad(std::string(name) + " is " + j[name].dump() + ", not an object");
  for (const auto& [key, value] : j[name].items()) {
    const bool ok = std::is_integral_v<T> ? value.is_number_integer() : value.is_number();
    if (!ok)
      bad(std::string(name) + "['" + key + "'] is " + value.dump() + ", not " +
          (std::is_integral_v<T> ? "an integer" : "a number"));
    out.emplace_back(key, value.template get<T>());
  }
  return out;
}

// PEFT's exclude_modules: a list of names (as target_modules'), or a regular expression.
void excludes_from(const nlohmann::ordered_json& j, LoraConfig& c,
                   const std::function<void(std::string)>& bad) {
  if (!j.contains("exclude_modules") || j["exclude_modules"].is_null()) return;
  const auto& e = j["exclude_modules"];
  if (e.is_string()) {
    c.exclude_modules_regex = e.get<std::string>();  // "" excludes nothing, as [] or null
    return;
  }
  if (!e.is_array()) bad("exclude_modules is " + e.dump() + ", not a list or a string");
  for (const auto& x : e) {
    if (!x.is_string()) bad("exclude_modules holds a non-string");
    c.exclude_modules.push_back(x.get<std::string>());
  }
}

// PEFT's layers_to_transform (an integer or a list of them) and layers_pattern (a string or a
// list of them); null or empty: not set.
void layers_from(const nlohmann::ordered_json& j, LoraConfig& c,
                 const std::function<void(std::string)>& bad) {
  const auto& t =
      j.contains("layers_to_transform") ? j["layers_to_transform"] : nlohmann::ordered_json();
  for (const auto& e : t.is_array() ? t : nlohmann::ordered_json::array({t})) {
    if (e.is_null() && !t.is_array()) continue;
    if (!e.is_number_integer())
      bad("layers_to_transform is " + t.dump() + ", not an integer or a list of integers");
    c.layers_to_transform.push_back(e.get<int64_t>());
  }
  const auto& p = j.contains("layers_pattern") ? j["layers_pattern"] : nlohmann::ordered_json();
  for (const auto& e : p.is_array() ? p : nlohmann::ordered_json::array({p})) {
    if ((e.is_null() && !p.is_array()) || (e.is_string() && e.get<std::string>().empty())) continue;
    if (!e.is_string()) bad("layers_pattern is " + p.dump() + ", not a string or a list of them");
    c.layers_pattern.push_back(e.get<std::string>());
  }
}

LoraConfig checked(const LoraConfig& c, const std::function<void(std::string)>& bad) {
  try {
    c.validate();
  } catch (const Error& e) {
    bad(e.what());
  }
  return c;
}

LoraConfig from_peft(const nlohmann::ordered_json& j, const std::string& file) {
  auto bad = [&](const std::string& why) { TESSERA_FAIL("PEFT config '", file, "': ", why); };
  if (!j.is_object()) bad("not a JSON object");
  const std::string type = j.contains("peft_type") && j["peft_type"].is_string()
                               ? j["peft_type"].get<std::string>()
                               : std::string();
  if (type == "TRAINABLE_TOKENS") return checked(tokens_config_from(j, bad), bad);
  if (type != "LORA")
    bad("peft_type is not \"LORA\" or \"TRAINABLE_TOKENS\" (only those adapters load here)");
  LoraConfig c;
  if (!j.contains("r") || !j["r"].is_number_integer()) bad("r is missing or not an integer");
  c.r = j["r"].get<int64_t>();
  if (j.contains("lora_alpha")) {
    if (!j["lora_alpha"].is_number()) bad("lora_alpha is not a number");
    c.lora_alpha = j["lora_alpha"].get<double>();
  }
  if (j.contains("lora_dropout") && !j["lora_dropout"].is_null()) {
    if (!j["lora_dropout"].is_number()) bad("lora_dropout is not a number");
    c.lora_dropout = j["lora_dropout"].get<double>();
  }
  const auto& t = j.contains("target_modules") ? j["target_modules"] : nlohmann::ordered_json();
  std::string shorthand = t.is_string() ? t.get<std::string>() : "";
  std::transform(shorthand.begin(), shorthand.end(), shorthand.begin(),
                 [](unsigned char ch) { return char(std::tolower(ch)); });
  if (shorthand == kAllLinear)  // PEFT reads it in any case
    c.target_modules = {kAllLinear};
  else if (t.is_string())
    c.target_modules_regex = t.get<std::string>();
  else if (!t.is_array())
    bad("target_modules is missing or not a list or a string");
  for (const auto& e : t.is_array() ? t : nlohmann::ordered_json::array()) {
    if (!e.is_string()) bad("target_modules holds a non-string");
    c.target_modules.push_back(e.get<std::string>());
  }
  if (j.contains("bias")) c.bias = j["bias"].is_string() ? j["bias"].get<std::string>() : "?";
  if (j.contains("use_rslora") && !j["use_rslora"].is_null()) {
    if (!j["use_rslora"].is_boolean()) bad("use_rslora is not a boolean");
    c.use_rslora = j["use_rslora"].get<bool>();
  }
  // Fields that choose which modules an adapter covers, what else it saves, or where in the
  // sequence it applies (aLoRA's invocation tokens: only after them): ignored, the adapter would
  // load onto other modules or tokens than it was trained on, or fail for a hidden reason.
  excludes_from(j, c, bad);
  c.rank_pattern = pattern_from<int64_t>(j, "rank_pattern", bad);
  c.alpha_pattern = pattern_from<double>(j, "alpha_pattern", bad);
  layers_from(j, c, bad);
  const auto& saved =
      j.contains("modules_to_save") ? j["modules_to_save"] : nlohmann::ordered_json();
  if (!saved.is_null() && !saved.is_array())
    bad("modules_to_save is " + saved.dump() + ", not a list of module names");
  for (const auto& e : saved.is_array() ? saved : nlohmann::ordered_json::array()) {
    if (!e.is_string()) bad("modules_to_save holds a non-string");
    c.modules_to_save.push_back(e.get<std::string>());
  }
  tokens_from(j, c, bad);
  // PEFT's LoRA variants that change what the layer computes (block-diagonal factors, routing
  // among adapters, a learnt diagonal between A and B over a truncated base, sampling around
  // the factors, pooled inputs) or what it targets: loaded as plain LoRA they would compute
  // something else. VeLoRA (a leaner backward of the same forward) and megatron_config (how
  // PEFT builds its parallel layers) load as plain LoRA.
  for (const char* field : {"target_parameters", "alora_invocation_tokens", "layer_replication"})
    if (j.contains(field) && !j[field].is_null() &&
        !((j[field].is_array() || j[field].is_object() || j[field].is_string()) &&
          j[field].empty()))
      bad(std::string(field) + " is set (" + j[field].dump() + "): not supported");
  // A variant's config, even {} (its defaults), turns it on; false or null leaves it off.
  for (const char* field :
       {"use_bdlora", "arrow_config", "kasa_config", "monteclora_config", "use_qalora"})
    if (j.contains(field) && !j[field].is_null() &&
        !(j[field].is_boolean() && !j[field].get<bool>()))
      bad(std::string(field) + " is set (" + j[field].dump() + "): not supported");
  if (j.contains("ensure_weight_tying") && !j["ensure_weight_tying"].is_null()) {
    if (!j["ensure_weight_tying"].is_boolean()) bad("ensure_weight_tying is not a boolean");
    c.ensure_weight_tying = j["ensure_weight_tying"].get<bool>();
  }
  if (j.contains("use_dora") && !j["use_dora"].is_null()) {
    if (!j["use_dora"].is_boolean()) bad("use_dora is not a boolean");
    c.use_dora = j["use_dora"].get<bool>();
  }
  if (j.contains("lora_bias") && j["lora_bias"].is_boolean() && j["lora_bias"].get<bool>())
    bad("lora_bias is set: adapters with a bias on B are not supported");
  if (j.contains("fan_in_fan_out") && j["fan_in_fan_out"].is_boolean() &&
      j["fan_in_fan_out"].get<bool>())
    bad("fan_in_fan_out is set: Tessera's Linear weights are [out, in]");
  if (j.contains("init_lora_weights")) {
    const auto& w = j["init_lora_weights"];
    if (w.is_boolean())
      c.init_lora_weights = w.get<bool>() ? LoraInit::Kaiming : LoraInit::Random;
    else if (w.is_string() && w.get<std::string>() == "gaussian")
      c.init_lora_weights = LoraInit::Gaussian;
    else if (w.is_string() && w.get<std::string>() == "orthogonal")
      c.init_lora_weights = LoraInit::Orthogonal;  // B A = 0: it fits the unchanged base
    else
      // PiSSA, OLoRA, LoftQ and the like change the base weights too: saved unconverted, the
      // adapter only fits the changed base, and on the original one it computes something else.
      bad("init_lora_weights is " + w.dump() +
          ": only true, false, \"gaussian\" and \"orthogonal\" adapters fit an unchanged base "
          "model (convert "
          "the adapter with PEFT's path_initial_model_for_weight_conversion first)");
  }
  return checked(c, bad);
}

// Every rank read the files itself: ranks that found different ones (node-local copies of
// another run's adapter) would each copy their window out of different values, and the adapter
// would hold a mix no file has. The ranks compare a digest of what they read first.
void check_same_files(const std::string& dir, const std::string& name, const LoraConfig& cfg,
                      const std::map<std::string, Tensor>& values) {
  ProcessGroupPtr world = world_group();
  if (world->size() == 1) return;
  std::hash<std::string_view> hash;
  size_t h = hash(to_peft(cfg, cfg.target_modules, cfg.modules_to_save, cfg.exclude_modules,
                          tokens_json(cfg, {}))
                      .dump());
  for (const auto& [key, t] : values)
    h = h * 1099511628211ull ^ hash(key) ^ (values_digest(t) << 1) ^ hash(shape_str(t.shape()));
  const std::vector<std::string> all = all_gather_strings(world, std::to_string(h));
  std::string differ;
  for (size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0]) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  TESSERA_CHECK(differ.empty(), "LoRA load_adapter '", name, "' from '", dir, "': rank(s) ", differ,
                " read files that differ from rank 0's (every rank must read the same ", kConfig,
                " and ", kWeights, ")");
}

// A table's rows under PEFT's TrainableTokens key, from read_adapter's, and back (a key that is
// not a table's rows stays as it is, for write_adapter to name).
std::string own_rows_key(const std::string& key) {
  if (!key.ends_with(kLoraRows)) return key;
  return key.substr(0, key.size() - std::strlen(kLoraRows)) + kOwnRows;
}
std::string lora_rows_key(const std::string& key) {
  if (!key.ends_with(kOwnRows) || key.ends_with(kLoraRows)) return key;
  return key.substr(0, key.size() - std::strlen(kOwnRows)) + kLoraRows;
}

// `entries` as PEFT reads them, names and dotted suffixes: a pattern (and "all-linear", as PEFT
// writes it) becomes the paths it matched among `paths`, in their order, each once.
std::vector<std::string> peft_entries(const std::vector<std::string>& entries,
                                      const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const std::string& entry : entries) {
    if (entry != kAllLinear && entry.find_first_of("*?[") == std::string::npos) {
      out.push_back(entry);
      continue;
    }
    for (const std::string& path : paths)
      if ((entry == kAllLinear || lora_target_matches(entry, path)) &&
          std::find(out.begin(), out.end(), path) == out.end())
        out.push_back(path);
  }
  return out;
}

}  // namespace

void LoraModel::save_adapter(const std::string& dir, const std::string& name) {
  const LoraConfig cfg = config(name);
  const Adapter& a = find(name, "save_adapter");
  std::vector<std::string> layers, saved_paths;
  for (size_t i : a.layers)
    layers.push_back(layers_[i].first);
  for (size_t i : a.saved)
    saved_paths.push_back(saved_[i]->path);
  const std::vector<std::string> targets = peft_entries(cfg.target_modules, layers);
  const std::vector<std::string> saved = peft_entries(cfg.modules_to_save, saved_paths);
  // Every module an exclude pattern matched, targeted or not: a plain target entry ("wq")
  // matches in every layer when PEFT reads it.
  std::vector<std::string> module_paths;
  for (const auto& [path, m] : lora_targetable_modules(*model_))
    if (!path.empty()) module_paths.push_back(path);
  const std::vector<std::string> excluded = peft_entries(cfg.exclude_modules, module_paths);
  std::vector<std::pair<std::string, std::vector<int64_t>>> tables;
  for (const auto& [t, ids] : a.tokens)
    tables.emplace_back(tokens_[t].first, ids);
  const nlohmann::ordered_json tokens = tokens_json(cfg, tables);
  const nlohmann::ordered_json config = cfg.has_targets()
                                            ? to_peft(cfg, targets, saved, excluded, tokens)
                                            : to_peft_tokens(cfg, tables, name);
  std::map<std::string, Tensor> values = read_adapter(name);  // collective
  {
    NoGradGuard no_grad;
    for (const auto& [key, p] : bias_parameters(cfg, a.layers))
      values[key] = p->full();  // collective, in the same order on every rank
  }
  on_rank0("LoRA save_adapter '" + name + "' to '" + dir + "'", [&] {
    std::filesystem::create_directories(dir);
    std::map<std::string, Tensor> peft;
    for (const auto& [key, t] : values)
      peft[kPrefix + (cfg.has_targets() ? key : own_rows_key(key))] = t;
    save_safetensors(dir + "/" + kWeights, peft, {{"format", "pt"}});
    std::ofstream out(dir + "/" + kConfig);
    out << config.dump(2) << "\n";
    TESSERA_CHECK(out.good(), "writing '", dir, "/", kConfig, "' failed");
  });
}

// Every rank checks the same files against the same model: the outcome is the same everywhere.
std::vector<std::pair<Parameter*, Tensor>> LoraModel::take_bias_values(
    const std::string& dir, const std::string& name, const LoraConfig& cfg,
    std::map<std::string, Tensor>& values) const {
  const std::string ctx = "LoRA load_adapter '" + name + "' from '" + dir + "/" + kWeights + "'";
  std::map<std::string, Parameter*> wanted;
  for (const auto& [key, p] : bias_parameters(cfg, targets(cfg)))
    wanted[key] = p;
  std::vector<std::pair<Parameter*, Tensor>> out;
  std::vector<std::string> absent;
  for (const auto& [key, p] : wanted) {
    auto it = values.find(key);
    if (it == values.end()) {
      absent.push_back(key);
      continue;
    }
    TESSERA_CHECK(it->second.shape() == p->global_shape(), ctx, ": '", kPrefix, key, "' is ",
                  shape_str(it->second.shape()), ", the model's bias ",
                  shape_str(p->global_shape()));
    TESSERA_CHECK(is_floating(it->second.dtype()), ctx, ": '", kPrefix, key, "' is ",
                  dtype_name(it->second.dtype()), ", not floating");
    out.emplace_back(p, it->second);
    values.erase(it);
  }
  // Older PEFT saved no bias for bias="lora_only" (it looked for "<path>.bias" in a wrapped
  // layer): such a file still loads, its biases staying the base model's.
  if (!absent.empty() && world_rank() == 0) {
    std::string line =
        "[rank 0] tessera: " + ctx + " (bias \"" + cfg.bias + "\") holds no value for";
    for (const std::string& k : absent)
      line += " " + k;
    line += "; those biases keep their values\n";
    std::fputs(line.c_str(), stderr);
  }
  return out;
}

void LoraModel::load_adapter(const std::string& dir, const std::string& name, bool is_trainable) {
  // Every rank reads the (small) files itself; a rank that cannot (a directory on node-local
  // storage) makes every rank throw, before add_adapter's collectives.
  LoraConfig cfg;
  std::map<std::string, Tensor> values;
  run_agreed(world_group(), "LoRA load_adapter '" + name + "' from '" + dir + "'", [&] {
    const std::string config_path = dir + "/" + kConfig;
    std::ifstream in(config_path);
    TESSERA_CHECK(in.good(), "cannot read '", config_path, "'");
    nlohmann::ordered_json j;  // rank_pattern's order is part of its meaning
    try {
      in >> j;
    } catch (const nlohmann::json::exception& e) {
      TESSERA_FAIL("PEFT config '", config_path, "' is not valid JSON: ", e.what());
    }
    cfg = from_peft(j, config_path);
    try {
      // Before add_adapter, to name the file: targets the model cannot take (a tied table
      // without ensure_weight_tying, a layer apply_lora did not wrap), modules and tables.
      targets(cfg);
      saved_targets(cfg);
      token_targets(cfg);
    } catch (const Error& e) {
      TESSERA_FAIL("PEFT config '", config_path, "': ", e.what());
    }
    const SafetensorsFile file = load_safetensors(dir + "/" + kWeights);
    const std::string prefix = kPrefix;
    for (const auto& [key, t] : file.tensors) {
      TESSERA_CHECK(key.compare(0, prefix.size(), prefix) == 0, "'", dir, "/", kWeights,
                    "' holds '", key, "', not a PEFT key (", prefix, "<module>.lora_A.weight)");
      const std::string k = key.substr(prefix.size());
      values[cfg.has_targets() ? k : lora_rows_key(k)] = t;
    }
  });
  check_same_files(dir, name, cfg, values);
  // PEFT's: the file's own inference_mode says how it was saved, not how it is to be used.
  cfg.inference_mode = !is_trainable;
  const std::vector<std::pair<Parameter*, Tensor>> biases =
      take_bias_values(dir, name, cfg, values);
  add_adapter(name, cfg);
  try {
    write_adapter(name, values);
    NoGradGuard no_grad;
    for (const auto& [p, value] : biases) {
      Tensor full = zeros(p->global_shape(), p->dtype());
      full.copy_(value);
      p->copy_from_full(full);
    }
  } catch (...) {
    delete_adapter(name);
    throw;
  }
}

}  // namespace tessera
