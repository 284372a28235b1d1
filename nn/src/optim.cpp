// SGD, AdamW and clip_grad_norm_ on each parameter's local piece. The updates are elementwise,
// so a sharded parameter updated shard by shard ends up exactly where the unsharded one would;
// only the gradient norm needs communication.
#include "tessera/nn/optim.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <set>

#include "tessera/autograd/grad_mode.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/optim.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/core/kernels/views.h"

namespace tessera {

namespace {

// An empty list is refused as PyTorch refuses it: such an optimizer's step() would do nothing,
// which is almost always a model whose parameters() came out empty (all frozen, or collected
// before the layers were added) rather than an intent.
void check_params(const char* opt, const std::vector<Parameter*>& params) {
  TESSERA_CHECK(!params.empty(), opt,
                ": optimizer got an empty parameter list (no parameter to update; were all "
                "parameters frozen, or collected before the layers were added?)");
  // A tensor listed twice (the same Parameter twice, or two Parameters tied by assignment) would
  // be updated twice per step with two states. Stricter than PyTorch, which warns for a duplicate
  // within one parameter group and refuses one across groups.
  std::map<const TensorImpl*, size_t> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    TESSERA_CHECK(params[i] != nullptr && params[i]->defined(), opt, ": parameter ", i, " of ",
                  params.size(), " is null or undefined");
    auto [it, first] = seen.emplace(params[i]->stored().impl(), i);
    TESSERA_CHECK(first, opt, ": parameter ", i, " of ", params.size(), " ", params[i]->str(),
                  " is parameter ", it->second,
                  " again (the same tensor; some parameters appear more than once, so each would "
                  "be updated once per appearance): list each once, e.g. from parameters(), "
                  "which lists tied weights once");
  }
}

// FSDP writes a parameter's gradient when its reduce-scatter completes, at the latest when
// backward() returns: reading it earlier (from a hook, say) would see a stale or missing value.
void check_grads_ready(const char* op, const std::vector<Parameter*>& params) {
  for (size_t i = 0; i < params.size(); ++i)
    TESSERA_CHECK(params[i] == nullptr || !params[i]->grad_pending(), op, ": parameter ", i, " of ",
                  params.size(), " ", params[i]->str(),
                  " is still waiting for FSDP's reduce-scatter of its gradient; call it after "
                  "backward() has returned");
}

// float32 and float64 are updated in place; 16-bit parameters through a float32 copy, with
// float32 optimizer state (the usual master-precision arrangement).
DType compute_dtype_of(DType dt) {
  return dt == DType::Float64 ? DType::Float64 : DType::Float32;
}

// Runs `update(param, grad)` on contiguous compute-dtype views of a parameter's local piece and
// gradient, writing the result back when the piece had to be copied.
template <class F>
void update_local(const char* opt, size_t index, Parameter& p, F&& update) {
  const Tensor& local = p.stored();
  Tensor grad = p.grad();
  TESSERA_CHECK(grad.shape() == local.shape(), opt, ": gradient ", grad.str(), " of parameter ",
                index, " ", p.str(), " does not have the local shape ", shape_str(local.shape()));
  TESSERA_CHECK(is_floating(local.dtype()), opt, ": parameter ", index, " ", p.str(),
                " is not floating point");
  const DType ct = compute_dtype_of(local.dtype());
  Tensor work = local.detach();
  const bool in_place = work.dtype() == ct && work.is_contiguous();
  if (!in_place) work = work.to(ct).contiguous().clone();
  Tensor g = grad.detach().to(ct).contiguous();
  update(work, g);
  if (!in_place) local.detach().copy_(work);
}

}  // namespace

void Optimizer::zero_grad() {
  for (Parameter* p : params_)
    p->zero_grad();
}

