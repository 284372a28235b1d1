#pragma once
// The user's own sharded layer: y = x W^T + b with the output features (rows of W) split over a
// 1-D mesh. Each rank computes its share of the output features; the output is Shard(1).
#include <tessera/tessera.h>

#include <vector>

struct ColumnParallelLinear {
  tessera::DTensor weight;  // [out, in], Shard(0)
  tessera::DTensor bias;    // [out], Shard(0)

  // `interleaved` is the bug: rank r takes rows r, r + n, r + 2n, ... (what a reshape to
  // [out / n, n, in] sliced on the wrong axis gives) while declaring Shard(0), which means the
  // contiguous rows [r * out / n, (r + 1) * out / n).
  ColumnParallelLinear(const tessera::Tensor& full_weight, const tessera::Tensor& full_bias,
                       const tessera::DeviceMesh& mesh, bool interleaved) {
    weight = shard_rows(full_weight, mesh, interleaved);
    bias = shard_rows(full_bias, mesh, interleaved);
    weight.set_requires_grad(true);
    bias.set_requires_grad(true);
  }

  // x: [batch, in], the same on every rank.
  tessera::DTensor forward(const tessera::Tensor& x) const {
    using namespace tessera;
    Tensor y = add(matmul(x, transpose(weight.to_local(), 0, 1)), bias.to_local());
    return DTensor::from_local(y, weight.mesh(), {Shard(1)}, Shape{x.size(0), weight.shape()[0]});
  }

 private:
  static tessera::DTensor shard_rows(const tessera::Tensor& full, const tessera::DeviceMesh& mesh,
                                     bool interleaved) {
    using namespace tessera;
    const int64_t n = mesh.size(), r = mesh.local_rank(0), rows = full.size(0) / n;
    std::vector<Tensor> mine;
    for (int64_t i = 0; i < rows; ++i)
      mine.push_back(kernels::narrow(full, 0, interleaved ? r + i * n : r * rows + i, 1));
    return DTensor::from_local(kernels::cat(mine, 0), mesh, {Shard(0)}, full.shape());
  }
};
