// The adapter table in checkpoints: which adapter each slot holds, with what config, merged or
// not. The model's state dict keys adapter values by slot ("lora_A.<slot>.weight"), and a merged
// adapter lives inside the base weight: without the table, a checkpoint loaded into a model whose
// adapters were added in another order, or never merged, applies its values to the wrong adapter,
// or applies a merged one twice, silently.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <set>

#include "bias_adapters.h"
#include "saved_module.h"
#include "tessera/comm/agree.h"
#include "tessera/comm/runtime.h"
#include "tessera/lora/lora_model.h"

namespace tessera {

namespace {

constexpr const char* kKey = "adapters";
// Each format holds what the readers of the ones before would misread without a word. Format 2:
// a module's own r or alpha (rank_pattern, alpha_pattern) or a DoRA adapter would be restored as
// plain LoRA at the global r. Format 3: an adapter's modules_to_save would be dropped, its
// modules computing with the originals. Format 4: an adapter's trainable tokens would be dropped,
// its tables reading their own rows. A table is written in the oldest format that holds it,
// which older builds still read.
constexpr int64_t kFormat = 4;
constexpr int64_t kOldestFormat = 1;

int64_t format_needed(const LoraConfig& c) {
  if (!c.trainable_token_indices.empty()) return 4;
  if (!c.modules_to_save.empty()) return 3;
  return c.use_dora || !c.rank_pattern.empty() || !c.alpha_pattern.empty() ? 2 : 1;
}

const char* init_name(LoraInit i) {
  switch (i) {
    case LoraInit::Kaiming:
      return "kaiming";
    case LoraInit::Gaussian:
      return "gaussian";
    case LoraInit::Random:
      return "random";
    case LoraInit::Orthogonal:
      return "orthogonal";
  }
  return "?";
}

nlohmann::json config_json(const LoraConfig& c) {
  nlohmann::json j;
  j["r"] = c.r;
  j["lora_alpha"] = c.lora_alpha;
  j["lora_dropout"] = c.lora_dropout;
  j["target_modules"] = c.target_modules;
  // Only when set: tables written before these fields read the same.
  if (!c.target_modules_regex.empty()) j["target_modules_regex"] = c.target_modules_regex;
  if (!c.exclude_modules_regex.empty()) j["exclude_modules_regex"] = c.exclude_modules_regex;
  j["use_rslora"] = c.use_rslora;
  j["init_lora_weights"] = init_name(c.init_lora_weights);
  j["bias"] = c.bias;
  j["inference_mode"] = c.inference_mode;
  j["use_dora"] = c.use_dora;
  j["seed"] = c.seed;
  j["exclude_modules"] = c.exclude_modules;
  // Pairs, not objects: the first key that matches wins, so the order is part of the value.
  j["rank_pattern"] = c.rank_pattern;
  j["alpha_pattern"] = c.alpha_pattern;
  j["layers_to_transform"] = c.layers_to_transform;
  j["layers_pattern"] = c.layers_pattern;
  j["modules_to_save"] = c.modules_to_save;
  // [key, ids] pairs in the config's order, as the patterns are.
  if (!c.trainable_token_indices.empty()) j["trainable_token_indices"] = c.trainable_token_indices;
  if (c.ensure_weight_tying) j["ensure_weight_tying"] = true;
  return j;
}

const char* kind_name(nlohmann::json::value_t kind) {
  using V = nlohmann::json::value_t;
  switch (kind) {
    case V::number_integer:
      return "an int64 integer";
    case V::number_unsigned:
      return "a non-negative integer";
    case V::number_float:
      return "a number";
    case V::string:
      return "a string";
    case V::boolean:
      return "a boolean";
    case V::array:
      return "a list";
    default:
      return "an object";
  }
}

// A field of `j` of JSON type `kind`, or an error naming where it is missing or what it should
// be.
const nlohmann::json& field(const nlohmann::json& j, const char* name, nlohmann::json::value_t kind,
                            const std::string& where) {
  using V = nlohmann::json::value_t;
  TESSERA_CHECK(j.is_object(), where, " is not a JSON object: ", j.dump().substr(0, 80));
  TESSERA_CHECK(j.contains(name), where, ": '", name, "' is missing");
  const nlohmann::json& v = j.at(name);
  bool ok = v.type() == kind;
  // nlohmann reads a non-negative integer as unsigned: a signed field takes it while it fits.
  if (kind == V::number_integer)
    ok = v.is_number_integer() &&
         !(v.is_number_unsigned() &&
           v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()));
  if (kind == V::number_unsigned) ok = v.is_number_unsigned();
  if (kind == V::number_float) ok = v.is_number();  // JSON may write 8.0 as 8
  TESSERA_CHECK(ok, where, ": '", name, "' is ", v.dump().substr(0, 40), ", not ", kind_name(kind));
  return v;
}

template <class T>
std::vector<std::pair<std::string, T>> read_pattern(const nlohmann::json& j, const char* name,
                                                    nlohmann::json::value_t kind,
                                                    const std::string& where) {
  std::vector<std::pair<std::string, T>> out;
  for (const auto& e : field(j, name, nlohmann::json::value_t::array, where)) {
    TESSERA_CHECK(e.is_array() && e.size() == 2 && e[0].is_string(), where, ": ", name, " holds ",
                  e.dump().substr(0, 40), ", not a [key, value] pair");
    nlohmann::json pair = {{"value", e[1]}};
    out.emplace_back(
        e[0].get<std::string>(),
        field(pair, "value", kind, where + ", " + name + "['" + e[0].get<std::string>() + "']")
            .get<T>());
  }
  return out;
}

void read_selection(const nlohmann::json& j, LoraConfig& c, const std::string& where) {
  using V = nlohmann::json::value_t;
  if (j.contains("target_modules_regex"))
    c.target_modules_regex = field(j, "target_modules_regex", V::string, where).get<std::string>();
  if (j.contains("exclude_modules_regex"))
    c.exclude_modules_regex =
        field(j, "exclude_modules_regex", V::string, where).get<std::string>();
  if (j.contains("exclude_modules"))
    for (const auto& e : field(j, "exclude_modules", V::array, where)) {
      TESSERA_CHECK(e.is_string(), where, ": exclude_modules holds a non-string");
      c.exclude_modules.push_back(e.get<std::string>());
    }
  if (j.contains("rank_pattern"))
    c.rank_pattern = read_pattern<int64_t>(j, "rank_pattern", V::number_integer, where);
  if (j.contains("alpha_pattern"))
    c.alpha_pattern = read_pattern<double>(j, "alpha_pattern", V::number_float, where);
  if (j.contains("layers_to_transform"))
    for (const auto& e : field(j, "layers_to_transform", V::array, where)) {
      TESSERA_CHECK(e.is_number_integer(), where, ": layers_to_transform holds ", e.dump());
      c.layers_to_transform.push_back(e.get<int64_t>());
    }
  if (j.contains("layers_pattern"))
    for (const auto& e : field(j, "layers_pattern", V::array, where)) {
      TESSERA_CHECK(e.is_string(), where, ": layers_pattern holds a non-string");
      c.layers_pattern.push_back(e.get<std::string>());
    }
  if (j.contains("modules_to_save"))
    for (const auto& e : field(j, "modules_to_save", V::array, where)) {
      TESSERA_CHECK(e.is_string(), where, ": modules_to_save holds a non-string");
      c.modules_to_save.push_back(e.get<std::string>());
    }
  if (j.contains("trainable_token_indices"))
    for (const auto& e : field(j, "trainable_token_indices", V::array, where)) {
      TESSERA_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_array(), where,
                    ": trainable_token_indices holds ", e.dump().substr(0, 40),
                    ", not a [table, ids] pair");
      std::vector<int64_t> ids;
      for (const auto& id : e[1]) {
        TESSERA_CHECK(id.is_number_integer(), where, ": trainable_token_indices holds ",
                      id.dump().substr(0, 40), ", not a token id");
        ids.push_back(id.get<int64_t>());
      }
      c.trainable_token_indices.emplace_back(e[0].get<std::string>(), std::move(ids));
    }
}

