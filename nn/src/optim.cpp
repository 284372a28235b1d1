// The Optimizer base: parameter groups, hyperparameters by name, per-parameter steps and state
// bookkeeping. The updates themselves are in sgd.cpp and adam.cpp; they are elementwise, so a
// sharded parameter updated shard by shard ends up exactly where the unsharded one would.
#include "tessera/nn/optim.h"

#include <algorithm>
#include <map>

#include "optim_util.h"

namespace tessera {

namespace {

// A tensor listed twice (the same Parameter twice, or two Parameters tied by assignment) would
// be updated twice per step with two states. Stricter than PyTorch, which warns for a duplicate
// within one parameter group and refuses one across groups.
void check_params(const char* opt, const std::vector<ParamGroup>& groups,
                  const std::vector<Parameter*>& params) {
  // An empty list is refused as PyTorch refuses it: such an optimizer's step() would do
  // nothing, which is almost always a model whose parameters() came out empty (all frozen, or
  // collected before the layers were added) rather than an intent.
  TESSERA_CHECK(!params.empty(), opt,
                ": optimizer got an empty parameter list (no parameter to update; were all "
                "parameters frozen, or collected before the layers were added?)");
  const bool grouped = groups.size() > 1;
  // Where each parameter was given: "parameter 3" (of 5, in the first mention), or with groups
  // "parameter 1 of param group 2".
  std::vector<std::string> where_given, count;
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t j = 0; j < groups[g].params.size(); ++j) {
      where_given.push_back("parameter " + std::to_string(j) +
                            (grouped ? " of param group " + std::to_string(g) : ""));
      count.push_back(grouped ? "" : " of " + std::to_string(params.size()));
    }
  std::map<const TensorImpl*, size_t> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    TESSERA_CHECK(params[i] != nullptr && params[i]->defined(), opt, ": ", where_given[i], count[i],
                  " is null or undefined");
    auto [it, first] = seen.emplace(params[i]->stored().impl(), i);
    TESSERA_CHECK(first, opt, ": ", where_given[i], count[i], " ", params[i]->str(), " is ",
                  where_given[it->second],
                  " again (the same tensor; some parameters appear more than once, so each would "
                  "be updated once per appearance): list each once, e.g. from parameters(), "
                  "which lists tied weights once, and put each in one group");
  }
}

}  // namespace

Optimizer::Optimizer(const char* name, const ParamGroups& list) : name_(name) {
  const std::vector<ParamGroup>& groups = list.groups;
  group_begin_.push_back(0);
  for (const ParamGroup& g : groups) {
    params_.insert(params_.end(), g.params.begin(), g.params.end());
    group_begin_.push_back(params_.size());
  }
  check_params(name, groups, params_);
  param_steps_.assign(params_.size(), 0);
  initial_lrs_.resize(groups.size());
}

void Optimizer::apply_group_options(const ParamGroups& list) {
  for (size_t g = 0; g < list.groups.size(); ++g)
    if (!list.groups[g].options.empty()) set_hyperparameters(g, list.groups[g].options);
}

void Optimizer::zero_grad(bool set_to_none) {
  for (Parameter* p : params_)
    p->zero_grad(set_to_none);
}

void Optimizer::check_index(size_t i, const char* op) const {
  TESSERA_CHECK(i < params_.size(), op, ": parameter index ", i,
                " out of range (the optimizer has ", params_.size(), " parameters)");
}

void Optimizer::check_group(size_t group, const char* op) const {
  TESSERA_CHECK(group < num_param_groups(), op, ": param group ", group,
                " out of range (the optimizer has ", num_param_groups(), ")");
}

std::string Optimizer::where(size_t group) const {
  if (num_param_groups() == 1) return name_;
  return name_ + " param group " + std::to_string(group);
}

size_t Optimizer::param_group_of(size_t i) const {
  check_index(i, "Optimizer::param_group_of");
  // The first group that ends after i (empty groups end where they begin).
  auto it = std::upper_bound(group_begin_.begin() + 1, group_begin_.end(), i);
  return size_t(it - group_begin_.begin()) - 1;
}

std::vector<ParamGroup> Optimizer::param_groups() const {
  std::vector<ParamGroup> out;
  for (size_t g = 0; g < num_param_groups(); ++g)
    out.push_back({std::vector<Parameter*>(params_.begin() + std::ptrdiff_t(group_begin_[g]),
                                           params_.begin() + std::ptrdiff_t(group_begin_[g + 1])),
                   group_hyperparameters(g)});
  return out;
}

std::map<std::string, double> Optimizer::hyperparameters(size_t group) const {
  check_group(group, "Optimizer::hyperparameters");
  return group_hyperparameters(group);
}

namespace {
// A group's hyperparameters with `values` applied; an unknown name is an error.
std::map<std::string, double> with_values(std::map<std::string, double> next,
                                          const std::map<std::string, double>& values,
                                          const std::string& where) {
  for (const auto& [name, v] : values) {
    if (!next.count(name)) {
      std::string known;
      for (const auto& [k, x] : next)
        known += (known.empty() ? "" : ", ") + k;
      TESSERA_FAIL(where, ": unknown hyperparameter '", name, "' (it has ", known, ")");
    }
    next[name] = v;
  }
  return next;
}
}  // namespace

void Optimizer::validate_hyperparameters(size_t group,
                                         const std::map<std::string, double>& values) const {
  check_group(group, "Optimizer::validate_hyperparameters");
  check_hyperparameters(with_values(group_hyperparameters(group), values, where(group)),
                        where(group));
}

void Optimizer::set_hyperparameters(size_t group, const std::map<std::string, double>& values) {
  check_group(group, "Optimizer::set_hyperparameters");
  std::map<std::string, double> next =
      with_values(group_hyperparameters(group), values, where(group));
  check_hyperparameters(next, where(group));
  store_hyperparameters(group, next);
}

void Optimizer::set_lr(double lr) {
  // Every group is checked before any changes.
  for (size_t g = 0; g < num_param_groups(); ++g) {
    std::map<std::string, double> next = group_hyperparameters(g);
    next["lr"] = lr;
    check_hyperparameters(next, where(g));
  }
  for (size_t g = 0; g < num_param_groups(); ++g)
    set_hyperparameters(g, {{"lr", lr}});
}

std::optional<double> Optimizer::initial_lr(size_t group) const {
  check_group(group, "Optimizer::initial_lr");
  return initial_lrs_[group];
}

void Optimizer::set_initial_lr(size_t group, double lr) {
  check_group(group, "Optimizer::set_initial_lr");
  initial_lrs_[group] = lr;
}

int64_t Optimizer::param_step(size_t i) const {
  check_index(i, "Optimizer::param_step");
  return param_steps_[i];
}

void Optimizer::reset_state(const std::vector<Parameter*>& params) {
  std::vector<size_t> which;
  for (Parameter* p : params) {
    auto it = std::find(params_.begin(), params_.end(), p);
    TESSERA_CHECK(it != params_.end(), "Optimizer::reset_state: ", p ? p->str() : "null",
                  " is not a parameter of this optimizer");
    which.push_back(size_t(it - params_.begin()));
  }
  for (size_t i : which) {
    clear_state(i);
    param_steps_[i] = 0;
  }
}

void Optimizer::set_param_step(size_t i, int64_t step) {
  check_index(i, "Optimizer::set_param_step");
  TESSERA_CHECK(step >= 0, "Optimizer::set_param_step: step ", step, " of parameter ", i,
                " is negative");
  param_steps_[i] = step;
}

}  // namespace tessera
