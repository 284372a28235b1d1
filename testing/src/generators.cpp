#include "tessera/testing/generators.h"

#include <cmath>
#include <random>
#include <string>

#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"
#include "tessera/core/random.h"
#include "tessera/testing/geometry.h"

namespace tessera::testing {

namespace {

// Ordered factorizations of n into exactly `parts` factors of at least 2.
void factorizations(int64_t n, int64_t parts, Shape& prefix, std::vector<Shape>& out) {
  if (parts == 1) {
    if (n >= 2) {
      prefix.push_back(n);
      out.push_back(prefix);
      prefix.pop_back();
    }
    return;
  }
  for (int64_t f = 2; f * 2 <= n; ++f) {
    if (n % f != 0) continue;
    prefix.push_back(f);
    factorizations(n / f, parts - 1, prefix, out);
    prefix.pop_back();
  }
}

}  // namespace

std::vector<Shape> mesh_shapes(int64_t world_size, int64_t max_ndim) {
  TESSERA_CHECK(world_size >= 1 && max_ndim >= 1, "mesh_shapes: world size ", world_size,
                ", at most ", max_ndim, " dims");
  if (world_size == 1) return {Shape{1}};
  std::vector<Shape> out;
  for (int64_t nd = 1; nd <= max_ndim; ++nd) {
    Shape prefix;
    factorizations(world_size, nd, prefix, out);
  }
  return out;
}

std::vector<DeviceMesh> device_meshes(int64_t max_ndim) {
  std::vector<DeviceMesh> out;
  for (const Shape& shape : mesh_shapes(world_size(), max_ndim)) {
    std::vector<std::string> names;
    for (size_t m = 0; m < shape.size(); ++m) {
      std::string name = "d";
      names.push_back(name.append(std::to_string(m)));
    }
    out.emplace_back(shape, names);
  }
  return out;
}

std::vector<Placements> placement_lists(const Shape& mesh_shape, int64_t tensor_ndim,
                                        PlacementChoices choices) {
  std::vector<Placement> per_dim;
  if (choices.replicate) per_dim.push_back(Replicate());
  if (choices.shard)
    for (int64_t d = 0; d < tensor_ndim; ++d)
      per_dim.push_back(Shard(d));
  if (choices.partial) per_dim.push_back(Partial());
  TESSERA_CHECK(!per_dim.empty(), "placement_lists: no placement chosen");
  std::vector<Placements> out = {{}};
  for (size_t m = 0; m < mesh_shape.size(); ++m) {
    std::vector<Placements> next;
    for (const Placements& prefix : out)
      for (const Placement& p : per_dim) {
        next.push_back(prefix);
        next.back().push_back(p);
      }
    out = std::move(next);
  }
  if (!choices.strided) return out;
  const size_t plain = out.size();
  for (size_t i = 0; i < plain; ++i)
    for (size_t m = 0; m < mesh_shape.size(); ++m) {
      const Placement& p = out[i][m];
      if (p.kind() != Placement::Kind::Shard) continue;
      int64_t later = 1;
      for (size_t k = m + 1; k < mesh_shape.size(); ++k)
        if (out[i][k].kind() == Placement::Kind::Shard && out[i][k].dim() == p.dim())
          later *= mesh_shape[k];
      if (later == 1) continue;
      Placements strided = out[i];
      strided[m] = StridedShard(p.dim(), later);
      out.push_back(std::move(strided));
    }
  return out;
}

std::vector<Shape> edge_shapes(const Shape& mesh_shape, int64_t ndim) {
  TESSERA_CHECK(ndim >= 1, "edge_shapes: tensors of ", ndim, " dims");
  // Every dim may be cut by every mesh dim at once: 2 * (their product) splits evenly at every
  // level of nesting.
  int64_t pieces = 1;
  for (int64_t s : mesh_shape)
    pieces *= s;
  const Shape even(size_t(ndim), 2 * pieces);
  std::vector<Shape> out = {even};
  for (int64_t d = 0; d < ndim; ++d)
    for (int64_t len : {2 * pieces + 1, std::max<int64_t>(pieces - 1, 1), int64_t(0)}) {
      Shape s = even;
      s[size_t(d)] = len;
      out.push_back(s);
    }
  return out;
}

Tensor index_tensor(const Shape& shape, DType dtype) {
  const int64_t n = shape_numel(shape);
  int64_t limit = 0;
  switch (dtype) {
    case DType::Float32:
      limit = int64_t(1) << 24;
      break;
    case DType::Float64:
      limit = int64_t(1) << 53;
      break;
    case DType::Int32:
      limit = int64_t(INT32_MAX);
      break;
    case DType::Int64:
      limit = int64_t(1) << 53;
      break;
    default:
      break;
  }
  TESSERA_CHECK(n < limit, "index_tensor: ", n, " elements of shape ", shape_str(shape),
                " cannot each hold their own index + 1 exactly in ", dtype_name(dtype));
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[size_t(i)] = double(i + 1);
  return from_vector<double>(v, shape).to(dtype);
}

std::optional<std::vector<int64_t>> index_of_value(double value, const Shape& shape) {
  const int64_t n = shape_numel(shape);
  if (!(value >= 1 && value <= double(n)) || value != std::floor(value)) return std::nullopt;
  return unravel_index(int64_t(value) - 1, shape);
}

Tensor dyadic_tensor(const Shape& shape, uint64_t seed, DType dtype) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dist(-64, 64);
  std::vector<double> v(size_t(shape_numel(shape)));
  for (double& x : v)
    x = dist(rng) / 4.0;
  return from_vector<double>(v, shape).to(dtype);
}

Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype) {
  Generator gen(seed);
  return randn(shape, gen, dtype);
}

Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype, double scale) {
  std::vector<double> v = random_tensor(shape, seed, DType::Float64).to_vector<double>();
  for (double& x : v)
    x *= scale;
  return from_vector<double>(v, shape).to(dtype);
}

}  // namespace tessera::testing
