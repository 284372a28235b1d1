// get/set of model and optimizer state dicts: each lists its slots (slots.h) and scalars.
#include "tessera/checkpoint/state_dict.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <set>

#include "context.h"
#include "slots.h"
#include "tessera/comm/agree.h"
#include "tessera/comm/runtime.h"

namespace tessera {

namespace {

using ckpt::ScalarSlot;
using ckpt::Slot;

// Every name of a tied tensor or shared module, as PyTorch's get_model_state_dict (which is
// model.state_dict()) has: a tied table is saved under each name and loaded from each.
std::vector<Slot> model_slots(Module& model, const StateDictOptions& options) {
  std::vector<Slot> slots;
  for (auto& [name, p] : model.named_parameters(true, /*remove_duplicate=*/false)) {
    if (options.ignore_frozen_params && !p->requires_grad()) continue;
    slots.push_back(ckpt::parameter_slot(name, *p));
  }
  for (auto& [name, b] : model.named_buffers(true, /*remove_duplicate=*/false))
    slots.push_back(ckpt::plain_slot(name, *b));
  return slots;
}

// The optimizer's parameters by their names in `model`. A tied tensor's state is keyed by its
// first name, whichever of its Parameters the optimizer holds. An optimizer parameter that is not
// the model's is an error naming its index.
std::vector<std::pair<size_t, std::string>> optimizer_params(Module& model, Optimizer& opt,
                                                             const char* op) {
  std::map<const TensorImpl*, std::string> names;
  for (auto& [name, p] : model.named_parameters())
    names[p->stored().impl()] = name;
  std::vector<std::pair<size_t, std::string>> out;
  for (size_t i = 0; i < opt.params().size(); ++i) {
    const Parameter* p = opt.params()[i];
    auto it = names.find(p->stored().impl());
    TESSERA_CHECK(it != names.end(), op, ": optimizer parameter ", i, " ", p->str(),
                  " is not a parameter of the ", model.type_name(),
                  " (state is keyed by the model's parameter names)");
    out.emplace_back(i, it->second);
  }
  return out;
}

// As in PyTorch's optimizer.state_dict(), a parameter's state is kept whether or not it requires
// gradients now: one frozen after some updates (a stage of fine-tuning) keeps what it had. Only a
// frozen parameter that never had any is left out (a LoRA base weight would otherwise get two
// tensors of zeros of its size).
bool has_state(Optimizer& opt, size_t i) {
  if (opt.params()[i]->requires_grad() || opt.param_step(i) > 0) return true;
  for (const std::string& name : opt.state_names(i))
    if (opt.state_tensor(i, name, /*allocate=*/false).defined()) return true;
  return false;
}

std::string state_key(const std::string& fqn, const std::string& name) {
  return "state/" + fqn + "/" + name;
}

// "param_groups/<name>" for an optimizer of one group (the layout from before groups, so its
// checkpoints still load), "param_groups/<g>/<name>" for each group of several.
std::string group_key(const Optimizer& opt, size_t group, const std::string& name) {
  if (opt.num_param_groups() == 1) return "param_groups/" + name;
  return "param_groups/" + std::to_string(group) + "/" + name;
}

// Hyperparameters added after the first checkpoints were written: a dict without them loads,
// and leaves the optimizer's own values.
bool added_later(const std::string& name) {
  return name == "amsgrad" || name == "maximize" || name == "dampening" || name == "nesterov";
}

// The names of group g's parameters, one per line: PyTorch's param_groups[g]["params"] as
// get_optimizer_state_dict gives them (fully qualified names), which say which group of another
// optimizer a group's hyperparameters belong to.
std::string group_params(const Optimizer& opt,
                         const std::vector<std::pair<size_t, std::string>>& names, size_t g) {
  std::string out;
  for (const auto& [i, fqn] : names)
    if (opt.param_group_of(i) == g) out += (out.empty() ? "" : "\n") + fqn;
  return out;
}

// A hyperparameter that decides which state tensors a parameter has (Adam's amsgrad, SGD's
// momentum 0 or not) must agree with the optimizer's: the state keys were chosen by the
// optimizer's value, so the dict's state would not fit (PyTorch's load_state_dict takes both
// from the dict; here the optimizer is built with them). Set from the dict, it would start that
// state from zeros, or drop it, without a word.
std::function<std::string(const StateValue&)> layout_problem(const std::string& name, double mine) {
  if (name != "amsgrad" && name != "momentum") return nullptr;
  return [name, mine](const StateValue& v) -> std::string {
    const double theirs = std::get<double>(v);
    if ((theirs != 0) == (mine != 0)) return "";
    char text[160];
    std::snprintf(text, sizeof text, "%s %g in the dict, %g in the optimizer", name.c_str(), theirs,
                  mine);
    return std::string(text) + ": it decides which state tensors a parameter has (" +
           (name == "amsgrad" ? "max_exp_avg_sq" : "momentum_buffer") +
           "); build the optimizer with the dict's " + name;
  };
}

// How a dict's group g differs from the optimizer's, "" when it holds the same parameters (in
// any order: state is keyed by name, so the order does not matter).
std::string group_difference(const std::string& mine, const std::string& theirs, size_t g) {
  auto lines = [](const std::string& text) {
    std::set<std::string> out;
    size_t at = 0;
    while (at <= text.size()) {
      const size_t end = std::min(text.find('\n', at), text.size());
      if (end > at) out.insert(text.substr(at, end - at));
      at = end + 1;
    }
    return out;
  };
  const std::set<std::string> a = lines(mine), b = lines(theirs);
  std::string only_mine, only_theirs;
  for (const std::string& n : a)
    if (!b.count(n)) only_mine += (only_mine.empty() ? "" : ", ") + n;
  for (const std::string& n : b)
    if (!a.count(n)) only_theirs += (only_theirs.empty() ? "" : ", ") + n;
  if (only_mine.empty() && only_theirs.empty()) return "";
  std::string why = "the dict's param group " + std::to_string(g) +
                    " holds other parameters than the optimizer's";
  if (!only_theirs.empty()) why += "; only the dict's: " + only_theirs;
  if (!only_mine.empty()) why += "; only the optimizer's: " + only_mine;
  return why + "; its hyperparameters are another group's";
}

}  // namespace

namespace ckpt {

bool added_later_optimizer_key(const std::string& key) {
  const size_t last = key.rfind('/');
  if (last == std::string::npos) return false;
  const std::string name = key.substr(last + 1);
  if (!added_later(name) && name != "params") return false;
  std::string parent = key.substr(0, last);
  const size_t cut = parent.rfind('/');
  const std::string tail = cut == std::string::npos ? parent : parent.substr(cut + 1);
  if (!tail.empty() &&
      std::all_of(tail.begin(), tail.end(), [](char c) { return c >= '0' && c <= '9'; }))
    parent = cut == std::string::npos ? "" : parent.substr(0, cut);
  return parent == "param_groups" || parent.ends_with("/param_groups");
}

std::string optimizer_unit_of(const std::string& key) {
  const size_t last = key.rfind('/');
  if (last == std::string::npos || last == 0) return "";
  static const std::set<std::string> names = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                              "momentum_buffer"};
  if (!names.count(key.substr(last + 1))) return "";
  const std::string unit = key.substr(0, last);
  const size_t fqn = unit.rfind('/');
  if (fqn == std::string::npos) return "";
  const std::string parent = unit.substr(0, fqn);
  return parent == "state" || parent.ends_with("/state") ? unit : "";
}

}  // namespace ckpt

