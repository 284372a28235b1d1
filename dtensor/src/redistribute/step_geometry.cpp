#include "step_geometry.h"

#include "tessera/core/factory.h"
#include "tessera/core/kernels/shape_ops.h"
#include "tessera/core/kernels/views.h"

namespace tessera::redistribute_detail {

bool StepGeometry::even() const {
  for (int64_t l : lengths)
    if (l != lengths[0]) return false;
  return true;
}

StepGeometry step_geometry(const DTensorSpec& spec, const Placements& placements, int64_t mesh_dim,
                           int64_t tensor_dim) {
  Placements outer = placements;
  outer[size_t(mesh_dim)] = Replicate();
  LocalLayout l =
      compute_local_layout(spec.global_shape, spec.mesh.shape(), spec.mesh.coordinate(), outer);
  StepGeometry g;
  g.dim = tensor_dim;
  g.parent = l.local_shape[size_t(tensor_dim)];
  g.parts = spec.mesh.size(mesh_dim);
  g.index = spec.mesh.coordinate()[size_t(mesh_dim)];
  for (int64_t r = 0; r < g.parts; ++r) {
    Chunk c = chunk_of(g.parent, g.parts, r);
    g.starts.push_back(c.start);
    g.lengths.push_back(c.length);
  }
  return g;
}

Tensor gather_pieces(const Tensor& local, const StepGeometry& g, const ProcessGroupPtr& group) {
  Tensor in = local.contiguous();
  Shape full_shape = in.shape();
  full_shape[size_t(g.dim)] = g.parent;
  TESSERA_CHECK(in.size(g.dim) == g.lengths[size_t(g.index)], "redistribute: local piece ",
                in.str(), " has ", in.size(g.dim), " rows on dim ", g.dim, " where ",
                g.lengths[size_t(g.index)], " were expected");
  Tensor out = empty(full_shape, TensorOptions(in.dtype(), in.device()));
  if (g.even() && g.dim == 0) {
    group->all_gather_into_tensor(out, in)->wait();
    return out;
  }
  // Each rank's piece goes straight to its place in the result: views along g.dim, strided
  // unless it is the outermost dim, which the group receives where they lie (no gather into a
  // buffer and concatenation after).
  std::vector<Tensor> pieces;
  for (int64_t r = 0; r < g.parts; ++r)
    pieces.push_back(kernels::narrow(out, g.dim, g.starts[size_t(r)], g.lengths[size_t(r)]));
  group->all_gather(pieces, in)->wait();
  return out;
}

Tensor own_chunk(const Tensor& full, const StepGeometry& g) {
  TESSERA_CHECK(full.size(g.dim) == g.parent, "redistribute: tensor ", full.str(), " has ",
                full.size(g.dim), " rows on dim ", g.dim, " where ", g.parent,
                " were expected before sharding");
  return kernels::narrow(full, g.dim, g.starts[size_t(g.index)], g.lengths[size_t(g.index)])
      .clone();
}

}  // namespace tessera::redistribute_detail
