// The LR schedulers: PyTorch's get_lr() (recursive, from each group's current lr) for step(),
// and _get_closed_form_lr() for SequentialLR's restarts at its milestones.
#include "tessera/nn/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <set>

namespace tessera {

LRScheduler::LRScheduler(Optimizer& optimizer, std::string name)
    : optimizer_(&optimizer), name_(std::move(name)) {
  // PyTorch's setdefault("initial_lr"): a second scheduler (the cosine after a warmup) takes the
  // lr the first one started from, not the warmup's first value it finds in the group now. It is
  // recorded on the optimizer once the derived constructor has checked its arguments
  // (record_initial_lrs), so that a refused scheduler leaves the optimizer as it was.
  for (size_t g = 0; g < optimizer.num_param_groups(); ++g)
    base_lrs_.push_back(optimizer.initial_lr(g).value_or(optimizer.hyperparameters(g).at("lr")));
}

void LRScheduler::record_initial_lrs() {
  for (size_t g = 0; g < base_lrs_.size(); ++g)
    if (!optimizer_->initial_lr(g)) optimizer_->set_initial_lr(g, base_lrs_[g]);
}

std::vector<double> LRScheduler::group_lrs() const {
  std::vector<double> out;
  for (size_t g = 0; g < optimizer_->num_param_groups(); ++g)
    out.push_back(optimizer_->hyperparameters(g).at("lr"));
  return out;
}

void LRScheduler::set_lrs(const std::vector<double>& lrs) {
  // Every group's lr is checked before any is set.
  for (size_t g = 0; g < lrs.size(); ++g)
    optimizer_->validate_hyperparameters(g, {{"lr", lrs[g]}});
  for (size_t g = 0; g < lrs.size(); ++g)
    optimizer_->set_hyperparameters(g, {{"lr", lrs[g]}});
  last_lr_ = group_lrs();
}

void LRScheduler::step() {
  // A step refused (an lr out of range, a lambda that throws) changes nothing.
  const int64_t before = last_epoch_;
  ++last_epoch_;
  try {
    set_lrs(get_lr());
  } catch (...) {
    last_epoch_ = before;
    throw;
  }
}

void LRScheduler::restart() {
  const int64_t before = last_epoch_;
  last_epoch_ = 0;
  try {
    set_lrs(closed_form_lr());
  } catch (...) {
    last_epoch_ = before;
    throw;
  }
}

std::map<std::string, double> LRScheduler::state_dict() const {
  std::map<std::string, double> out{{"last_epoch", double(last_epoch_)}};
  for (size_t g = 0; g < base_lrs_.size(); ++g) {
    out["base_lrs/" + std::to_string(g)] = base_lrs_[g];
    out["last_lr/" + std::to_string(g)] = last_lr_[g];
  }
  return out;
}

void LRScheduler::load_state_dict(const std::map<std::string, double>& state) {
  // This class's keys only: SequentialLR loads its schedulers' parts itself.
  const std::map<std::string, double> own = LRScheduler::state_dict();
  for (const auto& [key, v] : state)
    TESSERA_CHECK(own.count(key), name_, "::load_state_dict: unexpected key '", key,
                  "' (this scheduler's optimizer has ", base_lrs_.size(), " param groups)");
  for (const auto& [key, v] : own)
    TESSERA_CHECK(state.count(key), name_, "::load_state_dict: missing key '", key, "'");
  // -1: a scheduler of a SequentialLR that has not reached its milestone yet (PyTorch's too).
  const double e = state.at("last_epoch");
  TESSERA_CHECK(e >= -1 && e == std::floor(e), name_, "::load_state_dict: last_epoch (", e,
                ") is not a whole number >= -1");
  last_epoch_ = int64_t(e);
  for (size_t g = 0; g < base_lrs_.size(); ++g) {
    base_lrs_[g] = state.at("base_lrs/" + std::to_string(g));
    last_lr_[g] = state.at("last_lr/" + std::to_string(g));
  }
}

// --- LambdaLR ---

LambdaLR::LambdaLR(Optimizer& optimizer, std::function<double(int64_t)> lr_lambda)
    : LambdaLR(optimizer, std::vector<std::function<double(int64_t)>>(optimizer.num_param_groups(),
                                                                      std::move(lr_lambda))) {}

LambdaLR::LambdaLR(Optimizer& optimizer, std::vector<std::function<double(int64_t)>> lr_lambdas)
    : LRScheduler(optimizer, "LambdaLR"), lambdas_(std::move(lr_lambdas)) {
  TESSERA_CHECK(lambdas_.size() == base_lrs_.size(), "LambdaLR: expected ", base_lrs_.size(),
                " lr_lambdas (one per param group), got ", lambdas_.size());
  for (size_t g = 0; g < lambdas_.size(); ++g)
    TESSERA_CHECK(bool(lambdas_[g]), "LambdaLR: lr_lambda of param group ", g, " is empty");
  initial_step();
}

std::vector<double> LambdaLR::get_lr() const {
  std::vector<double> out;
  for (size_t g = 0; g < base_lrs_.size(); ++g)
    out.push_back(base_lrs_[g] * lambdas_[g](last_epoch_));
  return out;
}

// --- StepLR ---

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer, "StepLR"), step_size_(step_size), gamma_(gamma) {
  TESSERA_CHECK(step_size > 0, "StepLR: step_size (", step_size, ") must be positive");
  initial_step();
}