std::string state_value_str(const StateValue& v) {
  if (const auto* t = std::get_if<Tensor>(&v)) return t->defined() ? t->str() : "undefined Tensor";
  if (const auto* d = std::get_if<DTensor>(&v)) return d->str();
  if (const auto* i = std::get_if<int64_t>(&v)) return "int64 " + std::to_string(*i);
  if (const auto* x = std::get_if<double>(&v)) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "double %.17g", *x);
    return buf;
  }
  return "string \"" + std::get<std::string>(v) + "\"";
}

void insert_state_dict(StateDict& into, const std::string& prefix, const StateDict& part) {
  TESSERA_CHECK(!prefix.empty() && prefix.back() != '/', "insert_state_dict: prefix '", prefix,
                "' must be non-empty and not end in '/'");
  for (const auto& [key, v] : part) {
    const std::string k = prefix + "/" + key;
    TESSERA_CHECK(!into.count(k), "insert_state_dict: key '", k, "' is already present");
    into[k] = v;
  }
}

StateDict sub_state_dict(const StateDict& state, const std::string& prefix) {
  StateDict out;
  const std::string p = prefix + "/";
  for (auto it = state.lower_bound(p); it != state.end() && it->first.compare(0, p.size(), p) == 0;
       ++it)
    out[it->first.substr(p.size())] = it->second;
  return out;
}

