// R -> P: for a sum, coordinate 0 keeps the value and the others hold zeros; avg, max and min
// of equal values is the value, so every rank keeps it. In a copy, as PyTorch's division makes
// one: an in-place write to the Partial output must not reach the Replicate input (on
// coordinate 0 only, for a sum, it would leave the input differing across ranks). The gradient
// of the Partial output is Replicate and equals the input's: backward is the identity.
#include "tessera/core/factory.h"
#include "transitions.h"

namespace tessera::redistribute_detail {

namespace {

class ReplicateToPartial final : public Transition {
 public:
  const char* name() const override { return "replicate_to_partial"; }
  bool applies(const Placement& from, const Placement& to) const override {
    return from.is_replicate() && to.is_partial();
  }
  Tensor apply(const Tensor& local, const DTensorSpec& before,
               const RedistributeStep& step) const override {
    ReduceOp op = step.after[size_t(step.mesh_dim)].reduce_op();
    TESSERA_CHECK(op != ReduceOp::Product, "redistribute to Partial(product) is not supported");
    if (op == ReduceOp::Sum && before.mesh.coordinate()[size_t(step.mesh_dim)] != 0)
      return zeros_like(local);
    return local.clone();
  }
  Tensor backward(const Tensor& grad, const DTensorSpec&, const RedistributeStep&) const override {
    return grad;
  }
  int64_t bytes_moved(const DTensorSpec&, const RedistributeStep&) const override { return 0; }
};

}  // namespace

const Transition* replicate_to_partial() {
  static ReplicateToPartial t;
  return &t;
}

}  // namespace tessera::redistribute_detail
