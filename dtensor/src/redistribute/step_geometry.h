#pragma once
// Shared arithmetic of the transition families: how one mesh dim cuts one tensor dim at the
// level where a step acts, and the two data movements every family is built from.
#include <vector>

#include "tessera/dtensor/redistribute.h"

namespace tessera::redistribute_detail {

struct StepGeometry {
  int64_t dim = 0;                       // tensor dim cut by the mesh dim
  int64_t parent = 0;                    // extent of `dim` before this mesh dim cuts it
  int64_t parts = 1;                     // mesh dim size
  int64_t index = 0;                     // this rank's coordinate on the mesh dim
  std::vector<int64_t> starts, lengths;  // chunk of each group rank
  bool even() const;
};

// Geometry of `tensor_dim` as cut by step.mesh_dim, given that every other mesh dim stays as
// in `placements` (the mesh dim itself must be the innermost cut of tensor_dim there).
StepGeometry step_geometry(const DTensorSpec& spec, const Placements& placements, int64_t mesh_dim,
                           int64_t tensor_dim);

// All-gathers pieces cut as `g` describes over `group` and joins them on g.dim.
Tensor gather_pieces(const Tensor& local, const StepGeometry& g, const ProcessGroupPtr& group);
// This rank's chunk of `full` on g.dim, as a fresh tensor (a view would pin `full`).
Tensor own_chunk(const Tensor& full, const StepGeometry& g);

}  // namespace tessera::redistribute_detail