StateDict get_model_state_dict(Module& model, const StateDictOptions& options) {
  StateDict out;
  ckpt::get_slots(model_slots(model, options), options, out);
  return out;
}

IncompatibleKeys set_model_state_dict(Module& model, const StateDict& state,
                                      const StateDictOptions& options) {
  return ckpt::set_slots(model_slots(model, options), {}, state, options,
                         "set_model_state_dict into " + model.type_name());
}

StateDict get_optimizer_state_dict(Module& model, Optimizer& optimizer,
                                   const StateDictOptions& options) {
  std::vector<Slot> slots;
  StateDict scalars;
  const auto names = optimizer_params(model, optimizer, "get_optimizer_state_dict");
  for (const auto& [i, fqn] : names) {
    if (!has_state(optimizer, i)) continue;
    const Parameter& p = *optimizer.params()[i];
    for (const std::string& name : optimizer.state_names(i))
      slots.push_back(ckpt::slot_like(state_key(fqn, name),
                                      optimizer.state_tensor(i, name, /*allocate=*/true), p));
    scalars[state_key(fqn, "step")] = optimizer.param_step(i);
  }
  for (size_t g = 0; g < optimizer.num_param_groups(); ++g) {
    for (const auto& [name, v] : optimizer.hyperparameters(g))
      scalars[group_key(optimizer, g, name)] = v;
    if (optimizer.num_param_groups() > 1)
      scalars[group_key(optimizer, g, "params")] = group_params(optimizer, names, g);
  }
  StateDict out;
  ckpt::get_slots(slots, options, out);
  const bool keep = !(options.full_state_dict && options.cpu_offload) || world_rank() == 0;
  if (keep) out.insert(scalars.begin(), scalars.end());
  return out;
}

