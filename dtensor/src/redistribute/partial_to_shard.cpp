// P -> S: reduce-scatter, so each rank only receives the reduction of its own chunk; backward
// all-gathers the (sharded) gradient into the Replicate gradient of the Partial input.
#include "step_geometry.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "transitions.h"

namespace tessera::redistribute_detail {

namespace {

class PartialToShard final : public Transition {
 public:
  const char* name() const override { return "partial_to_shard"; }
  bool applies(const Placement& from, const Placement& to) const override {
    return from.is_partial() && to.is_shard();
  }
  Tensor apply(const Tensor& local, const DTensorSpec& before,
               const RedistributeStep& step) const override {
    int64_t d = step.after[size_t(step.mesh_dim)].dim();
    StepGeometry g = step_geometry(before, step.after, step.mesh_dim, d);
    const ProcessGroupPtr& group = before.mesh.group(step.mesh_dim);
    ReduceOp op = step.before[size_t(step.mesh_dim)].reduce_op();
    Shape out_shape = local.shape();
    out_shape[size_t(d)] = g.lengths[size_t(g.index)];
    Tensor out = empty(out_shape, TensorOptions(local.dtype(), local.device()));
    if (g.even() && d == 0) {
      group->reduce_scatter_tensor(out, local.contiguous(), op)->wait();
      return out;
    }
    std::vector<Tensor> inputs;
    for (int64_t r = 0; r < g.parts; ++r)
      inputs.push_back(kernels::narrow(local, d, g.starts[size_t(r)], g.lengths[size_t(r)]));
    group->reduce_scatter(out, inputs, op)->wait();
    return out;
  }
  Tensor backward(const Tensor& grad, const DTensorSpec& before,
                  const RedistributeStep& step) const override {
    int64_t d = step.after[size_t(step.mesh_dim)].dim();
    StepGeometry g = step_geometry(before, step.after, step.mesh_dim, d);
    return gather_pieces(grad, g, before.mesh.group(step.mesh_dim));
  }
  int64_t bytes_moved(const DTensorSpec& before, const RedistributeStep& step) const override {
    int64_t n = before.mesh.size(step.mesh_dim);
    return local_bytes(before) * (n - 1) / n;
  }
};

}  // namespace

const Transition* partial_to_shard() {
  static PartialToShard t;
  return &t;
}

}  // namespace tessera::redistribute_detail
