// torch.optim.SGD on each parameter's local piece, group by group.
#include "optim_util.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/core/kernels/optim.h"
#include "tessera/nn/optim.h"

namespace tessera {

using namespace optim_detail;

namespace {

std::map<std::string, double> to_map(const SGDOptions& o) {
  return {{"lr", o.lr},
          {"momentum", o.momentum},
          {"weight_decay", o.weight_decay},
          {"dampening", o.dampening},
          {"nesterov", o.nesterov ? 1.0 : 0.0},
          {"maximize", o.maximize ? 1.0 : 0.0}};
}

}  // namespace

SGD::SGD(const ParamGroups& groups, SGDOptions defaults) : Optimizer("SGD", groups) {
  check_hyperparameters(to_map(defaults), "SGD");
  groups_.assign(num_param_groups(), defaults);
  momentum_.resize(params_.size());
  apply_group_options(groups);
}

std::map<std::string, double> SGD::group_hyperparameters(size_t group) const {
  return to_map(groups_[group]);
}

void SGD::check_hyperparameters(const std::map<std::string, double>& v,
                                const std::string& where) const {
  check_non_negative(v, where, {"lr", "momentum", "weight_decay", "dampening"});
  check_bool(v, where, {"nesterov", "maximize"});
  // As PyTorch: Nesterov's look-ahead is defined for an undamped momentum buffer.
  TESSERA_CHECK(v.at("nesterov") == 0 || (v.at("momentum") > 0 && v.at("dampening") == 0), where,
                ": nesterov momentum requires a momentum and zero dampening (momentum ",
                v.at("momentum"), ", dampening ", v.at("dampening"), ")");
}

void SGD::store_hyperparameters(size_t group, const std::map<std::string, double>& v) {
  groups_[group] = SGDOptions{.lr = v.at("lr"),
                              .momentum = v.at("momentum"),
                              .weight_decay = v.at("weight_decay"),
                              .dampening = v.at("dampening"),
                              .nesterov = v.at("nesterov") != 0,
                              .maximize = v.at("maximize") != 0};
}

std::vector<std::string> SGD::state_names(size_t i) const {
  check_index(i, "SGD::state_names");
  // Without momentum SGD keeps no state (PyTorch's momentum_buffer stays None).
  if (groups_[param_group_of(i)].momentum == 0) return {};
  return {"momentum_buffer"};
}

Tensor SGD::state_tensor(size_t i, const std::string& name, bool allocate) {
  check_index(i, "SGD::state_tensor");
  TESSERA_CHECK(name == "momentum_buffer", "SGD::state_tensor: unknown state '", name,
                "' (SGD has momentum_buffer)");
  return state_slot(momentum_, i, *params_[i], allocate);
}

void SGD::step() {
  NoGradGuard no_grad;
  check_grads_ready("SGD.step", params_);
  check_updatable("SGD.step", params_);
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    if (!p.grad().defined()) continue;
    const SGDOptions& o = groups_[param_group_of(i)];
    update_local(p, [&](Tensor& w, const Tensor& g) {
      // PyTorch's first momentum step copies the gradient into the buffer: the first step of
      // the parameter (a buffer allocated to load a checkpoint of a run that never stepped is
      // fresh too), or the first with momentum after steps without (no buffer yet).
      const bool fresh = o.momentum != 0 &&
                         (param_steps_[i] == 0 || i >= momentum_.size() || !momentum_[i].defined());
      if (o.momentum != 0) state_slot(momentum_, i, p, /*allocate=*/true);
      Tensor none;
      kernels::sgd_update_(w, o.momentum != 0 ? momentum_[i] : none, g,
                           {.lr = o.lr,
                            .momentum = o.momentum,
                            .weight_decay = o.weight_decay,
                            .first = fresh,
                            .dampening = o.dampening,
                            .nesterov = o.nesterov,
                            .maximize = o.maximize});
    });
    ++param_steps_[i];
  }
}

}  // namespace tessera