std::vector<double> StepLR::get_lr() const {
  std::vector<double> lrs = group_lrs();
  if (last_epoch_ == 0 || last_epoch_ % step_size_ != 0) return lrs;
  for (double& lr : lrs)
    lr *= gamma_;
  return lrs;
}

std::vector<double> StepLR::closed_form_lr() const {
  std::vector<double> out;
  for (double base : base_lrs_)
    out.push_back(base * std::pow(gamma_, double(last_epoch_ / step_size_)));
  return out;
}

// --- MultiStepLR ---

MultiStepLR::MultiStepLR(Optimizer& optimizer, std::vector<int64_t> milestones, double gamma)
    : LRScheduler(optimizer, "MultiStepLR"), milestones_(std::move(milestones)), gamma_(gamma) {
  std::sort(milestones_.begin(), milestones_.end());
  initial_step();
}

std::vector<double> MultiStepLR::get_lr() const {
  std::vector<double> lrs = group_lrs();
  const auto n = std::count(milestones_.begin(), milestones_.end(), last_epoch_);
  for (double& lr : lrs)
    lr *= std::pow(gamma_, double(n));
  return lrs;
}

std::vector<double> MultiStepLR::closed_form_lr() const {
  const auto passed =
      std::upper_bound(milestones_.begin(), milestones_.end(), last_epoch_) - milestones_.begin();
  std::vector<double> out;
  for (double base : base_lrs_)
    out.push_back(base * std::pow(gamma_, double(passed)));
  return out;
}

// --- LinearLR ---

LinearLR::LinearLR(Optimizer& optimizer, double start_factor, double end_factor,
                   int64_t total_iters)
    : LRScheduler(optimizer, "LinearLR"),
      start_factor_(start_factor),
      end_factor_(end_factor),
      total_iters_(total_iters) {
  TESSERA_CHECK(start_factor > 0 && start_factor <= 1, "LinearLR: start_factor (", start_factor,
                ") must be in (0, 1]");
  TESSERA_CHECK(end_factor >= 0 && end_factor <= 1, "LinearLR: end_factor (", end_factor,
                ") must be in [0, 1]");
  TESSERA_CHECK(total_iters > 0, "LinearLR: total_iters (", total_iters, ") must be positive");
  initial_step();
}

std::vector<double> LinearLR::get_lr() const {
  std::vector<double> lrs = group_lrs();
  if (last_epoch_ > total_iters_) return lrs;
  const double d = end_factor_ - start_factor_;
  const double factor =
      last_epoch_ == 0
          ? start_factor_
          : 1.0 + d / (double(total_iters_) * start_factor_ + double(last_epoch_ - 1) * d);
  for (double& lr : lrs)
    lr *= factor;
  return lrs;
}

std::vector<double> LinearLR::closed_form_lr() const {
  const double t = double(std::min(total_iters_, last_epoch_));
  std::vector<double> out;
  for (double base : base_lrs_)
    out.push_back(base *
                  (start_factor_ + (end_factor_ - start_factor_) * t / double(total_iters_)));
  return out;
}

// --- CosineAnnealingLR ---

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, int64_t t_max, double eta_min)
    : LRScheduler(optimizer, "CosineAnnealingLR"), t_max_(t_max), eta_min_(eta_min) {
  TESSERA_CHECK(t_max > 0, "CosineAnnealingLR: t_max (", t_max, ") must be positive");
  initial_step();
}

std::vector<double> CosineAnnealingLR::get_lr() const {
  std::vector<double> lrs = group_lrs();
  if (last_epoch_ == 0) return lrs;
  const double pi = std::numbers::pi, T = double(t_max_), e = double(last_epoch_);
  for (size_t g = 0; g < lrs.size(); ++g) {
    if ((last_epoch_ - 1 - t_max_) % (2 * t_max_) == 0)
      // The bottom of a cycle, where the ratio below would divide by 1 + cos(pi) = 0.
      lrs[g] += (base_lrs_[g] - eta_min_) * (1 - std::cos(pi / T)) / 2;
    else
      lrs[g] = (1 + std::cos(pi * e / T)) / (1 + std::cos(pi * (e - 1) / T)) * (lrs[g] - eta_min_) +
               eta_min_;
  }
  return lrs;
}

