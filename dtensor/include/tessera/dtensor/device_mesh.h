#pragma once
// A logical n-d array of ranks (row-major over the world, or over a parent's ranks) with one
// process group per mesh dim. Creating a mesh is collective over the parent group.
#include <memory>
#include <string>
#include <vector>

#include "tessera/comm/process_group.h"
#include "tessera/core/shape.h"

namespace tessera {

class DeviceMesh {
 public:
  // Over all world ranks: the product of `shape` must equal world_size(). Dim names default to
  // "dim0", "dim1", ...
  explicit DeviceMesh(Shape shape, std::vector<std::string> dim_names = {});
  DeviceMesh(const DeviceMesh&) = default;
  DeviceMesh& operator=(const DeviceMesh&) = default;

  int64_t ndim() const;
  const Shape& shape() const;
  int64_t size(int64_t mesh_dim) const;
  int64_t size() const;  // number of ranks
  const std::vector<std::string>& dim_names() const;
  // Index of a named dim; an error lists the names that exist.
  int64_t dim_index(const std::string& name) const;

  // World ranks in row-major mesh order.
  const std::vector<int>& world_ranks() const;
  // This rank's coordinate; an error if this rank is not in the mesh.
  const std::vector<int64_t>& coordinate() const;
  std::vector<int64_t> coordinate_of(int world_rank) const;
  int world_rank_at(const std::vector<int64_t>& coordinate) const;
  int64_t local_rank(int64_t mesh_dim) const { return coordinate()[size_t(mesh_dim)]; }

  // The group of ranks that differ from this one only along `mesh_dim`.
  const ProcessGroupPtr& group(int64_t mesh_dim) const;
  const ProcessGroupPtr& group(const std::string& name) const { return group(dim_index(name)); }

  // Sub-mesh of the named dims through this rank (shares this mesh's groups).
  DeviceMesh operator[](const std::string& name) const;
  DeviceMesh operator[](const std::vector<std::string>& names) const;
  // One dim spanning all of this mesh's ranks. Collective over every rank of the parent world
  // (each rank flattens its own sub-mesh).
  DeviceMesh flatten(const std::string& name = "") const;

  bool operator==(const DeviceMesh& o) const;
  bool operator!=(const DeviceMesh& o) const { return !(*this == o); }
  std::string str() const;  // "DeviceMesh(dp=2, tp=2)"

  struct Impl;

 private:
  explicit DeviceMesh(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace tessera
