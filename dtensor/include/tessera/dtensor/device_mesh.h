#pragma once
// A logical n-d array of ranks (row-major over the world, or over a parent's ranks) with one
// process group per mesh dim. Creating a mesh is collective over the parent group. A mesh has a
// device type: its groups are those of the backend for that device (comm/backend.h).
#include <memory>
#include <string>
#include <vector>

#include "tessera/comm/process_group.h"
#include "tessera/core/device.h"
#include "tessera/core/shape.h"

namespace tessera {

class DeviceMesh {
 public:
  // Over all world ranks: the product of `shape` must equal world_size(). Dim names default to
  // "dim0", "dim1", ...
  explicit DeviceMesh(Shape shape, std::vector<std::string> dim_names = {});
  // The same over the world group of `device_type`'s backend (an error naming the device type
  // when none is registered).
  DeviceMesh(DeviceType device_type, Shape shape, std::vector<std::string> dim_names = {});
  // A 1-D mesh over an existing group (PyTorch's DeviceMesh.from_group); not collective, so a
  // device type other than the CPU gets no host_group().
  static DeviceMesh from_group(ProcessGroupPtr group, const std::string& dim_name = "dim0",
                               DeviceType device_type = DeviceType::CPU);
  // An n-D mesh over existing groups that together span every world rank: groups[d] is this
  // rank's group along mesh dim d, and this rank's coordinate along d is its rank there.
  // Collective over the CPU world group, which carries the layout check (the groups themselves
  // carry nothing) and, for another device type, makes the host groups: an error on every rank
  // when the groups do not form such a mesh.
  static DeviceMesh from_groups(std::vector<ProcessGroupPtr> groups,
                                std::vector<std::string> dim_names = {},
                                DeviceType device_type = DeviceType::CPU);
  DeviceMesh(const DeviceMesh&) = default;
  DeviceMesh& operator=(const DeviceMesh&) = default;

  DeviceType device_type() const;
  // Where this rank's pieces of DTensors on this mesh live: current_device(device_type()).
  Device device() const;
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
  // The CPU group along `mesh_dim`, for host data that decides what every rank does next (sizes,
  // flags, agreement texts): group(mesh_dim) itself on a CPU mesh; on a mesh of another device
  // type, whose backend may move device tensors only (NCCL), a CPU group over the same ranks
  // made with it. A mesh that from_group made over a device group has none (an error).
  const ProcessGroupPtr& host_group(int64_t mesh_dim) const;

  // Sub-mesh of the named dims through this rank (shares this mesh's groups).
  DeviceMesh operator[](const std::string& name) const;
  DeviceMesh operator[](const std::vector<std::string>& names) const;
  // One dim spanning all of this mesh's ranks. Collective over every rank of the parent world
  // (each rank flattens its own sub-mesh).
  DeviceMesh flatten(const std::string& name = "") const;

  bool operator==(const DeviceMesh& o) const;
  bool operator!=(const DeviceMesh& o) const { return !(*this == o); }
  std::string str() const;  // "DeviceMesh(dp=2, tp=2)", "DeviceMesh('cuda', dp=2, tp=2)"

  struct Impl;

 private:
  explicit DeviceMesh(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace tessera
