// S -> R: all-gather the pieces of the mesh dim; backward takes this rank's chunk back.
#include "step_geometry.h"
#include "transitions.h"

namespace tessera::redistribute_detail {

namespace {

class ShardToReplicate final : public Transition {
 public:
  const char* name() const override { return "shard_to_replicate"; }
  bool applies(const Placement& from, const Placement& to) const override {
    return from.is_shard() && to.is_replicate();
  }
  Tensor apply(const Tensor& local, const DTensorSpec& before,
               const RedistributeStep& step) const override {
    int64_t d = step.before[size_t(step.mesh_dim)].dim();
    StepGeometry g = step_geometry(before, step.before, step.mesh_dim, d);
    return gather_pieces(local, g, before.mesh.group(step.mesh_dim));
  }
  Tensor backward(const Tensor& grad, const DTensorSpec& before,
                  const RedistributeStep& step) const override {
    int64_t d = step.before[size_t(step.mesh_dim)].dim();
    return own_chunk(grad, step_geometry(before, step.before, step.mesh_dim, d));
  }
  int64_t bytes_moved(const DTensorSpec& before, const RedistributeStep& step) const override {
    int64_t d = step.before[size_t(step.mesh_dim)].dim();
    StepGeometry g = step_geometry(before, step.before, step.mesh_dim, d);
    return local_bytes(before) * (g.parts - 1);
  }
};

}  // namespace

const Transition* shard_to_replicate() {
  static ShardToReplicate t;
  return &t;
}

}  // namespace tessera::redistribute_detail
