// S(a) -> S(b) on one mesh dim: one all-to-all instead of a gather and a re-cut. Each rank
// sends every peer the part of its a-chunk that falls in the peer's b-chunk; backward is the
// all-to-all the other way.
#include "step_geometry.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "transitions.h"

namespace tessera::redistribute_detail {

namespace {

// Every piece is a view: the a-chunk's slice of each peer's b-chunk is sent from where it lies
// in `local`, and what each peer sends lands in its slice of the result, so nothing is packed,
// unpacked or joined here (the MPI layer hands strided views to MPI as datatypes).
Tensor all_to_all_reshard(const Tensor& local, const DTensorSpec& spec, int64_t mesh_dim,
                          const Placements& from, const Placements& to) {
  const int64_t a = from[size_t(mesh_dim)].dim(), b = to[size_t(mesh_dim)].dim();
  StepGeometry ga = step_geometry(spec, from, mesh_dim, a);
  StepGeometry gb = step_geometry(spec, to, mesh_dim, b);
  Shape out_shape = local.shape();
  out_shape[size_t(a)] = ga.parent;
  out_shape[size_t(b)] = gb.lengths[size_t(gb.index)];
  Tensor out = empty(out_shape, TensorOptions(local.dtype(), local.device()));
  std::vector<Tensor> inputs, outputs;
  for (int64_t r = 0; r < ga.parts; ++r) {
    inputs.push_back(kernels::narrow(local, b, gb.starts[size_t(r)], gb.lengths[size_t(r)]));
    outputs.push_back(kernels::narrow(out, a, ga.starts[size_t(r)], ga.lengths[size_t(r)]));
  }
  spec.mesh.group(mesh_dim)->all_to_all(outputs, inputs)->wait();
  return out;
}

class ShardToShard final : public Transition {
 public:
  const char* name() const override { return "shard_to_shard"; }
  bool applies(const Placement& from, const Placement& to) const override {
    return from.kind() == Placement::Kind::Shard && to.kind() == Placement::Kind::Shard &&
           from.dim() != to.dim();
  }
  Tensor apply(const Tensor& local, const DTensorSpec& before,
               const RedistributeStep& step) const override {
    return all_to_all_reshard(local, before, step.mesh_dim, step.before, step.after);
  }
  Tensor backward(const Tensor& grad, const DTensorSpec& before,
                  const RedistributeStep& step) const override {
    return all_to_all_reshard(grad, before, step.mesh_dim, step.after, step.before);
  }
  int64_t bytes_moved(const DTensorSpec& before, const RedistributeStep& step) const override {
    int64_t n = before.mesh.size(step.mesh_dim);
    return local_bytes(before) * (n - 1) / n;
  }
};

}  // namespace

const Transition* shard_to_shard() {
  static ShardToShard t;
  return &t;
}

}  // namespace tessera::redistribute_detail
