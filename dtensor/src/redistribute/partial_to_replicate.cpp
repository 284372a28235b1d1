// P -> R: all-reduce with the partial's op. The gradient of a Partial tensor is Replicate, so
// backward is the identity.
#include "transitions.h"

namespace tessera::redistribute_detail {

namespace {

class PartialToReplicate final : public Transition {
 public:
  const char* name() const override { return "partial_to_replicate"; }
  bool applies(const Placement& from, const Placement& to) const override {
    return from.is_partial() && to.is_replicate();
  }
  Tensor apply(const Tensor& local, const DTensorSpec& before,
               const RedistributeStep& step) const override {
    Tensor out = local.clone();
    before.mesh.group(step.mesh_dim)
        ->all_reduce(out, step.before[size_t(step.mesh_dim)].reduce_op())
        ->wait();
    return out;
  }
  Tensor backward(const Tensor& grad, const DTensorSpec&, const RedistributeStep&) const override {
    return grad;
  }
  // A ring all-reduce: a reduce-scatter and an all-gather, each sending (n - 1) / n of the piece.
  int64_t bytes_moved(const DTensorSpec& before, const RedistributeStep& step) const override {
    const int64_t n = before.mesh.size(step.mesh_dim);
    return 2 * (local_bytes(before) * (n - 1) / n);
  }
};

}  // namespace

const Transition* partial_to_replicate() {
  static PartialToReplicate t;
  return &t;
}

}  // namespace tessera::redistribute_detail
