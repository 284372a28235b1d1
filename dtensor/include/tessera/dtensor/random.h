#pragma once
// Shard-invariant random DTensors: each rank draws only its window of the logical draw, so
// full_tensor() is bit-identical to a single process drawing the whole tensor with the same
// generator state, for any mesh and placements. Every rank advances `gen` by the global numel.
// The ranks of the mesh must hold the same generator state (seed and offset): each call checks
// that with one small all-reduce per mesh dim and fails on every rank when they differ.
#include "tessera/core/random.h"
#include "tessera/dtensor/dtensor.h"

namespace tessera {

DTensor rand(const Shape& global_shape, const DeviceMesh& mesh, const Placements& placements,
             Generator& gen, DType dtype = DType::Float32);
DTensor randn(const Shape& global_shape, const DeviceMesh& mesh, const Placements& placements,
              Generator& gen, DType dtype = DType::Float32);
DTensor& uniform_(DTensor& t, double low, double high, Generator& gen);
DTensor& normal_(DTensor& t, double mean, double std, Generator& gen);
// Fans come from the global shape.
DTensor& kaiming_uniform_(DTensor& t, Generator& gen, double a = 2.23606797749979,
                          FanMode mode = FanMode::FanIn);
DTensor& xavier_uniform_(DTensor& t, Generator& gen, double gain = 1.0);

}  // namespace tessera
