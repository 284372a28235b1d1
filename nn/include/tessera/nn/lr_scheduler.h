#pragma once
// Learning-rate schedulers with torch.optim.lr_scheduler's names, arguments and values. Each
// sets the lr of every parameter group of its optimizer, from the group's base lr (the lr it
// had when the first scheduler was built on the optimizer: PyTorch's "initial_lr"). As in
// PyTorch, construction already applies the value for epoch 0, and step() after each
// optimizer.step() applies the next; the updates are PyTorch's recursive (chainable) forms, so
// values agree with PyTorch's to rounding. A scheduler keeps a reference to its optimizer, which
// must outlive it.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/nn/optim.h"

namespace tessera {

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  // Advances one epoch (or iteration: whatever the loop counts) and sets each group's lr.
  virtual void step();
  // Each group's lr as this scheduler last set it.
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  // Steps taken: 0 right after construction.
  int64_t last_epoch() const { return last_epoch_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  Optimizer& optimizer() const { return *optimizer_; }
  // Progress only ("last_epoch", "base_lrs/<g>", "last_lr/<g>"): the settings (gamma, t_max,
  // ...) are the constructor's. The optimizer's lrs are not touched by loading: they come back
  // with the optimizer's own state dict, as in PyTorch.
  virtual std::map<std::string, double> state_dict() const;
  // A key this scheduler does not have, or one it has but the map lacks, is an error naming it.
  virtual void load_state_dict(const std::map<std::string, double>& state);

 protected:
  // Takes each group's base lr: its initial lr if a scheduler recorded one, else its lr now.
  LRScheduler(Optimizer& optimizer, std::string name);
  // Records the base lrs as the optimizer's initial lrs where none is yet: once the arguments
  // are checked, so that a scheduler refused by its constructor changes nothing.
  void record_initial_lrs();
  // PyTorch's _initial_step: the last line of each derived constructor.
  void initial_step() {
    record_initial_lrs();
    step();
  }
  // The lrs for last_epoch_: PyTorch's get_lr() (from each group's current lr) and
  // _get_closed_form_lr() (from the base lrs), which SequentialLR uses at its milestones.
  virtual std::vector<double> get_lr() const = 0;
  virtual std::vector<double> closed_form_lr() const { return get_lr(); }
  // Each group's current lr.
  std::vector<double> group_lrs() const;
  void set_lrs(const std::vector<double>& lrs);
  // PyTorch's step(0): restarts this scheduler at epoch 0 from its closed form.
  void restart();
  friend class SequentialLR;

  Optimizer* optimizer_;
  std::string name_;
  int64_t last_epoch_ = -1;
  std::vector<double> base_lrs_, last_lr_;
};

// lr = base_lr * lr_lambda(epoch); one function for every group, or one per group.
class LambdaLR : public LRScheduler {
 public:
  LambdaLR(Optimizer& optimizer, std::function<double(int64_t)> lr_lambda);
  LambdaLR(Optimizer& optimizer, std::vector<std::function<double(int64_t)>> lr_lambdas);

 protected:
  std::vector<double> get_lr() const override;

 private:
  std::vector<std::function<double(int64_t)>> lambdas_;
};

// lr = base_lr * gamma^(epoch / step_size): multiplied by gamma every step_size epochs.
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1);

 protected:
  std::vector<double> get_lr() const override;
  std::vector<double> closed_form_lr() const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// lr = base_lr * gamma^(milestones passed): multiplied by gamma at each milestone (a milestone
// listed twice, twice).
class MultiStepLR : public LRScheduler {
 public:
  MultiStepLR(Optimizer& optimizer, std::vector<int64_t> milestones, double gamma = 0.1);

 protected:
  std::vector<double> get_lr() const override;
  std::vector<double> closed_form_lr() const override;

 private:
  std::vector<int64_t> milestones_;  // sorted
  double gamma_;
};

// lr = base_lr * (start_factor + (end_factor - start_factor) * min(epoch, total_iters) /
// total_iters): a linear warmup (or decay) over total_iters epochs, then constant.
class LinearLR : public LRScheduler {
 public:
  LinearLR(Optimizer& optimizer, double start_factor = 1.0 / 3, double end_factor = 1.0,
           int64_t total_iters = 5);

 protected:
  std::vector<double> get_lr() const override;
  std::vector<double> closed_form_lr() const override;

 private:
  double start_factor_, end_factor_;
  int64_t total_iters_;
};

// lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / t_max)) / 2 (PyTorch's T_max);
// past t_max it rises again, as PyTorch's does.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& optimizer, int64_t t_max, double eta_min = 0.0);

 protected:
  std::vector<double> get_lr() const override;
  std::vector<double> closed_form_lr() const override;

 private:
  int64_t t_max_;
  double eta_min_;
};

// Runs schedulers[0] until milestones[0], then schedulers[1] restarted at its epoch 0, and so on
// (warmup, then cosine). The schedulers must be built on `optimizer`, in order, just before.
class SequentialLR : public LRScheduler {
 public:
  SequentialLR(Optimizer& optimizer, std::vector<std::shared_ptr<LRScheduler>> schedulers,
               std::vector<int64_t> milestones);
  void step() override;
  // Its own progress, and each scheduler's under "schedulers/<k>/".
  std::map<std::string, double> state_dict() const override;
  void load_state_dict(const std::map<std::string, double>& state) override;

 protected:
  std::vector<double> get_lr() const override { return group_lrs(); }

 private:
  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
  std::vector<int64_t> milestones_;
};

}  // namespace tessera
