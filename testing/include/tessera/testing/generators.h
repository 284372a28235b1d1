#pragma once
// What to sweep a sharded computation over: every mesh a world size allows, every placement list
// on a mesh, global shapes whose shards come out even, uneven and empty, and values that say
// where they came from.
#include <cstdint>
#include <optional>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/dtensor/device_mesh.h"
#include "tessera/dtensor/placement.h"

namespace tessera::testing {

// Every mesh shape of `world_size` ranks with 1 to `max_ndim` dims, each dim at least 2 (a single
// rank gets {1}), in a fixed order: 8 gives {8}, {2, 4}, {4, 2}, {2, 2, 2}.
std::vector<Shape> mesh_shapes(int64_t world_size, int64_t max_ndim = 3);

// DeviceMeshes of mesh_shapes(world_size(), max_ndim) over the world, dims named "d0", "d1",
// "d2". Collective: every rank calls it alike (meshes create groups); create them once per test
// binary when a sweep runs often.
std::vector<DeviceMesh> device_meshes(int64_t max_ndim = 3);

// Which placements placement_lists offers on each mesh dim.
struct PlacementChoices {
  bool replicate = true;
  bool shard = true;     // Shard(d) for every tensor dim d
  bool partial = true;   // Partial(sum)
  bool strided = false;  // StridedShard(d, f) wherever a later shard of d makes it valid
};

// Every placement list for a mesh of `mesh_shape` and a tensor of `tensor_ndim` dims: the product
// of the choices on each mesh dim, plus (with `strided`) each list in which a Shard(d) with later
// shards of d becomes StridedShard(d, product of their mesh sizes), FSDP's layout over TP.
std::vector<Placements> placement_lists(const Shape& mesh_shape, int64_t tensor_ndim,
                                        PlacementChoices choices = {});

// Global shapes of `ndim` dims for sharding over a mesh of `mesh_shape`: one whose every dim
// splits evenly however the mesh cuts it, then per dim one that splits unevenly, one shorter than
// the number of pieces (some ranks hold nothing) and one of length 0.
std::vector<Shape> edge_shapes(const Shape& mesh_shape, int64_t ndim);

// The element at flat (row-major) global index i holds i + 1, so that any element says where it
// came from and 0 is no element's value. Exact for up to 2^24 elements in float32, 2^53 in
// float64 and int64, 2^31 - 1 in int32; other dtypes and larger shapes are an error.
Tensor index_tensor(const Shape& shape, DType dtype = DType::Float64);

// The global index whose index_tensor value is `value`, or nothing when no element holds it.
std::optional<std::vector<int64_t>> index_of_value(double value, const Shape& shape);

// Random multiples of 1/4 in [-16, 16], a function of (shape, seed): sums of a few are exact in
// float32 and float64 whatever order a reduction adds them in, so comparisons can be exact.
Tensor dyadic_tensor(const Shape& shape, uint64_t seed, DType dtype = DType::Float64);

// Standard normal values drawn from Generator(seed), the same on every rank. The dtype has no
// default: which dtype a test computes in is part of what it tests.
Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype);
// The same draws times `scale`, multiplied in float64 and rounded to `dtype` once (large float32
// logits that are still exactly the float64 values rounded).
Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype, double scale);

}  // namespace tessera::testing
