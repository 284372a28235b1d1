#pragma once
// Shard-invariant random DTensors: each rank draws only its window of the logical draw, so
// full_tensor() is bit-identical to a single process drawing the whole tensor with the same
// generator state, for any mesh and placements. Every rank advances `gen` by the global numel.
// The ranks of the mesh must hold the same generator state (seed and offset): each call checks
// that with one small all-reduce per mesh dim and fails on every rank when they differ.
#include "tessera/core/random.h"
#include "tessera/dtensor/dtensor.h"

namespace tessera {

// check_generator = false skips that check, for a generator whose state is the same on every
// rank of the mesh by construction: seeded alike and drawn from only by calls every rank makes
// alike (LoRA's per-slot dropout streams), where the check would cost an all-reduce per draw.
DTensor rand(const Shape& global_shape, const DeviceMesh& mesh, const Placements& placements,
             Generator& gen, DType dtype = DType::Float32, bool check_generator = true);
DTensor randn(const Shape& global_shape, const DeviceMesh& mesh, const Placements& placements,
              Generator& gen, DType dtype = DType::Float32);
DTensor& uniform_(DTensor& t, double low, double high, Generator& gen);
DTensor& normal_(DTensor& t, double mean, double std, Generator& gen);
// Fans come from the global shape.
DTensor& kaiming_uniform_(DTensor& t, Generator& gen, double a = 0.0,
                          FanMode mode = FanMode::FanIn);
DTensor& xavier_uniform_(DTensor& t, Generator& gen, double gain = 1.0);

// Inverted dropout with the mask one process would draw for the whole tensor (each rank draws its
// window, as rand does), so a sequence-parallel dropout is the unsharded one, whatever the
// layout. Identity when !training or p == 0; x * 0 when p == 1, as tessera::dropout. Ranks of a
// Partial dim share one mask, which keeps the sum; the generator advances by the global numel.
DTensor dropout(const DTensor& x, double p, bool training, Generator& gen);

}  // namespace tessera
