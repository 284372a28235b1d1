#pragma once
// Shared by the tests of layers, optimizers and clip_grad_norm_ on DTensor parameters: the world
// as a 1-D mesh, parameters made float64 or distributed by hand (as a parallel style would), and
// gradients and pieces as global or local tensors. Seeded global tensors are the testing kit's
// random_tensor.
#include "tessera/tessera.h"

namespace tessera::nn_dtensor_test {

inline DeviceMesh world_mesh() {
  return DeviceMesh(Shape{world_size()}, {"tp"});
}

// Makes every parameter float64 with the same values on every rank.
inline void to_float64(Module& m) {
  for (auto& [name, p] : m.named_parameters())
    *p = Parameter(p->full().to(DType::Float64));
}

inline void distribute(Parameter& p, const DeviceMesh& mesh, const Placements& placements) {
  p = Parameter(distribute_tensor(p.full(), mesh, placements));
}

// The gradient of a parameter as a global tensor (gathered when it is a DTensor).
inline Tensor full_grad(const Parameter& p) {
  if (!p.is_dtensor()) return p.grad();
  return p.grad_dtensor().full_tensor();
}

// This rank's piece of `global` under `placements` (a fresh leaf).
inline Tensor local_leaf(const Tensor& global, const DeviceMesh& mesh,
                         const Placements& placements) {
  return distribute_tensor(global, mesh, placements).to_local().clone().set_requires_grad(true);
}

inline Tensor gather(const Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                     const Shape& global_shape) {
  return DTensor::from_local(local, mesh, placements, global_shape).full_tensor();
}

}  // namespace tessera::nn_dtensor_test