void Optimizer::check_index(size_t i, const char* op) const {
  TESSERA_CHECK(i < params_.size(), op, ": parameter index ", i,
                " out of range (the optimizer has ", params_.size(), " parameters)");
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

namespace {

// A state tensor as the first update creates it: zeros of the parameter's local shape in the
// dtype the update computes in.
Tensor& state_slot(std::vector<Tensor>& slots, size_t i, const Parameter& p, bool allocate) {
  Tensor& t = slots[i];
  if (!t.defined() && allocate)
    t = zeros(p.stored().shape(), TensorOptions(compute_dtype_of(p.dtype()), p.stored().device()));
  return t;
}

// Applies `values` to the named fields after checking them all: an unknown name lists the
// known ones, and a value outside its range names it, before anything changes.
void set_fields(const char* opt, const std::map<std::string, double>& values,
                const std::map<std::string, double*>& fields,
                const std::function<void(const std::map<std::string, double>&)>& validate) {
  std::map<std::string, double> next;
  for (const auto& [name, ptr] : fields)
    next[name] = *ptr;
  for (const auto& [name, v] : values) {
    if (!fields.count(name)) {
      std::string known;
      for (const auto& [k, ptr] : fields)
        known += (known.empty() ? "" : ", ") + k;
      TESSERA_FAIL(opt, ": unknown hyperparameter '", name, "' (it has ", known, ")");
    }
    next[name] = v;
  }
  validate(next);
  for (const auto& [name, v] : next)
    *fields.at(name) = v;
}

}  // namespace

// --- SGD ---

SGD::SGD(std::vector<Parameter*> params, SGDOptions opts)
    : Optimizer(std::move(params)), opts_(opts) {
  check_params("SGD", params_);
  TESSERA_CHECK(opts.lr >= 0 && opts.momentum >= 0 && opts.weight_decay >= 0, "SGD: lr (", opts.lr,
                "), momentum (", opts.momentum, ") and weight_decay (", opts.weight_decay,
                ") must be non-negative");
  lr_ = opts.lr;
  momentum_.resize(params_.size());
}

std::vector<std::string> SGD::state_names() const {
  // Without momentum SGD keeps no state (PyTorch's momentum_buffer stays None).
  if (opts_.momentum == 0) return {};
  return {"momentum_buffer"};
}

Tensor SGD::state_tensor(size_t i, const std::string& name, bool allocate) {
  check_index(i, "SGD::state_tensor");
  TESSERA_CHECK(name == "momentum_buffer", "SGD::state_tensor: unknown state '", name,
                "' (SGD has momentum_buffer)");
  return state_slot(momentum_, i, *params_[i], allocate);
}

std::map<std::string, double> SGD::hyperparameters() const {
  return {{"lr", lr_}, {"momentum", opts_.momentum}, {"weight_decay", opts_.weight_decay}};
}

void SGD::set_hyperparameters(const std::map<std::string, double>& values) {
  set_fields("SGD", values,
             {{"lr", &lr_}, {"momentum", &opts_.momentum}, {"weight_decay", &opts_.weight_decay}},
             [](const std::map<std::string, double>& v) {
               for (const auto& [name, x] : v)
                 TESSERA_CHECK(x >= 0, "SGD: ", name, " (", x, ") must be non-negative");
             });
  opts_.lr = lr_;
}

void SGD::step() {
  NoGradGuard no_grad;
  check_grads_ready("SGD.step", params_);
  const double lr = lr_, mom = opts_.momentum, wd = opts_.weight_decay;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    if (!p.grad().defined()) continue;
    update_local("SGD", i, p, [&](Tensor& w, const Tensor& g) {
      // PyTorch's first momentum step copies the gradient into the buffer. A buffer allocated
      // for loading a checkpoint is fresh too until its parameter has been updated once.
      const bool fresh = mom != 0 && param_steps_[i] == 0;
      if (mom != 0) state_slot(momentum_, i, p, /*allocate=*/true);
      Tensor none;
      kernels::sgd_update_(w, mom != 0 ? momentum_[i] : none, g,
                           {.lr = lr, .momentum = mom, .weight_decay = wd, .first = fresh});
    });
    ++param_steps_[i];
  }
}

// --- AdamW ---

AdamW::AdamW(std::vector<Parameter*> params, AdamWOptions opts)
    : Optimizer(std::move(params)), opts_(opts) {
  check_params("AdamW", params_);
  TESSERA_CHECK(opts.lr >= 0 && opts.eps >= 0 && opts.weight_decay >= 0, "AdamW: lr (", opts.lr,
                "), eps (", opts.eps, ") and weight_decay (", opts.weight_decay,
                ") must be non-negative");
  TESSERA_CHECK(opts.beta1 >= 0 && opts.beta1 < 1 && opts.beta2 >= 0 && opts.beta2 < 1,
                "AdamW: betas (", opts.beta1, ", ", opts.beta2, ") must be in [0, 1)");
  lr_ = opts.lr;
  m_.resize(params_.size());
  v_.resize(params_.size());
}

