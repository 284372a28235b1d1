// DTensor::redistribute as an autograd Function: forward runs the plan's steps, backward runs
// each step's backward in reverse on the gradient (which carries grad placements).
#include "tessera/autograd/function.h"
#include "tessera/dtensor/dtensor.h"
#include "tessera/dtensor/redistribute.h"

namespace tessera {

namespace {

class RedistributeFn final : public autograd::Function {
 public:
  RedistributeFn(std::shared_ptr<const DTensorSpec> src, Placements dst)
      : src_(std::move(src)), dst_(std::move(dst)) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    plan_ = plan_redistribute(*src_, dst_);
    Tensor cur = in[0];
    for (const RedistributeStep& s : plan_->steps) {
      DTensorSpec before(src_->mesh, s.before, src_->global_shape, src_->dtype);
      cur = s.transition->apply(cur, before, s);
    }
    // A plan of no steps hands back the input; give the output its own identity.
    return {cur};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    Tensor cur = g[0];
    for (auto it = plan_->steps.rbegin(); it != plan_->steps.rend(); ++it) {
      DTensorSpec before(src_->mesh, it->before, src_->global_shape, src_->dtype);
      cur = it->transition->backward(cur, before, *it);
    }
    return {cur};
  }

 private:
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

}  // namespace tessera
