#pragma once
// Optimizers update each parameter's local piece in place. Their state tensors have the
// parameters' local shapes (for DTensor parameters: the same placements), so sharded parameters
// have sharded state.
#include <concepts>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tessera/nn/module.h"

namespace tessera {

// One parameter group, as an entry of PyTorch's param_groups: its parameters and the
// hyperparameters it sets differently from the optimizer's defaults, by name (e.g.
// {{"weight_decay", 0.0}} for norms and biases). Booleans (amsgrad, maximize, nesterov) are 0 or 1.
struct ParamGroup {
  std::vector<Parameter*> params;
  std::map<std::string, double> options;
};

// The groups an optimizer is built from: a braced list, or a vector built at run time. (Its own
// type, not a vector, so that a braced list of parameters can never be read as groups.)
struct ParamGroups {
  ParamGroups(std::initializer_list<ParamGroup> list) : groups(list) {}
  ParamGroups(std::vector<ParamGroup> list) : groups(std::move(list)) {}
  std::vector<ParamGroup> groups;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  // Each parameter's gradient dropped (the default, PyTorch's set_to_none=True) or zeroed in
  // place (set_to_none=false: kept allocated for the next backward to accumulate into).
  void zero_grad(bool set_to_none = true);
  // Every group's parameters, group after group: the indices below are into this list.
  const std::vector<Parameter*>& params() const { return params_; }

  // --- parameter groups, as PyTorch's optimizer.param_groups ---
  size_t num_param_groups() const { return group_begin_.size() - 1; }
  // Each group's parameters and all its hyperparameters (a copy).
  std::vector<ParamGroup> param_groups() const;
  // The group that parameter i belongs to.
  size_t param_group_of(size_t i) const;
  // Group 0's lr; set_lr sets every group's (what an LR loop over PyTorch's param_groups does).
  // Per-group learning rates are set with set_hyperparameters(group, {{"lr", ...}}).
  double lr() const { return hyperparameters(0).at("lr"); }
  void set_lr(double lr);
  // The hyperparameters of a group by name ("lr", "weight_decay", ...); without a group: group
  // 0's, the optimizer's only one unless it was built from groups. Setting checks every name
  // and value before changing anything.
  std::map<std::string, double> hyperparameters(size_t group = 0) const;
  void set_hyperparameters(const std::map<std::string, double>& values) {
    set_hyperparameters(0, values);
  }
  void set_hyperparameters(size_t group, const std::map<std::string, double>& values);
  // The checks of set_hyperparameters, changing nothing (a state dict is checked before any of
  // it is copied).
  void validate_hyperparameters(size_t group, const std::map<std::string, double>& values) const;

  // --- state, as PyTorch's optimizer.state[p] (for state dicts) ---
  // The names of parameter i's state tensors ("exp_avg", "exp_avg_sq", with amsgrad
  // "max_exp_avg_sq"; "momentum_buffer" with momentum): they depend on its group's settings.
  virtual std::vector<std::string> state_names(size_t i) const = 0;
  // State tensor `name` of parameter i: the optimizer's own tensor (shared, not copied), with
  // the parameter's local shape in the dtype updates are computed in. Undefined while parameter
  // i has no such state yet, unless `allocate`, which creates it as zeros (so that a checkpoint
  // can be loaded into it). An unknown name or index is an error.
  virtual Tensor state_tensor(size_t i, const std::string& name, bool allocate) = 0;
  // How many updates parameter i has had (PyTorch's per-parameter "step"); 0 before its first.
  int64_t param_step(size_t i) const;
  void set_param_step(size_t i, int64_t step);
  // Forgets these parameters' state, as if they had never been updated (a LoRA slot given to a
  // new adapter, say). A parameter this optimizer does not hold is an error.
  void reset_state(const std::vector<Parameter*>& params);
  // The learning rate group g started from, recorded by the first LR scheduler built on this
  // optimizer (PyTorch's param_groups[g]["initial_lr"]); nullopt until then.
  std::optional<double> initial_lr(size_t group) const;
  void set_initial_lr(size_t group, double lr);

