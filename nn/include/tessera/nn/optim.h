#pragma once
// Optimizers update each parameter's local piece in place. Their state tensors have the
// parameters' local shapes (for DTensor parameters: the same placements), so sharded parameters
// have sharded state.
#include <vector>

#include "tessera/nn/module.h"

namespace tessera {

class Optimizer {
 public:
  explicit Optimizer(std::vector<Parameter*> params) : params_(std::move(params)) {}
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  void zero_grad();
  const std::vector<Parameter*>& params() const { return params_; }
  double lr() const { return lr_; }
  void set_lr(double lr) { lr_ = lr; }

 protected:
  std::vector<Parameter*> params_;
  double lr_ = 1e-3;
};

struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double weight_decay = 0.0;  // L2, added to the gradient (PyTorch SGD)
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Parameter*> params, SGDOptions opts);
  void step() override;

 private:
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
  int64_t step_count() const { return step_; }
  // State as DTensors (or plain tensors) with the parameters' placements, for checkpoints.
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }

 private:
  AdamWOptions opts_;
  int64_t step_ = 0;
  std::vector<int64_t> param_steps_;  // per parameter, for bias correction
  std::vector<Tensor> m_, v_;
};

// Scales all gradients so that their global L2 norm is at most max_norm; returns the norm before
// clipping. Sharded gradients contribute the sum over their shards, replicated ones once.
double clip_grad_norm_(const std::vector<Parameter*>& params, double max_norm);

}  // namespace tessera
