#include "tessera/lora/config.h"

#include <algorithm>
#include <cmath>
#include <regex>
#include <set>

#include "tessera/core/error.h"
#include "tessera/nn/module_path.h"

namespace tessera {

double LoraConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(double(r)) : lora_alpha / double(r);
}

namespace {

// PEFT's get_pattern_key: `key` matches the whole path or a tail of it that starts after a '.'.
std::regex pattern_regex(const std::string& key) {
  return std::regex("(.*\\.)?(" + key + ")", std::regex::ECMAScript);
}

template <class T>
const T* pattern_value(const std::vector<std::pair<std::string, T>>& pattern,
                       const std::string& path) {
  for (const auto& [key, value] : pattern)
    if (std::regex_match(path, pattern_regex(key))) return &value;
  return nullptr;
}

template <class T>
void check_pattern(const std::vector<std::pair<std::string, T>>& pattern, const char* field) {
  for (const auto& [key, value] : pattern) {
    TESSERA_CHECK(!key.empty(), "LoraConfig: ", field, " has an empty key");
    try {
      pattern_regex(key);
    } catch (const std::regex_error& e) {
      TESSERA_FAIL("LoraConfig: ", field, " key '", key, "' is not a regular expression (",
                   e.what(), ")");
    }
    TESSERA_CHECK(value > 0 && std::isfinite(double(value)), "LoraConfig: ", field, "['", key,
                  "'] must be positive, got ", value);
  }
}

}  // namespace

int64_t LoraConfig::rank_for(const std::string& path) const {
  const int64_t* v = pattern_value(rank_pattern, path);
  return v ? *v : r;
}

double LoraConfig::alpha_for(const std::string& path) const {
  const double* v = pattern_value(alpha_pattern, path);
  return v ? *v : lora_alpha;
}

LoraConfig LoraConfig::for_module(const std::string& path) const {
  LoraConfig c = *this;
  c.r = rank_for(path);
  c.lora_alpha = alpha_for(path);
  return c;
}

bool LoraConfig::all_linear() const {
  return target_modules.size() == 1 && target_modules[0] == kAllLinear;
}

bool LoraConfig::has_targets() const {
  return !target_modules.empty() || !target_modules_regex.empty();
}

std::vector<std::string> LoraConfig::target_entries() const {
  return target_modules_regex.empty() ? target_modules
                                      : std::vector<std::string>{target_modules_regex};
}

bool LoraConfig::regex_targets(const std::string& path) const {
  return !target_modules_regex.empty() && std::regex_match(path, std::regex(target_modules_regex));
}

bool LoraConfig::regex_excludes(const std::string& path) const {
  return !exclude_modules_regex.empty() &&
         std::regex_match(path, std::regex(exclude_modules_regex));
}

int64_t LoraConfig::layer_index(const std::string& path) const {
  // PEFT's paths start with the model's prefix ("model.layers.3..."), Tessera's at the model's
  // root: the leading '.' lets the first component be the layer list.
  const std::string dotted = "." + path;
  std::smatch m;
  if (layers_pattern.empty()) {
    static const std::regex any(".*\\.[^.]*\\.(\\d+)\\..*");
    return std::regex_match(dotted, m, any) ? std::stoll(m[1].str()) : -1;
  }
  for (const std::string& p : layers_pattern)
    if (std::regex_match(dotted, m, std::regex(".*\\.(?:" + p + ")\\.(\\d+)\\..*")))
      return std::stoll(m[1].str());
  return -1;
}

bool LoraConfig::in_transformed_layers(const std::string& path) const {
  if (layers_to_transform.empty()) return true;
  // As in PEFT, an entry that is the module's whole path names it in any layer.
  if (std::find(target_modules.begin(), target_modules.end(), path) != target_modules.end())
    return true;
  const int64_t layer = layer_index(path);
  return std::find(layers_to_transform.begin(), layers_to_transform.end(), layer) !=
         layers_to_transform.end();
}