 protected:
  // Checks the groups (`name` is the optimizer's, for errors): at least one parameter, none
  // null, none in two places.
  Optimizer(const char* name, const ParamGroups& groups);
  // Applies each group's options over the defaults a derived class has set for every group;
  // called at the end of its constructor.
  void apply_group_options(const ParamGroups& groups);
  void check_index(size_t i, const char* op) const;
  void check_group(size_t group, const char* op) const;
  // The optimizer's name, and " param group g" when it has more than one: how errors name it.
  std::string where(size_t group) const;
  // Group g's hyperparameters; a complete set checked (`where` names it in errors), and stored.
  virtual std::map<std::string, double> group_hyperparameters(size_t group) const = 0;
  virtual void check_hyperparameters(const std::map<std::string, double>& values,
                                     const std::string& where) const = 0;
  virtual void store_hyperparameters(size_t group, const std::map<std::string, double>& values) = 0;
  // Drops parameter i's state tensors.
  virtual void clear_state(size_t i) = 0;
  std::string name_;
  std::vector<Parameter*> params_;
  std::vector<int64_t> param_steps_;
  std::vector<size_t> group_begin_;  // group g holds params_[group_begin_[g], group_begin_[g+1])
  std::vector<std::optional<double>> initial_lrs_;
};

struct SGDOptions {
  double lr = 1e-3;  // torch.optim.SGD's default
  double momentum = 0.0;
  double weight_decay = 0.0;  // L2, added to the gradient (PyTorch SGD)
  double dampening = 0.0;
  bool nesterov = false;  // needs momentum > 0 and dampening 0
  bool maximize = false;
};

// torch.optim.SGD.
class SGD : public Optimizer {
 public:
  SGD(std::vector<Parameter*> params, SGDOptions opts)
      : SGD(ParamGroups{{std::move(params), {}}}, opts) {}
  // Each group takes `defaults` where its options do not say otherwise.
  SGD(const ParamGroups& groups, SGDOptions defaults);
  void step() override;
  std::vector<std::string> state_names(size_t i) const override;
  Tensor state_tensor(size_t i, const std::string& name, bool allocate) override;

 private:
  std::map<std::string, double> group_hyperparameters(size_t group) const override;
  void check_hyperparameters(const std::map<std::string, double>& values,
                             const std::string& where) const override;
  void store_hyperparameters(size_t group, const std::map<std::string, double>& values) override;
  void clear_state(size_t i) override { momentum_[i] = Tensor(); }
  std::vector<SGDOptions> groups_;
  std::vector<Tensor> momentum_;
};

// torch.optim.Adam: weight decay is L2, added to the gradient.
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;  // the denominator uses the largest exp_avg_sq so far (max_exp_avg_sq)
  bool maximize = false;
};

// torch.optim.AdamW: the same fields; weight decay is decoupled (the parameter shrinks by
// lr * weight_decay of itself), and defaults to 1e-2.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
  bool maximize = false;
};

class Adam : public Optimizer {
 public:
  Adam(std::vector<Parameter*> params, AdamOptions opts)
      : Adam(ParamGroups{{std::move(params), {}}}, opts) {}
  // Each group takes `defaults` where its options do not say otherwise.
  Adam(const ParamGroups& groups, AdamOptions defaults)
      : Adam("Adam", groups, defaults, /*decoupled=*/false) {}
  void step() override;
  std::vector<std::string> state_names(size_t i) const override;
  Tensor state_tensor(size_t i, const std::string& name, bool allocate) override;
  // Calls of step() on this object (not part of its state: param_step() is).
  int64_t step_count() const { return step_; }
  // State as DTensors (or plain tensors) with the parameters' placements, for checkpoints.
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }

 protected:
  Adam(const char* name, const ParamGroups& groups, AdamOptions defaults, bool decoupled);

 private:
  std::map<std::string, double> group_hyperparameters(size_t group) const override;
  void check_hyperparameters(const std::map<std::string, double>& values,
                             const std::string& where) const override;
  void store_hyperparameters(size_t group, const std::map<std::string, double>& values) override;
  void clear_state(size_t i) override {
    m_[i] = Tensor();
    v_[i] = Tensor();
    vmax_[i] = Tensor();
  }
  bool decoupled_;  // AdamW's weight decay
  std::vector<AdamOptions> groups_;
  int64_t step_ = 0;
  std::vector<Tensor> m_, v_, vmax_;
};

// AdamW is Adam with decoupled weight decay (as in PyTorch, where it subclasses Adam).
class AdamW : public Adam {
 public:
  AdamW(std::vector<Parameter*> params, AdamWOptions opts)
      : AdamW(ParamGroups{{std::move(params), {}}}, opts) {}
  AdamW(const ParamGroups& groups, AdamWOptions defaults)
      : Adam("AdamW", groups,
             AdamOptions{defaults.lr, defaults.beta1, defaults.beta2, defaults.eps,
                         defaults.weight_decay, defaults.amsgrad, defaults.maximize},
             /*decoupled=*/true) {}
};

// Scales all gradients so that their global p-norm (norm_type: any p > 0, or INFINITY for the
// largest magnitude) is at most max_norm; returns the norm before clipping. Arguments in PyTorch's
// order. Sharded gradients contribute their shards' terms summed (for inf: their maximum),
// replicated ones once, so every rank computes the same norm; a gradient listed twice (tied
// weights) is counted and scaled once. A non-finite norm scales every gradient by NaN (an
// infinite one: by 0), as PyTorch does, or with error_if_nonfinite is an error (on every rank:
// they all computed the same norm), nothing scaled.
double clip_grad_norm_(const std::vector<Parameter*>& params, double max_norm,
                       double norm_type = 2.0, bool error_if_nonfinite = false);
// A bool third argument, clip_grad_norm_(params, max_norm, true), is the old order's
// error_if_nonfinite and would read as norm_type 1: refused at compile time.
template <class B>
requires std::same_as<B, bool>
double clip_grad_norm_(const std::vector<Parameter*>& params, double max_norm, B norm_type,
                       bool error_if_nonfinite = false) = delete;

}  // namespace tessera