std::vector<std::string> AdamW::state_names() const {
  return {"exp_avg", "exp_avg_sq"};
}

Tensor AdamW::state_tensor(size_t i, const std::string& name, bool allocate) {
  check_index(i, "AdamW::state_tensor");
  TESSERA_CHECK(name == "exp_avg" || name == "exp_avg_sq", "AdamW::state_tensor: unknown state '",
                name, "' (AdamW has exp_avg and exp_avg_sq)");
  return state_slot(name == "exp_avg" ? m_ : v_, i, *params_[i], allocate);
}

std::map<std::string, double> AdamW::hyperparameters() const {
  return {{"lr", lr_},
          {"beta1", opts_.beta1},
          {"beta2", opts_.beta2},
          {"eps", opts_.eps},
          {"weight_decay", opts_.weight_decay}};
}

void AdamW::set_hyperparameters(const std::map<std::string, double>& values) {
  set_fields("AdamW", values,
             {{"lr", &lr_},
              {"beta1", &opts_.beta1},
              {"beta2", &opts_.beta2},
              {"eps", &opts_.eps},
              {"weight_decay", &opts_.weight_decay}},
             [](const std::map<std::string, double>& v) {
               for (const char* k : {"lr", "eps", "weight_decay"})
                 TESSERA_CHECK(v.at(k) >= 0, "AdamW: ", k, " (", v.at(k), ") must be non-negative");
               for (const char* k : {"beta1", "beta2"})
                 TESSERA_CHECK(v.at(k) >= 0 && v.at(k) < 1, "AdamW: ", k, " (", v.at(k),
                               ") must be in [0, 1)");
             });
  opts_.lr = lr_;
}

void AdamW::step() {
  NoGradGuard no_grad;
  check_grads_ready("AdamW.step", params_);
  ++step_;
  const double lr = lr_, b1 = opts_.beta1, b2 = opts_.beta2, eps = opts_.eps;
  const double decay = 1.0 - lr * opts_.weight_decay;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    if (!p.grad().defined()) continue;
    // Bias correction counts this parameter's own updates, like PyTorch's per-parameter step.
    const int64_t t = ++param_steps_[i];
    const double step_size = lr / (1.0 - std::pow(b1, double(t)));
    const double bc2_sqrt = std::sqrt(1.0 - std::pow(b2, double(t)));
    update_local("AdamW", i, p, [&](Tensor& w, const Tensor& g) {
      state_slot(m_, i, p, /*allocate=*/true);
      state_slot(v_, i, p, /*allocate=*/true);
      kernels::adamw_update_(w, m_[i], v_[i], g,
                             {.decay = decay,
                              .beta1 = b1,
                              .beta2 = b2,
                              .step_size = step_size,
                              .bias_correction2_sqrt = bc2_sqrt,
                              .eps = eps});
    });
  }
}

// --- clip_grad_norm_ ---

namespace {

// Adds the gradient's term of the total into `acc` (float64 [1] on the gradient's device): the sum
// of |g|^p, or for p = inf the largest |g| (NaN winning). Kept on the device, so that a device's
// terms reach the host once per group, not once per parameter.
void add_term(Tensor& acc, const Tensor& grad, double p) {
  const Tensor g = grad.detach();
  if (g.numel() == 0) return;  // an empty shard (amax refuses one)
  if (p == 2) {
    kernels::add_(acc, kernels::reshape(kernels::sum_of_squares(g), {1}));
    return;
  }
  Tensor a = kernels::unary(kernels::UnaryOp::Abs, g.to(DType::Float64));
  if (std::isinf(p)) {
    acc = kernels::binary(kernels::BinaryOp::Maximum, acc, kernels::reshape(kernels::amax(a), {1}));
    return;
  }
  if (p != 1) a = kernels::binary_scalar(kernels::BinaryOp::Pow, a, p);
  kernels::add_(acc, kernels::reshape(kernels::sum(a), {1}));
}

// Parameters whose gradients are split over the same mesh dims of the same mesh: their terms are
// combined locally and all-reduced once.
struct NormGroup {
  DeviceMesh mesh;
  std::vector<int64_t> shard_dims;
  Tensor acc;  // float64 [1] on the mesh's device
};

}  // namespace