IncompatibleKeys set_optimizer_state_dict(Module& model, Optimizer& optimizer,
                                          const StateDict& state, const StateDictOptions& options) {
  std::vector<Slot> slots;
  std::vector<ScalarSlot> scalars;
  std::vector<ckpt::OptionalSlots> optional;
  // The frozen parameters without state that this call creates state for (the dict holds some).
  std::vector<std::pair<size_t, std::string>> created;
  const auto names = optimizer_params(model, optimizer, "set_optimizer_state_dict");
  for (const auto& [i, fqn] : names) {
    // The slots of parameter i; its state tensors are created (as zeros) here.
    auto add = [&optimizer, i = i, fqn = fqn](std::vector<Slot>& to,
                                              std::vector<ScalarSlot>& to_scalars) {
      const Parameter& p = *optimizer.params()[i];
      const std::string unit = "state/" + fqn;
      for (const std::string& name : optimizer.state_names(i)) {
        to.push_back(ckpt::slot_like(state_key(fqn, name),
                                     optimizer.state_tensor(i, name, /*allocate=*/true), p));
        to.back().unit = unit;
      }
      to_scalars.push_back({state_key(fqn, "step"), ckpt::ScalarKind::Int64,
                            [&optimizer, i](const StateValue& v) {
                              optimizer.set_param_step(i, std::get<int64_t>(v));
                            },
                            false, unit,
                            [](const StateValue& v) -> std::string {
                              return std::get<int64_t>(v) < 0 ? "a step count below 0" : "";
                            }});
    };
    // A frozen parameter with no state takes the dict's state when it holds some, and is left
    // without any (none created) when it holds none.
    if (has_state(optimizer, i))
      add(slots, scalars);
    else
      optional.push_back(
          {state_key(fqn, ""), [add, &created, i = i, fqn = fqn](
                                   std::vector<Slot>& to, std::vector<ScalarSlot>& to_scalars) {
             created.emplace_back(i, fqn);
             add(to, to_scalars);
           }});
  }
  // State created for a frozen parameter that did not load (an error, or with strict = false a
  // unit left out) is dropped again: it still has none, as before the call. Zeros left there
  // would be saved with it from then on, and make the next dict without its state miss keys.
  const auto drop_unloaded = [&](const IncompatibleKeys* k) {
    std::vector<Parameter*> drop;
    for (const auto& [i, fqn] : created) {
      const std::string unit = state_key(fqn, "");
      bool loaded = k != nullptr;
      if (loaded)
        for (const std::vector<std::string>* keys : {&k->missing_keys, &k->mismatched_keys})
          for (size_t j = 0; loaded && j < keys->size(); ++j)
            loaded = (*keys)[j].compare(0, unit.size(), unit) != 0;
      if (!loaded) drop.push_back(optimizer.params()[i]);
    }
    if (!drop.empty()) optimizer.reset_state(drop);
  };
  // Each group's hyperparameters are collected and set together, so that their checks see them
  // all. A dict's group that holds other parameters than the optimizer's (groups built in
  // another order) has its hyperparameters mismatched: PyTorch's set_optimizer_state_dict maps
  // groups by their parameters' names, and applying them by position would set another group's
  // learning rate or weight decay without a word. Dicts from before groups carried their
  // parameters' names are taken by position.
  std::vector<std::map<std::string, double>> hyper(optimizer.num_param_groups());
  for (size_t g = 0; g < optimizer.num_param_groups(); ++g) {
    // With several groups, a group's hyperparameters and its names load together: names of
    // another group leave them all unloaded.
    const std::string unit =
        optimizer.num_param_groups() > 1 ? "param_groups/" + std::to_string(g) : "";
    if (!unit.empty())
      scalars.push_back({group_key(optimizer, g, "params"), ckpt::ScalarKind::String,
                         [](const StateValue&) {}, /*optional=*/true, unit,
                         [mine = group_params(optimizer, names, g), g](const StateValue& v) {
                           return group_difference(mine, std::get<std::string>(v), g);
                         }});
    for (const auto& [name, v] : optimizer.hyperparameters(g))
      scalars.push_back(
          {group_key(optimizer, g, name), ckpt::ScalarKind::Double,
           [&hyper, g, name = name](const StateValue& x) { hyper[g][name] = std::get<double>(x); },
           added_later(name), unit, layout_problem(name, v)});
  }
  const std::string what = "set_optimizer_state_dict into " + model.type_name();
  // The dict's hyperparameters are checked before anything is copied, so that a bad one (a
  // negative lr) leaves the optimizer as it was. Agreed: with broadcast_from_rank0 only rank 0
  // holds them, and every rank must stop if it fails.
  run_agreed(ckpt::context().group, what, [&] {
    for (size_t g = 0; g < optimizer.num_param_groups(); ++g) {
      std::map<std::string, double> values;
      for (const auto& [name, v] : optimizer.hyperparameters(g)) {
        auto it = state.find(group_key(optimizer, g, name));
        if (it != state.end() && std::holds_alternative<double>(it->second))
          values[name] = std::get<double>(it->second);
      }
      if (!values.empty()) optimizer.validate_hyperparameters(g, values);
    }
  });
  IncompatibleKeys k;
  try {
    k = ckpt::set_slots(slots, scalars, state, options, what, optional);
  } catch (...) {
    drop_unloaded(nullptr);
    throw;
  }
  drop_unloaded(&k);
  for (size_t g = 0; g < hyper.size(); ++g)
    if (!hyper[g].empty()) optimizer.set_hyperparameters(g, hyper[g]);
  return k;
}

}  // namespace tessera
