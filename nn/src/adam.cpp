// torch.optim.Adam and AdamW on each parameter's local piece, group by group. One kernel serves
// both: Adam adds weight_decay * param to the gradient, AdamW shrinks the parameter instead.
#include <cmath>

#include "optim_util.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/core/kernels/optim.h"
#include "tessera/nn/optim.h"

namespace tessera {

using namespace optim_detail;

namespace {

std::map<std::string, double> to_map(const AdamOptions& o) {
  return {{"lr", o.lr},
          {"beta1", o.beta1},
          {"beta2", o.beta2},
          {"eps", o.eps},
          {"weight_decay", o.weight_decay},
          {"amsgrad", o.amsgrad ? 1.0 : 0.0},
          {"maximize", o.maximize ? 1.0 : 0.0}};
}

}  // namespace

Adam::Adam(const char* name, const ParamGroups& groups, AdamOptions defaults, bool decoupled)
    : Optimizer(name, groups), decoupled_(decoupled) {
  check_hyperparameters(to_map(defaults), name);
  groups_.assign(num_param_groups(), defaults);
  m_.resize(params_.size());
  v_.resize(params_.size());
  vmax_.resize(params_.size());
  apply_group_options(groups);
}

std::map<std::string, double> Adam::group_hyperparameters(size_t group) const {
  return to_map(groups_[group]);
}

void Adam::check_hyperparameters(const std::map<std::string, double>& v,
                                 const std::string& where) const {
  check_non_negative(v, where, {"lr", "eps", "weight_decay"});
  const double b1 = v.at("beta1"), b2 = v.at("beta2");
  TESSERA_CHECK(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1, where, ": betas (", b1, ", ", b2,
                ") must be in [0, 1)");
  check_bool(v, where, {"amsgrad", "maximize"});
}

void Adam::store_hyperparameters(size_t group, const std::map<std::string, double>& v) {
  groups_[group] = AdamOptions{.lr = v.at("lr"),
                               .beta1 = v.at("beta1"),
                               .beta2 = v.at("beta2"),
                               .eps = v.at("eps"),
                               .weight_decay = v.at("weight_decay"),
                               .amsgrad = v.at("amsgrad") != 0,
                               .maximize = v.at("maximize") != 0};
}

std::vector<std::string> Adam::state_names(size_t i) const {
  check_index(i, "Adam::state_names");
  if (groups_[param_group_of(i)].amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}

Tensor Adam::state_tensor(size_t i, const std::string& name, bool allocate) {
  check_index(i, "Adam::state_tensor");
  const bool amsgrad = groups_[param_group_of(i)].amsgrad;
  TESSERA_CHECK(name == "exp_avg" || name == "exp_avg_sq" || (amsgrad && name == "max_exp_avg_sq"),
                name_, "::state_tensor: unknown state '", name, "' of parameter ", i,
                amsgrad ? " (it has exp_avg, exp_avg_sq and max_exp_avg_sq)"
                        : " (it has exp_avg and exp_avg_sq; max_exp_avg_sq only with amsgrad)");
  std::vector<Tensor>& slots = name == "exp_avg" ? m_ : name == "exp_avg_sq" ? v_ : vmax_;
  return state_slot(slots, i, *params_[i], allocate);
}

void Adam::step() {
  NoGradGuard no_grad;
  const std::string op = name_ + ".step";
  check_grads_ready(op.c_str(), params_);
  check_updatable(op.c_str(), params_);
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    if (!p.grad().defined()) continue;
    const AdamOptions& o = groups_[param_group_of(i)];
    // Bias correction counts this parameter's own updates, like PyTorch's per-parameter step.
    const int64_t t = ++param_steps_[i];
    const kernels::AdamWStep s{
        .decay = decoupled_ ? 1.0 - o.lr * o.weight_decay : 1.0,
        .beta1 = o.beta1,
        .beta2 = o.beta2,
        .step_size = o.lr / (1.0 - std::pow(o.beta1, double(t))),
        .bias_correction2_sqrt = std::sqrt(1.0 - std::pow(o.beta2, double(t))),
        .eps = o.eps,
        .l2_weight_decay = decoupled_ ? 0.0 : o.weight_decay,
        .maximize = o.maximize};
    update_local(p, [&](Tensor& w, const Tensor& g) {
      state_slot(m_, i, p, /*allocate=*/true);
      state_slot(v_, i, p, /*allocate=*/true);
      // amsgrad switched on after some updates starts its maximum at zeros, i.e. from the
      // current exp_avg_sq on.
      if (o.amsgrad) state_slot(vmax_, i, p, /*allocate=*/true);
      Tensor none;
      kernels::adamw_update_(w, m_[i], v_[i], o.amsgrad ? vmax_[i] : none, g, s);
    });
  }
}

}  // namespace tessera