double clip_grad_norm_(const std::vector<Parameter*>& params, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  NoGradGuard no_grad;
  // PyTorch also takes 0 (a count of non-zeros) and -inf (the smallest magnitude), which are not
  // norms to clip by.
  TESSERA_CHECK(norm_type > 0, "clip_grad_norm_: norm_type ", norm_type,
                " is not supported (any p > 0, or INFINITY)");
  check_grads_ready("clip_grad_norm_", params);
  const bool inf = std::isinf(norm_type);
  // Each tensor once: a gradient listed twice would count twice and be scaled twice.
  std::vector<Parameter*> unique;
  std::set<const TensorImpl*> seen;
  for (Parameter* p : params)
    if (p != nullptr && p->defined() && seen.insert(p->stored().impl()).second) unique.push_back(p);

  Tensor plain;  // plain parameters: every rank holds the same gradient
  std::vector<NormGroup> groups;
  for (Parameter* p : unique) {
    if (!p->is_dtensor()) {
      if (!plain.defined()) plain = zeros({1}, TensorOptions(DType::Float64, p->stored().device()));
      if (p->grad().defined()) add_term(plain, p->grad(), norm_type);
      continue;
    }
    // Groups come from the parameters alone (not from which have gradients), so every rank
    // issues the same all-reduces.
    const DTensorSpec& spec = p->stored_dtensor().spec();
    const Placements gp = spec.grad_placements();
    std::vector<int64_t> dims;
    for (int64_t m = 0; m < spec.mesh.ndim(); ++m)
      if (gp[size_t(m)].is_shard() && spec.mesh.size(m) > 1) dims.push_back(m);
    NormGroup* g = nullptr;
    for (NormGroup& cand : groups)
      if (cand.mesh == spec.mesh && cand.shard_dims == dims) g = &cand;
    if (g == nullptr)
      g = &groups.emplace_back(NormGroup{
          spec.mesh, dims, zeros({1}, TensorOptions(DType::Float64, spec.mesh.device()))});
    if (p->grad().defined()) add_term(g->acc, p->grad(), norm_type);
  }
  auto combine = [&](double total, double term) {
    if (!inf) return total + term;
    return std::isnan(term) || term > total ? term : total;
  };
  double total = plain.defined() ? plain.item<double>() : 0.0;
  for (NormGroup& g : groups) {
    // The maximum's NaN travels in a sum beside it: a max reduction need not keep a NaN.
    Tensor nan_probe = inf ? g.acc.clone() : Tensor();
    for (int64_t m : g.shard_dims) {
      g.mesh.group(m)->all_reduce(g.acc, inf ? ReduceOp::Max : ReduceOp::Sum)->wait();
      if (inf) g.mesh.group(m)->all_reduce(nan_probe, ReduceOp::Sum)->wait();
    }
    total = combine(total, g.acc.item<double>());
    if (inf && std::isnan(nan_probe.item<double>())) total = std::nan("");
  }
  const double norm = inf                ? total
                      : norm_type == 2.0 ? std::sqrt(total)
                      : norm_type == 1.0 ? total
                                         : std::pow(total, 1.0 / norm_type);
  TESSERA_CHECK(!error_if_nonfinite || std::isfinite(norm), "clip_grad_norm_: the total norm of ",
                "the gradients is ", norm, ", so they cannot be clipped (error_if_nonfinite)");
  const double coef = max_norm / (norm + 1e-6);
  // Not `coef < 1`: a NaN norm (a NaN gradient anywhere) must reach every gradient, as PyTorch's
  // clamped coefficient does, rather than leave the others to take an unclipped step.
  if (!(coef >= 1.0)) {
    for (Parameter* p : unique) {
      if (!p->grad().defined()) continue;
      Tensor g = p->grad();
      kernels::mul_scalar_(g, coef);
    }
  }
  return norm;
}

}  // namespace tessera