LoraConfig config_from(const nlohmann::json& j, const std::string& where) {
  using V = nlohmann::json::value_t;
  LoraConfig c;
  c.r = field(j, "r", V::number_integer, where).get<int64_t>();
  c.lora_alpha = field(j, "lora_alpha", V::number_float, where).get<double>();
  c.lora_dropout = field(j, "lora_dropout", V::number_float, where).get<double>();
  for (const auto& e : field(j, "target_modules", V::array, where)) {
    TESSERA_CHECK(e.is_string(), where, ": target_modules holds a non-string");
    c.target_modules.push_back(e.get<std::string>());
  }
  c.use_rslora = field(j, "use_rslora", V::boolean, where).get<bool>();
  const std::string init = field(j, "init_lora_weights", V::string, where).get<std::string>();
  bool known = false;
  for (LoraInit i : {LoraInit::Kaiming, LoraInit::Gaussian, LoraInit::Random, LoraInit::Orthogonal})
    if (init == init_name(i)) {
      c.init_lora_weights = i;
      known = true;
    }
  TESSERA_CHECK(known, where, ": init_lora_weights '", init,
                "' is not kaiming, gaussian, random or orthogonal");
  c.bias = field(j, "bias", V::string, where).get<std::string>();
  // Absent from the tables of builds before it: those adapters trained.
  if (j.contains("inference_mode"))
    c.inference_mode = field(j, "inference_mode", V::boolean, where).get<bool>();
  // Absent from the tables of builds before DoRA: those adapters were LoRA.
  if (j.contains("use_dora")) c.use_dora = field(j, "use_dora", V::boolean, where).get<bool>();
  // Written only when set: an adapter of an older build, or one without it, did not tie.
  if (j.contains("ensure_weight_tying"))
    c.ensure_weight_tying = field(j, "ensure_weight_tying", V::boolean, where).get<bool>();
  c.seed = field(j, "seed", V::number_unsigned, where).get<uint64_t>();
  // Absent from the tables of builds before them: no exclusions, every module takes r and alpha.
  read_selection(j, c, where);
  c.validate();
  return c;
}

