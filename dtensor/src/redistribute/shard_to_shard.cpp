// S(a) -> S(b) on one mesh dim: one all-to-all instead of a gather and a re-cut. Each rank
// sends every peer the part of its a-chunk that falls in the peer's b-chunk; backward is the
// all-to-all the other way.
#include <algorithm>

#include "step_geometry.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "transitions.h"

namespace tessera::redistribute_detail {

namespace {

// Pieces above this size travel as several all-to-alls of row ranges, all in flight at once:
// MPI pipelines one strided message only a few fragments deep, so a single large message per
// peer waits on every fragment's trip between the cores. On 2 ranks (bench/redistribute) this
// took 16 and 64 MiB from 1.9-2.1x and 1.8-2.0x the raw all-to-all to 1.6x and 1.4x while the
// cores were slow to exchange cache lines, and changed nothing measurable otherwise; 256 KiB
// pieces cost more in per-call overhead than they saved.
constexpr int64_t kChunkBytes = int64_t(1) << 20;

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
  // The piece from s to r has the same shape on both ranks (dim a: s's a-chunk, dim b: r's
  // b-chunk), so both cut it into the same row ranges on dim a; the count comes from the
  // largest piece, which every rank of the group computes alike.
  const int64_t longest_a = *std::max_element(ga.lengths.begin(), ga.lengths.end());
  const int64_t longest_b = *std::max_element(gb.lengths.begin(), gb.lengths.end());
  int64_t largest = longest_a * longest_b * int64_t(local.element_size());
  for (int64_t d = 0; d < local.dim(); ++d)
    if (d != a && d != b) largest *= local.size(d);
  const int64_t chunks = std::clamp<int64_t>((largest + kChunkBytes - 1) / kChunkBytes, 1,
                                             std::max<int64_t>(longest_a, 1));
  std::vector<WorkPtr> works;
  for (int64_t c = 0; c < chunks; ++c) {
    std::vector<Tensor> inputs, outputs;
    for (int64_t r = 0; r < ga.parts; ++r) {
      const int64_t mine = ga.lengths[size_t(ga.index)], theirs = ga.lengths[size_t(r)];
      const int64_t in0 = c * mine / chunks, in1 = (c + 1) * mine / chunks;
      const int64_t out0 = c * theirs / chunks, out1 = (c + 1) * theirs / chunks;
      Tensor piece = kernels::narrow(local, b, gb.starts[size_t(r)], gb.lengths[size_t(r)]);
      inputs.push_back(kernels::narrow(piece, a, in0, in1 - in0));
      outputs.push_back(kernels::narrow(out, a, ga.starts[size_t(r)] + out0, out1 - out0));
    }
    works.push_back(spec.mesh.group(mesh_dim)->all_to_all(outputs, inputs));
  }
  for (const WorkPtr& w : works)
    w->wait();
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
