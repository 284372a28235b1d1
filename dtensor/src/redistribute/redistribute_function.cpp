// DTensor::redistribute as an autograd Function: forward runs the plan's steps, backward runs
// each step's backward in reverse on the gradient (which carries grad placements).
#include "../mesh_sum.h"
#include "tessera/autograd/function.h"
#include "tessera/dtensor/dtensor.h"
#include "tessera/dtensor/redistribute.h"
#include "transitions.h"

namespace tessera {

namespace {

class RedistributeFn final : public autograd::Function {
 public:
  RedistributeFn(std::shared_ptr<const DTensorSpec> src, Placements dst)
      : src_(std::move(src)), dst_(std::move(dst)) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    plan_ = plan_redistribute(*src_, dst_);
    // A plan of no steps hands back the input; Function gives the output its own identity.
    return {redistribute_detail::run_plan(*plan_, *src_, in[0])};
  }

  // A single all-gather S(d) -> R on mesh dim m whose output's gradient arrives as unreduced
  // terms of a sum over m (the q, k and v projections of a sequence-parallel input) takes them
  // as they are: reduce-scattering the terms gives this rank's chunk of their sum, half the
  // bytes of all-reducing them and keeping the chunk.
  bool takes_partial_gradient(uint32_t output_nr,
                              const autograd::GradientReduction& reduction) const override {
    if (output_nr != 0 || !plan_ || plan_->steps.size() != 1) return false;
    const RedistributeStep& s = plan_->steps[0];
    const int64_t m = s.mesh_dim;
    if (s.before[size_t(m)].kind() != Placement::Kind::Shard || !s.after[size_t(m)].is_replicate())
      return false;
    const auto* sum = dynamic_cast<const dtensor_detail::MeshSum*>(&reduction);
    return sum != nullptr && sum->mesh() == src_->mesh && sum->dims() == std::vector<int64_t>{m};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    if (incoming_reduction(0)) return {reduce_scatter_terms(g[0])};
    return {redistribute_detail::run_plan_backward(*plan_, *src_, g[0])};
  }

 private:
  // The P -> S(d) step on the plan's mesh dim, from the gradient's placements (Partial there,
  // Replicate for the output's other Partial dims) to the source's.
  Tensor reduce_scatter_terms(const Tensor& terms) const {
    const RedistributeStep& fwd = plan_->steps[0];
    RedistributeStep step;
    step.mesh_dim = fwd.mesh_dim;
    step.before = fwd.after;
    for (Placement& p : step.before)
      if (p.is_partial()) p = Replicate();
    step.before[size_t(step.mesh_dim)] = Partial();
    step.after = fwd.before;
    for (Placement& p : step.after)
      if (p.is_partial()) p = Replicate();
    step.transition = redistribute_detail::partial_to_shard();
    const DTensorSpec before(src_->mesh, step.before, src_->global_shape, src_->dtype);
    return step.transition->apply(terms, before, step);
  }

  std::shared_ptr<const DTensorSpec> src_;
  Placements dst_;
  std::shared_ptr<const RedistributePlan> plan_;
};

}  // namespace

DTensor DTensor::redistribute(const Placements& placements) const {
  auto dst = std::make_shared<const DTensorSpec>(mesh(), placements, shape(), dtype());
  if (dst->placements == this->placements()) return *this;
  Tensor out = autograd::Function::apply<RedistributeFn>({local_}, spec_, dst->placements)[0];
  return DTensor(dst, out);
}

Tensor DTensor::full_tensor() const {
  return redistribute(Placements(size_t(mesh().ndim()), Replicate())).to_local();
}

Tensor DTensor::full_tensor(const Placements& grad_placements) const {
  return redistribute(Placements(size_t(mesh().ndim()), Replicate())).to_local(grad_placements);
}

}  // namespace tessera
