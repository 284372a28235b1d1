#pragma once
// Helpers the optimizers share (internal to nn/): gradient readiness, the dtype updates compute
// in, an update on a parameter's local piece, state slots and hyperparameter checks.
#include <map>
#include <string>
#include <vector>

#include "tessera/core/factory.h"
#include "tessera/nn/module.h"

namespace tessera::optim_detail {

// FSDP writes a parameter's gradient when its reduce-scatter completes, at the latest when
// backward() returns: reading it earlier (from a hook, say) would see a stale or missing value.
inline void check_grads_ready(const char* op, const std::vector<Parameter*>& params) {
  for (size_t i = 0; i < params.size(); ++i)
    TESSERA_CHECK(params[i] == nullptr || !params[i]->grad_pending(), op, ": parameter ", i, " of ",
                  params.size(), " ", params[i]->str(),
                  " is still waiting for FSDP's reduce-scatter of its gradient; call it after "
                  "backward() has returned");
}

// float32 and float64 are updated in place; 16-bit parameters through a float32 copy, with
// float32 optimizer state (the usual master-precision arrangement).
inline DType compute_dtype_of(DType dt) {
  return dt == DType::Float64 ? DType::Float64 : DType::Float32;
}

// Checks every parameter a step would update before any is: PyTorch's step refuses before it
// changes anything, and a refusal halfway would leave some parameters (and step counts) one
// step ahead of the others.
inline void check_updatable(const char* opt, const std::vector<Parameter*>& params) {
  for (size_t i = 0; i < params.size(); ++i) {
    const Parameter& p = *params[i];
    const Tensor grad = p.grad();
    if (!grad.defined()) continue;
    const Tensor& local = p.stored();
    TESSERA_CHECK(grad.shape() == local.shape(), opt, ": gradient ", grad.str(), " of parameter ",
                  i, " ", p.str(), " does not have the local shape ", shape_str(local.shape()));
    TESSERA_CHECK(is_floating(local.dtype()), opt, ": parameter ", i, " ", p.str(),
                  " is not floating point (dtype ", dtype_name(local.dtype()), ")");
  }
}

// Runs `update(param, grad)` on contiguous compute-dtype views of a parameter's local piece and
// gradient, writing the result back when the piece had to be copied. The step has called
// check_updatable on every parameter first.
template <class F>
void update_local(Parameter& p, F&& update) {
  const Tensor& local = p.stored();
  Tensor grad = p.grad();
  const DType ct = compute_dtype_of(local.dtype());
  Tensor work = local.detach();
  const bool in_place = work.dtype() == ct && work.is_contiguous();
  if (!in_place) work = work.to(ct).contiguous().clone();
  Tensor g = grad.detach().to(ct).contiguous();
  update(work, g);
  if (!in_place) local.detach().copy_(work);
}

// A state tensor as the first update creates it: zeros of the parameter's local shape in the
// dtype the update computes in.
inline Tensor& state_slot(std::vector<Tensor>& slots, size_t i, const Parameter& p, bool allocate) {
  Tensor& t = slots[i];
  if (!t.defined() && allocate)
    t = zeros(p.stored().shape(), TensorOptions(compute_dtype_of(p.dtype()), p.stored().device()));
  return t;
}

// Hyperparameter checks over a complete set, naming the optimizer (and group) in `where`.
inline void check_non_negative(const std::map<std::string, double>& v, const std::string& where,
                               std::initializer_list<const char*> names) {
  for (const char* k : names)
    TESSERA_CHECK(v.at(k) >= 0, where, ": ", k, " (", v.at(k), ") must be non-negative");
}
// Booleans travel as doubles (state dicts, maps): only 0 and 1 are booleans.
inline void check_bool(const std::map<std::string, double>& v, const std::string& where,
                       std::initializer_list<const char*> names) {
  for (const char* k : names)
    TESSERA_CHECK(v.at(k) == 0 || v.at(k) == 1, where, ": ", k, " (", v.at(k),
                  ") is a boolean: 0 or 1");
}

}  // namespace tessera::optim_detail