std::string list(const std::vector<std::string>& v) {
  if (v.empty()) return "none";
  std::string s;
  for (const auto& x : v)
    s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

struct LoraModel::SavedAdapter {
  std::string name;
  int64_t slot = -1;
  bool merged = false;
  LoraConfig config;
  std::vector<size_t> layers;            // indices into layers_, in the model's order
  std::vector<uint64_t> dropout_offset;  // per entry of `layers`
  std::vector<size_t> saved;             // indices into saved_ (modules_to_save)
  std::vector<std::pair<size_t, std::vector<int64_t>>> tokens;  // into tokens_, with ids
};

StateDict LoraModel::state_dict() const {
  nlohmann::json j;
  int64_t format = kOldestFormat;
  for (const auto& [name, a] : adapters_)
    format = std::max(format, format_needed(a.config));
  j["format"] = format;
  j["max_adapters"] = slots_.max_adapters;
  j["max_rank"] = slots_.max_rank;
  j["active_adapter"] = active_;
  j["adapters"] = nlohmann::json::array();
  for (const std::string& name : adapters()) {
    const Adapter& a = adapters_.at(name);
    nlohmann::json e;
    e["name"] = name;
    e["slot"] = a.slot;
    e["merged"] = merged(a);
    e["config"] = config_json(a.config);
    e["layers"] = nlohmann::json::array();
    for (size_t i : a.layers)
      e["layers"].push_back({{"path", layers_[i].first},
                             {"dropout_offset", layers_[i].second->dropout_offset(a.slot)}});
    if (!a.saved.empty()) {
      e["saved_modules"] = nlohmann::json::array();
      for (size_t i : a.saved)
        e["saved_modules"].push_back(saved_[i]->path);
    }
    if (!a.tokens.empty()) {
      e["token_tables"] = nlohmann::json::array();
      for (const auto& [t, ids] : a.tokens)
        e["token_tables"].push_back(tokens_[t].first);
    }
    j["adapters"].push_back(std::move(e));
  }
  return StateDict{{kKey, j.dump()}};
}

// Every check of load_state_dict, against this model, before anything changes.
std::vector<LoraModel::SavedAdapter> LoraModel::parse_table(const std::string& text,
                                                            std::string& active) const {
  using V = nlohmann::json::value_t;
  const std::string ctx = "LoRA load_state_dict: the table under '" + std::string(kKey) + "'";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL(ctx, " is not JSON (", e.what(), ")");
  }
  const int64_t format = field(j, "format", V::number_integer, ctx).get<int64_t>();
  TESSERA_CHECK(format >= kOldestFormat && format <= kFormat, ctx, " has format ", format,
                "; this build reads ", kOldestFormat, " to ", kFormat);
  const int64_t max_adapters = field(j, "max_adapters", V::number_integer, ctx).get<int64_t>();
  const int64_t max_rank = field(j, "max_rank", V::number_integer, ctx).get<int64_t>();
  TESSERA_CHECK(max_adapters == slots_.max_adapters && max_rank == slots_.max_rank, ctx, " has ",
                max_adapters, " adapter slots of rank ", max_rank, ", this model ",
                slots_.max_adapters, " of rank ", slots_.max_rank,
                " (the LoraSlots given to apply_lora must be the same)");
  active = field(j, "active_adapter", V::string, ctx).get<std::string>();
  std::vector<SavedAdapter> out;
  std::set<std::string> names;
  std::set<int64_t> slots;
  for (const auto& e : field(j, "adapters", V::array, ctx)) {
    SavedAdapter a;
    a.name = field(e, "name", V::string, ctx + ", an adapter").get<std::string>();
    const std::string where = ctx + ", adapter '" + a.name + "'";
    TESSERA_CHECK(!a.name.empty() && names.insert(a.name).second, where,
                  a.name.empty() ? ": an empty name" : ": listed twice");
    a.slot = field(e, "slot", V::number_integer, where).get<int64_t>();
    TESSERA_CHECK(a.slot >= 0 && a.slot < max_adapters && slots.insert(a.slot).second, where,
                  ": slot ", a.slot, " is out of range or taken by another adapter");
    a.merged = field(e, "merged", V::boolean, where).get<bool>();
    a.config = config_from(field(e, "config", V::object, where), where + " config");
    TESSERA_CHECK(!a.config.use_dora || slots_.use_dora, where,
                  ": it uses DoRA, but this model's slots hold no magnitude vectors "
                  "(LoraSlots::use_dora must be the same as when saved)");
    // PEFT keeps the norms that undo a DoRA merge in memory only; they are not in the model's
    // state dict either, so such an adapter could never be unmerged here.
    TESSERA_CHECK(!a.merged || !a.config.use_dora, where,
                  ": a DoRA adapter saved merged cannot be restored (the weight norms that undo "
                  "its merge are not in a checkpoint); save it unmerged");
    std::vector<std::string> saved;
    for (const auto& l : field(e, "layers", V::array, where)) {
      saved.push_back(field(l, "path", V::string, where + ", a layer").get<std::string>());
      a.dropout_offset.push_back(
          field(l, "dropout_offset", V::number_unsigned, where + ", layer '" + saved.back() + "'")
              .get<uint64_t>());
    }
    try {
      a.layers = targets(a.config);
    } catch (const Error& err) {
      TESSERA_FAIL(where, ": ", err.what());
    }
    std::vector<std::string> here;
    for (size_t i : a.layers) {
      here.push_back(layers_[i].first);
      TESSERA_CHECK(a.config.rank_for(here.back()) <= max_rank, where, ": r ",
                    a.config.rank_for(here.back()), " at '", here.back(),
                    "' exceeds the slots' rank ", max_rank);
    }
    if (here != saved) {
      std::vector<std::string> gone, extra;
      for (const std::string& p : saved)
        if (std::find(here.begin(), here.end(), p) == here.end()) gone.push_back(p);
      for (const std::string& p : here)
        if (std::find(saved.begin(), saved.end(), p) == saved.end()) extra.push_back(p);
      TESSERA_FAIL(where, ": its targets cover other layers here than when saved (saved only: ",
                   list(gone), "; here only: ", list(extra), "): not the same model");
    }
    try {
      a.saved = saved_targets(a.config);
    } catch (const Error& err) {
      TESSERA_FAIL(where, ": ", err.what());
    }
    std::vector<std::string> saved_here, saved_then;
    for (size_t i : a.saved)
      saved_here.push_back(saved_[i]->path);
    if (e.contains("saved_modules"))
      for (const auto& m : field(e, "saved_modules", V::array, where)) {
        TESSERA_CHECK(m.is_string(), where, ": saved_modules holds a non-string");
        saved_then.push_back(m.get<std::string>());
      }
    TESSERA_CHECK(saved_here == saved_then, where, ": its modules_to_save cover ", list(saved_here),
                  " here and covered ", list(saved_then), " when saved: not the same model");
    try {
      a.tokens = token_targets(a.config);
    } catch (const Error& err) {
      TESSERA_FAIL(where, ": ", err.what());
    }
    std::vector<std::string> tables_here, tables_then;
    for (const auto& [t, ids] : a.tokens) {
      tables_here.push_back(tokens_[t].first);
      TESSERA_CHECK(int64_t(ids.size()) <= tokens_[t].second->max_tokens(), where, ": ", ids.size(),
                    " token ids at '", tokens_[t].first, "' exceed the slots' rows ",
                    tokens_[t].second->max_tokens());
    }
    if (e.contains("token_tables"))
      for (const auto& m : field(e, "token_tables", V::array, where)) {
        TESSERA_CHECK(m.is_string(), where, ": token_tables holds a non-string");
        tables_then.push_back(m.get<std::string>());
      }
    TESSERA_CHECK(tables_here == tables_then, where, ": its trainable tokens cover ",
                  list(tables_here), " here and covered ", list(tables_then),
                  " when saved: not the same model");
    // The rows a merge replaced are kept in memory only (as PEFT keeps them), not in the
    // model's state dict: such an adapter could never be unmerged here.
    TESSERA_CHECK(!a.merged || a.tokens.empty(), where,
                  ": an adapter with trainable tokens saved merged cannot be restored (the table "
                  "rows its merge replaced are not in a checkpoint); save it unmerged");
    out.push_back(std::move(a));
  }
  if (out.size() > 1)
    for (const SavedAdapter& a : out)
      TESSERA_CHECK(a.config.bias == "none", ctx, ": adapter '", a.name, "' has bias \"",
                    a.config.bias,
                    "\" beside other adapters (only a model's single adapter may train the base "
                    "biases)");
  const auto others = other_bias_adapters(*model_, routing_.get());
  for (const SavedAdapter& a : out)
    refuse_second_bias_mode(ctx + ": adapter '" + a.name + "'", a.config, others);
  const bool known = active.empty() || names.count(active);
  TESSERA_CHECK(known, ctx, ": the active adapter '", active, "' is not in the table");
  for (const SavedAdapter& a : out)
    TESSERA_CHECK(!a.merged || a.name == active, ctx, ": adapter '", a.name,
                  "' is merged but not active (a merged adapter applies to every sample)");
  return out;
}

