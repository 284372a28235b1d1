#include "tessera/nn/parameter.h"

#include "tessera/autograd/grad_mode.h"
#include "tessera/dtensor/random.h"

namespace tessera {

Parameter::Parameter(Tensor t, bool requires_grad) : local_(t.detach()), shape_(t.shape()) {
  if (requires_grad) local_.set_requires_grad(true);
}

Parameter::Parameter(DTensor d, bool requires_grad)
    : local_(d.to_local().detach()), shape_(d.shape()) {
  dtensor_ = DTensor(d.spec_ptr(), local_);
  if (requires_grad) local_.set_requires_grad(true);
}

void Parameter::to(Device device) {
  if (!defined() || local_.device() == device) return;
  TESSERA_CHECK(!is_dtensor(), "Parameter::to(", device.str(), ") of ", str(),
                ": a distributed parameter lives on its mesh's device type; move the module "
                "before parallelize_module or fully_shard");
  const bool requires_grad = local_.requires_grad();
  local_ = local_.detach().to(device);
  if (requires_grad) local_.set_requires_grad(true);
}

const Tensor& Parameter::whole_local(const std::string& module, const char* name) const {
  if (defined() && is_dtensor())
    TESSERA_CHECK(local().shape() == global_shape(), module, ".forward: ", name, " is sharded (",
                  str(),
                  "); a module with sharded parameters runs on DTensors: apply a parallel style "
                  "(set_dtensor_io) or gather the parameter first");
  return local();
}

DTensor Parameter::on_mesh(const DeviceMesh& mesh) const {
  if (!defined()) return DTensor();
  if (is_dtensor()) return dtensor();
  return DTensor::from_local(local(), mesh, Placements(size_t(mesh.ndim()), Replicate()));
}

const DTensor& Parameter::dtensor() const {
  if (unsharded_local_.defined()) {
    TESSERA_CHECK(unsharded_dtensor_.defined(), "Parameter ", str(),
                  " is unsharded to a plain tensor; it has no DTensor to compute with");
    return unsharded_dtensor_;
  }
  TESSERA_CHECK(is_dtensor(), "Parameter ", str(), " is a plain tensor, not a DTensor");
  return dtensor_;
}

const DTensor& Parameter::stored_dtensor() const {
  TESSERA_CHECK(is_dtensor(), "Parameter ", str(), " is a plain tensor, not a DTensor");
  return dtensor_;
}

void Parameter::set_unsharded(Tensor local, DTensor dtensor) {
  TESSERA_CHECK(local.defined(), "Parameter::set_unsharded: undefined tensor for ", str());
  unsharded_local_ = std::move(local);
  unsharded_dtensor_ = std::move(dtensor);
}

void Parameter::clear_unsharded() {
  unsharded_local_ = Tensor();
  unsharded_dtensor_ = DTensor();
}

const Shape& Parameter::global_shape() const {
  return shape_;
}

void Parameter::set_requires_grad(bool r) {
  local_.set_requires_grad(r);
}

Tensor Parameter::full() const {
  if (!is_dtensor()) return local_.detach();
  NoGradGuard no_grad;
  return dtensor_.detach().full_tensor();
}

void Parameter::copy_from_full(const Tensor& full) {
  TESSERA_CHECK(full.defined() && full.shape() == shape_, "Parameter: global value ",
                full.defined() ? full.str() : std::string("(undefined)"),
                " does not match the parameter's global shape ", shape_str(shape_));
  NoGradGuard no_grad;
  if (is_dtensor()) {
    DTensor view(dtensor_.spec_ptr(), local_.detach());
    view.copy_from_full(full);
  } else {
    Tensor(local_.detach()).copy_(full);
  }
}

void Parameter::zero_grad(bool set_to_none) {
  const Tensor grad = local_.grad();
  if (set_to_none || !grad.defined()) {
    local_.set_grad(Tensor());
    return;
  }
  // As PyTorch: a gradient built with create_graph leaves its graph, and one that requires grad
  // stops; the storage stays, so the next backward accumulates into it.
  NoGradGuard no_grad;
  Tensor zeroed = grad.detach();
  zeroed.zero_();
  local_.set_grad(zeroed);
}

DTensor Parameter::grad_dtensor() const {
  TESSERA_CHECK(is_dtensor(), "Parameter ", str(), " is not a DTensor");
  return dtensor_.grad();
}

namespace {
// Draws into the stored leaf, as fill_ and copy_from_full write: while FSDP holds the parameter
// gathered, local() is the gathered copy, which the next gather (seeing the shard's new version)
// would overwrite with the shard's old values.
void fill_draw(Parameter& p, RandomKind kind, double a, double b, Generator& gen) {
  NoGradGuard no_grad;
  if (p.is_dtensor()) {
    DTensor view(p.stored_dtensor().spec_ptr(), p.stored().detach());
    if (kind == RandomKind::Uniform)
      uniform_(view, a, b, gen);
    else
      normal_(view, a, b, gen);
  } else {
    Tensor view = p.stored().detach();
    if (kind == RandomKind::Uniform)
      uniform_(view, a, b, gen);
    else
      normal_(view, a, b, gen);
  }
}
}  // namespace

void Parameter::kaiming_uniform_(Generator& gen, double a) {
  double bound = kaiming_uniform_bound(shape_, a, FanMode::FanIn);
  fill_draw(*this, RandomKind::Uniform, -bound, bound, gen);
}

void Parameter::uniform_(double low, double high, Generator& gen) {
  fill_draw(*this, RandomKind::Uniform, low, high, gen);
}

void Parameter::normal_(double mean, double std, Generator& gen) {
  fill_draw(*this, RandomKind::Normal, mean, std, gen);
}

void Parameter::fill_(double value) {
  NoGradGuard no_grad;
  Tensor view = local_.detach();
  view.fill_(value);
}

std::string Parameter::str() const {
  if (!defined()) return "Parameter(undefined)";
  return is_dtensor() ? "Parameter(" + dtensor_.str() + ")" : "Parameter(" + local_.str() + ")";
}

}  // namespace tessera
