// R -> S: each rank keeps its chunk, no communication; backward all-gathers the gradient.
#include "step_geometry.h"
#include "transitions.h"

namespace tessera::redistribute_detail {

namespace {

class ReplicateToShard final : public Transition {
 public:
  const char* name() const override { return "replicate_to_shard"; }
  bool applies(const Placement& from, const Placement& to) const override {
    return from.is_replicate() && to.is_shard();
  }
  Tensor apply(const Tensor& local, const DTensorSpec& before,
               const RedistributeStep& step) const override {
    int64_t d = step.after[size_t(step.mesh_dim)].dim();
    return own_chunk(local, step_geometry(before, step.after, step.mesh_dim, d));
  }
  Tensor backward(const Tensor& grad, const DTensorSpec& before,
                  const RedistributeStep& step) const override {
    int64_t d = step.after[size_t(step.mesh_dim)].dim();
    StepGeometry g = step_geometry(before, step.after, step.mesh_dim, d);
    return gather_pieces(grad, g, before.mesh.group(step.mesh_dim));
  }
  int64_t bytes_moved(const DTensorSpec&, const RedistributeStep&) const override { return 0; }
};

}  // namespace

const Transition* replicate_to_shard() {
  static ReplicateToShard t;
  return &t;
}

}  // namespace tessera::redistribute_detail
