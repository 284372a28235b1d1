#include "tessera/dtensor/random.h"

#include "tessera/core/factory.h"

namespace tessera {

namespace {

// Every rank reserves the whole logical draw, then fills only its window of it.
DTensor& fill_window(DTensor& t, RandomKind kind, double a, double b, Generator& gen) {
  const DTensorSpec& s = t.spec();
  uint64_t base = gen.advance(uint64_t(shape_numel(s.global_shape)));
  Tensor local = t.to_local();
  LocalLayout l = s.local_layout();
  philox_fill(local, kind, a, b, gen.seed(), base, {s.global_shape, l.global_offset});
  for (int64_t m = 0; m < s.mesh.ndim(); ++m) {
    const Placement& p = s.placements[size_t(m)];
    if (p.is_partial() && p.reduce_op() == ReduceOp::Sum && s.mesh.coordinate()[size_t(m)] != 0) {
      local.zero_();
      break;
    }
  }
  return t;
}

DTensor empty_dtensor(const Shape& global_shape, const DeviceMesh& mesh,
                      const Placements& placements, DType dtype) {
  auto spec = std::make_shared<const DTensorSpec>(mesh, placements, global_shape, dtype);
  Tensor local = empty(spec->local_layout().local_shape, TensorOptions(dtype, mesh.device()));
  return DTensor(std::move(spec), local);
}

}  // namespace

DTensor rand(const Shape& global_shape, const DeviceMesh& mesh, const Placements& placements,
             Generator& gen, DType dtype) {
  DTensor t = empty_dtensor(global_shape, mesh, placements, dtype);
  return uniform_(t, 0.0, 1.0, gen);
}

DTensor randn(const Shape& global_shape, const DeviceMesh& mesh, const Placements& placements,
              Generator& gen, DType dtype) {
  DTensor t = empty_dtensor(global_shape, mesh, placements, dtype);
  return normal_(t, 0.0, 1.0, gen);
}

DTensor& uniform_(DTensor& t, double low, double high, Generator& gen) {
  return fill_window(t, RandomKind::Uniform, low, high, gen);
}

DTensor& normal_(DTensor& t, double mean, double std, Generator& gen) {
  return fill_window(t, RandomKind::Normal, mean, std, gen);
}

DTensor& kaiming_uniform_(DTensor& t, Generator& gen, double a, FanMode mode) {
  double bound = kaiming_uniform_bound(t.shape(), a, mode);
  return uniform_(t, -bound, bound, gen);
}

DTensor& xavier_uniform_(DTensor& t, Generator& gen, double gain) {
  double bound = xavier_uniform_bound(t.shape(), gain);
  return uniform_(t, -bound, bound, gen);
}

}  // namespace tessera