void LoraConfig::validate() const {
  TESSERA_CHECK(r > 0, "LoraConfig: r must be positive, got ", r);
  TESSERA_CHECK(lora_alpha > 0 && std::isfinite(lora_alpha),
                "LoraConfig: lora_alpha must be positive and finite, got ", lora_alpha);
  TESSERA_CHECK(lora_dropout >= 0 && lora_dropout < 1,
                "LoraConfig: lora_dropout must be in [0, 1), got ", lora_dropout);
  TESSERA_CHECK(has_targets() || !trainable_token_indices.empty(),
                "LoraConfig: target_modules is empty and trainable_token_indices names no table: "
                "the adapter would train nothing (name the Linear modules to adapt, e.g. "
                "{\"wq\", \"wv\"}; with no targets an adapter trains token rows alone, PEFT's "
                "TrainableTokensConfig)");
  TESSERA_CHECK(target_modules.empty() || target_modules_regex.empty(),
                "LoraConfig: target_modules and target_modules_regex are both set (PEFT's "
                "target_modules is a list or a regular expression, not both)");
  TESSERA_CHECK(exclude_modules.empty() || exclude_modules_regex.empty(),
                "LoraConfig: exclude_modules and exclude_modules_regex are both set (PEFT's "
                "exclude_modules is a list or a regular expression, not both)");
  for (const auto& [field, re] :
       {std::pair<const char*, const std::string*>{"target_modules_regex", &target_modules_regex},
        {"exclude_modules_regex", &exclude_modules_regex}}) {
    try {
      std::regex{*re};
    } catch (const std::regex_error& e) {
      TESSERA_FAIL("LoraConfig: ", field, " '", *re, "' is not a regular expression (", e.what(),
                   ")");
    }
  }
  for (const std::string& t : target_modules)
    TESSERA_CHECK(!t.empty(), "LoraConfig: an empty name in target_modules");
  TESSERA_CHECK(all_linear() || std::find(target_modules.begin(), target_modules.end(),
                                          std::string(kAllLinear)) == target_modules.end(),
                "LoraConfig: target_modules \"", kAllLinear,
                "\" stands alone (it names every Linear but the output layer)");
  for (const std::string& t : exclude_modules)
    TESSERA_CHECK(!t.empty(), "LoraConfig: an empty name in exclude_modules");
  for (const std::string& t : modules_to_save)
    TESSERA_CHECK(!t.empty() && t != kAllLinear,
                  "LoraConfig: ", t.empty() ? std::string("an empty name") : "\"" + t + "\"",
                  " in modules_to_save (name the modules to train in full, e.g. {\"output\"})");
  for (int64_t layer : layers_to_transform)
    TESSERA_CHECK(layer >= 0, "LoraConfig: layers_to_transform holds ", layer, ", not a layer");
  TESSERA_CHECK(layers_to_transform.empty() || !all_linear(),
                "LoraConfig: layers_to_transform cannot be used with target_modules \"", kAllLinear,
                "\" (as in PEFT, where a string target_modules refuses it)");
  TESSERA_CHECK(layers_to_transform.empty() || target_modules_regex.empty(),
                "LoraConfig: layers_to_transform cannot be used with target_modules_regex (as in "
                "PEFT, where a string target_modules refuses it)");
  TESSERA_CHECK(layers_pattern.empty() || !layers_to_transform.empty(),
                "LoraConfig: layers_pattern is set without layers_to_transform");
  for (const std::string& p : layers_pattern) {
    TESSERA_CHECK(!p.empty(), "LoraConfig: an empty name in layers_pattern");
    try {
      std::regex(".*\\.(?:" + p + ")\\.(\\d+)\\..*");
    } catch (const std::regex_error& e) {
      TESSERA_FAIL("LoraConfig: layers_pattern '", p, "' is not a regular expression (", e.what(),
                   ")");
    }
  }
  check_pattern(rank_pattern, "rank_pattern");
  check_pattern(alpha_pattern, "alpha_pattern");
  std::set<std::string> token_keys;
  for (const auto& [key, ids] : trainable_token_indices) {
    const std::string at = key.empty() ? std::string("the input embedding") : "'" + key + "'";
    TESSERA_CHECK(token_keys.insert(key).second, "LoraConfig: trainable_token_indices lists ", at,
                  " twice");
    TESSERA_CHECK(!ids.empty(), "LoraConfig: trainable_token_indices lists no token ids for ", at);
    std::set<int64_t> seen;
    for (int64_t id : ids) {
      TESSERA_CHECK(id >= 0, "LoraConfig: trainable_token_indices holds token id ", id, " for ",
                    at);
      TESSERA_CHECK(seen.insert(id).second, "LoraConfig: trainable_token_indices lists token id ",
                    id, " twice for ", at);
    }
  }
  // PEFT's orthogonal init pairs Q's even rows (A) with its odd ones (B).
  TESSERA_CHECK(init_lora_weights != LoraInit::Orthogonal || r % 2 == 0,
                "LoraConfig: init_lora_weights \"orthogonal\" needs an even r, got ", r);
  for (const auto& [key, value] : rank_pattern)
    TESSERA_CHECK(init_lora_weights != LoraInit::Orthogonal || value % 2 == 0,
                  "LoraConfig: init_lora_weights \"orthogonal\" needs an even r, got "
                  "rank_pattern['",
                  key, "'] = ", value);
  TESSERA_CHECK(bias == "none" || bias == "all" || bias == "lora_only", "LoraConfig: bias '", bias,
                "' is not one of PEFT's \"none\", \"all\", \"lora_only\"");
  // Token rows alone are PEFT's TrainableTokensConfig, which has none of these; set, they would
  // select or train nothing here, or could not be written to PEFT's files.
  if (!has_targets()) {
    const std::vector<std::pair<const char*, bool>> lora_only = {
        {"modules_to_save", !modules_to_save.empty()},
        {"bias", bias != "none"},
        {"use_dora", use_dora},
        {"exclude_modules", !exclude_modules.empty() || !exclude_modules_regex.empty()},
        {"layers_to_transform", !layers_to_transform.empty()},
        {"rank_pattern", !rank_pattern.empty()},
        {"alpha_pattern", !alpha_pattern.empty()}};
    for (const auto& [field, set] : lora_only)
      TESSERA_CHECK(!set, "LoraConfig: ", field,
                    " is set but target_modules is empty: an adapter of trainable tokens alone is "
                    "PEFT's TrainableTokensConfig, which has no ",
                    field, "; name target modules too");
  }
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
