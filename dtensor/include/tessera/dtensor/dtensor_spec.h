#pragma once
#include <string>

#include "tessera/core/dtype.h"
#include "tessera/dtensor/device_mesh.h"
#include "tessera/dtensor/layout.h"
#include "tessera/dtensor/placement.h"

namespace tessera {

// Everything that describes a DTensor but its data: mesh, one placement per mesh dim, the
// global shape and the dtype. Construction validates and normalizes the placements.
struct DTensorSpec {
  DeviceMesh mesh;
  Placements placements;
  Shape global_shape;
  DType dtype = DType::Float32;

  DTensorSpec(DeviceMesh mesh, Placements placements, Shape global_shape, DType dtype);

  LocalLayout local_layout() const;  // this rank's block
  LocalLayout local_layout_at(const std::vector<int64_t>& coordinate) const;
  int64_t ndim() const { return int64_t(global_shape.size()); }
  bool has_partial() const;
  bool is_replicated() const;  // every placement Replicate
  // The placements of this tensor's gradient: Partial becomes Replicate.
  Placements grad_placements() const;
  std::string str() const;  // "DTensorSpec([8, 4] float32 on DeviceMesh(dp=2) [S(0)])"
  bool operator==(const DTensorSpec& o) const;
};

}  // namespace tessera
