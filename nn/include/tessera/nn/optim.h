#pragma once
// Optimizers update each parameter's local piece in place. Their state tensors have the
// parameters' local shapes (for DTensor parameters: the same placements), so sharded parameters
// have sharded state.
#include <concepts>
#include <map>
#include <string>
#include <vector>

#include "tessera/nn/module.h"

namespace tessera {

class Optimizer {
 public:
  explicit Optimizer(std::vector<Parameter*> params)
      : params_(std::move(params)), param_steps_(params_.size(), 0) {}
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  void zero_grad();
  const std::vector<Parameter*>& params() const { return params_; }
  double lr() const { return lr_; }
  void set_lr(double lr) { lr_ = lr; }

  // --- state, as PyTorch's optimizer.state[p] and param_groups (for state dicts) ---
  // The names of the per-parameter state tensors ("exp_avg", "exp_avg_sq"; "momentum_buffer").
  virtual std::vector<std::string> state_names() const = 0;
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
  // The hyperparameters by name ("lr", "weight_decay", ...); setting checks every name and value
  // before changing anything.
  virtual std::map<std::string, double> hyperparameters() const = 0;
  virtual void set_hyperparameters(const std::map<std::string, double>& values) = 0;

 protected:
  void check_index(size_t i, const char* op) const;
  // Drops parameter i's state tensors.
  virtual void clear_state(size_t i) = 0;
  std::vector<Parameter*> params_;
  std::vector<int64_t> param_steps_;
  double lr_ = 1e-3;
};

struct SGDOptions {
  double lr = 1e-3;  // torch.optim.SGD's default
  double momentum = 0.0;
  double weight_decay = 0.0;  // L2, added to the gradient (PyTorch SGD)
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Parameter*> params, SGDOptions opts);
  void step() override;
  std::vector<std::string> state_names() const override;
  Tensor state_tensor(size_t i, const std::string& name, bool allocate) override;
  std::map<std::string, double> hyperparameters() const override;
  void set_hyperparameters(const std::map<std::string, double>& values) override;

 private:
  void clear_state(size_t i) override { momentum_[i] = Tensor(); }
  SGDOptions opts_;
  std::vector<Tensor> momentum_;
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;  // decoupled
};

class AdamW : public Optimizer {
 public:
  AdamW(std::vector<Parameter*> params, AdamWOptions opts);
  void step() override;
  std::vector<std::string> state_names() const override;
  Tensor state_tensor(size_t i, const std::string& name, bool allocate) override;
  std::map<std::string, double> hyperparameters() const override;
  void set_hyperparameters(const std::map<std::string, double>& values) override;
  // Calls of step() on this object (not part of its state: param_step() is).
  int64_t step_count() const { return step_; }
  // State as DTensors (or plain tensors) with the parameters' placements, for checkpoints.
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }

 private:
  void clear_state(size_t i) override {
    m_[i] = Tensor();
    v_[i] = Tensor();
  }
  AdamWOptions opts_;
  int64_t step_ = 0;
  std::vector<Tensor> m_, v_;
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
