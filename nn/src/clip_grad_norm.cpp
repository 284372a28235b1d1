// clip_grad_norm_: the only optimizer-side function that needs communication (the norm).
#include <cmath>
#include <set>

#include "optim_util.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/optim.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/core/kernels/views.h"
#include "tessera/nn/optim.h"

namespace tessera {

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
  optim_detail::check_grads_ready("clip_grad_norm_", params);
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