void LoraModel::load_state_dict(const StateDict& state) {
  auto it = state.find(kKey);
  const std::string* text = it == state.end() ? nullptr : std::get_if<std::string>(&it->second);
  const std::string mine = text ? *text : std::string();
  std::vector<SavedAdapter> saved;
  std::string active;
  auto check = [&] {
    TESSERA_CHECK(text != nullptr, "LoRA load_state_dict: the dict has no string '", kKey, "' (",
                  it == state.end() ? "missing" : state_value_str(it->second),
                  "): pass what LoraModel::state_dict() gave, as saved");
    saved = parse_table(*text, active);
  };
  if (world_size() > 1) {
    const ProcessGroupPtr world = world_group();
    const std::vector<std::string> all = all_gather_strings(world, mine);
    run_agreed(world, "LoRA load_state_dict", [&] {
      for (size_t r = 0; r < all.size(); ++r)
        TESSERA_CHECK(all[r] == all[0], "LoRA load_state_dict: rank ", r,
                      " passed another table than rank 0 (every rank must load the same)");
      check();
    });
  } else {
    check();
  }
  // Nothing below throws: every value was checked against this model above.
  for (size_t li = 0; li < layers_.size(); ++li)
    for (int64_t s = 0; s < slots_.max_adapters; ++s)
      layers_[li].second->restore_slot(s, "", LoraConfig{}, layers_[li].first, false, 0);
  for (const auto& [path, t] : tokens_)
    for (int64_t s = 0; s < t->num_slots(); ++s)
      t->restore_slot(s, {}, false);
  for (const auto& [name, a] : adapters_)
    set_trainable(a, false);
  adapters_.clear();
  for (const SavedAdapter& a : saved) {
    for (size_t k = 0; k < a.layers.size(); ++k) {
      const size_t li = a.layers[k];
      layers_[li].second->restore_slot(a.slot, a.name, a.config.for_module(layers_[li].first),
                                       layers_[li].first, a.merged, a.dropout_offset[k]);
    }
    for (const auto& [t, ids] : a.tokens)
      tokens_[t].second->restore_slot(a.slot, ids, a.merged);
    adapters_[a.name] = Adapter{a.slot, a.config, a.layers, a.saved, a.tokens};
    set_trainable(adapters_.at(a.name), true);
  }
  update_saved();
  active_ = active;
  routing_->active_slot = active.empty() ? -1 : adapters_.at(active).slot;
  routing_->sample_slots.reset();
  routing_->masks.clear();
}

}  // namespace tessera