std::vector<double> CosineAnnealingLR::closed_form_lr() const {
  const double pi = std::numbers::pi;
  std::vector<double> out;
  for (double base : base_lrs_)
    out.push_back(eta_min_ + (base - eta_min_) *
                                 (1 + std::cos(pi * double(last_epoch_) / double(t_max_))) / 2);
  return out;
}

// --- SequentialLR ---

SequentialLR::SequentialLR(Optimizer& optimizer,
                           std::vector<std::shared_ptr<LRScheduler>> schedulers,
                           std::vector<int64_t> milestones)
    : LRScheduler(optimizer, "SequentialLR"),
      schedulers_(std::move(schedulers)),
      milestones_(std::move(milestones)) {
  TESSERA_CHECK(!schedulers_.empty(), "SequentialLR: expected at least one scheduler");
  TESSERA_CHECK(milestones_.size() == schedulers_.size() - 1, "SequentialLR: expected ",
                schedulers_.size() - 1, " milestones (one fewer than the ", schedulers_.size(),
                " schedulers), got ", milestones_.size());
  for (size_t k = 0; k < schedulers_.size(); ++k)
    TESSERA_CHECK(schedulers_[k] && &schedulers_[k]->optimizer() == &optimizer,
                  "SequentialLR: scheduler ", k,
                  schedulers_[k] ? " is built on another optimizer" : " is null");
  for (size_t k = 0; k < milestones_.size(); ++k)
    TESSERA_CHECK(milestones_[k] > (k == 0 ? 0 : milestones_[k - 1]), "SequentialLR: milestone ", k,
                  " (", milestones_[k], ") must be positive and after the one before");
  record_initial_lrs();
  // As PyTorch: back to the initial lrs, every scheduler one epoch back (each stepped once when
  // built), and the first one's epoch 0 applied again.
  last_epoch_ = 0;
  set_lrs(base_lrs_);
  for (auto& s : schedulers_)
    --s->last_epoch_;
  schedulers_[0]->initial_step();
  last_lr_ = schedulers_[0]->get_last_lr();
}

void SequentialLR::step() {
  const int64_t e = last_epoch_ + 1;
  const size_t k =
      size_t(std::upper_bound(milestones_.begin(), milestones_.end(), e) - milestones_.begin());
  LRScheduler& s = *schedulers_[k];
  if (k > 0 && milestones_[k - 1] == e)
    s.restart();
  else
    s.step();
  last_epoch_ = e;  // once the scheduler's step went through
  last_lr_ = s.get_last_lr();
}

std::map<std::string, double> SequentialLR::state_dict() const {
  std::map<std::string, double> out = LRScheduler::state_dict();
  for (size_t k = 0; k < schedulers_.size(); ++k)
    for (const auto& [key, v] : schedulers_[k]->state_dict())
      out["schedulers/" + std::to_string(k) + "/" + key] = v;
  return out;
}

void SequentialLR::load_state_dict(const std::map<std::string, double>& state) {
  std::map<std::string, double> own;
  std::vector<std::map<std::string, double>> parts(schedulers_.size());
  const std::string prefix = "schedulers/";
  for (const auto& [key, v] : state) {
    // "schedulers/<k>/<key>" with k one of ours; anything else is checked as our own key.
    bool part = false;
    if (key.rfind(prefix, 0) == 0)
      for (size_t k = 0; k < schedulers_.size() && !part; ++k) {
        const std::string p = prefix + std::to_string(k) + "/";
        if (key.rfind(p, 0) == 0) {
          parts[k][key.substr(p.size())] = v;
          part = true;
        }
      }
    if (!part) own[key] = v;
  }
  // Every part is checked before any is loaded.
  for (size_t k = 0; k < schedulers_.size(); ++k) {
    const std::map<std::string, double> want = schedulers_[k]->state_dict();
    for (const auto& [key, v] : want)
      TESSERA_CHECK(parts[k].count(key), "SequentialLR::load_state_dict: missing key 'schedulers/",
                    k, "/", key, "'");
    for (const auto& [key, v] : parts[k])
      TESSERA_CHECK(want.count(key), "SequentialLR::load_state_dict: unexpected key 'schedulers/",
                    k, "/", key, "'");
  }
  // A part can still be refused by its own scheduler (a bad last_epoch): then what was loaded
  // before it is put back, so that a refused load changes nothing.
  std::vector<std::map<std::string, double>> before;
  for (const auto& s : schedulers_)
    before.push_back(s->state_dict());
  const std::map<std::string, double> own_before = LRScheduler::state_dict();
  size_t loaded = 0;
  try {
    LRScheduler::load_state_dict(own);
    for (; loaded < schedulers_.size(); ++loaded)
      schedulers_[loaded]->load_state_dict(parts[loaded]);
  } catch (...) {
    LRScheduler::load_state_dict(own_before);
    for (size_t k = 0; k < loaded; ++k)
      schedulers_[k]->load_state_dict(before[k]);
    throw;
  }
}

}  // namespace tessera
