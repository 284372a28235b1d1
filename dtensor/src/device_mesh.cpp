#include "tessera/dtensor/device_mesh.h"

#include <algorithm>
#include <utility>

#include "tessera/comm/backend.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"

namespace tessera {

struct DeviceMesh::Impl {
  DeviceType device_type = DeviceType::CPU;
  Shape shape;
  std::vector<std::string> names;
  std::vector<int> ranks;           // world ranks, row-major
  std::vector<int64_t> coordinate;  // empty when this rank is not a member
  std::vector<ProcessGroupPtr> groups;
  // CPU groups over the same lines of ranks, for host data: `groups` itself on a CPU mesh; empty
  // on a mesh of another device type made by from_group (not collective, so none can be made).
  std::vector<ProcessGroupPtr> host_groups;
};

namespace {

std::vector<int64_t> unravel(int64_t index, const Shape& shape) {
  std::vector<int64_t> c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    c[d] = index % shape[d];
    index /= shape[d];
  }
  return c;
}

int64_t ravel(const std::vector<int64_t>& c, const Shape& shape) {
  int64_t index = 0;
  for (size_t d = 0; d < shape.size(); ++d)
    index = index * shape[d] + c[d];
  return index;
}

// The line of ranks along each mesh dim through `coordinate`, as MPI_Comm_split's color and key:
// ranks that agree on every other coordinate share a color, ordered by their coordinate there.
std::pair<std::vector<int>, std::vector<int>> lines_through(const std::vector<int64_t>& coordinate,
                                                            const Shape& shape) {
  std::vector<int> colors, keys;
  for (size_t m = 0; m < shape.size(); ++m) {
    std::vector<int64_t> others = coordinate;
    others[m] = 0;
    colors.push_back(int(ravel(others, shape)));
    keys.push_back(int(coordinate[m]));
  }
  return {colors, keys};
}

// The host twins of a device mesh's groups: the CPU world split as `groups` were, so that
// `colors[m]` and `keys[m]` give the same lines of ranks. Collective over the world.
std::vector<ProcessGroupPtr> host_lines(DeviceType type, const std::vector<ProcessGroupPtr>& groups,
                                        const std::vector<int>& colors,
                                        const std::vector<int>& keys,
                                        const std::vector<std::string>& names) {
  if (type == DeviceType::CPU) return groups;
  std::vector<ProcessGroupPtr> host;
  for (size_t m = 0; m < colors.size(); ++m)
    host.push_back(world_group()->split(colors[m], keys[m], "mesh." + names[m] + ".host"));
  return host;
}

// Checks a mesh shape and its dim names, filling in "dim0", "dim1", ... when none are given.
std::vector<std::string> checked_names(const Shape& shape, std::vector<std::string> dim_names) {
  TESSERA_CHECK(!shape.empty(), "DeviceMesh: the shape must have at least one dim");
  for (int64_t s : shape)
    TESSERA_CHECK(s >= 1, "DeviceMesh: invalid mesh shape ", shape_str(shape));
  if (dim_names.empty())
    for (size_t d = 0; d < shape.size(); ++d)
      dim_names.push_back("dim" + std::to_string(d));
  TESSERA_CHECK(dim_names.size() == shape.size(), "DeviceMesh: ", dim_names.size(),
                " dim names for a mesh of shape ", shape_str(shape));
  for (size_t i = 0; i < dim_names.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      TESSERA_CHECK(dim_names[i] != dim_names[j], "DeviceMesh: dim name '", dim_names[i],
                    "' used twice");
  return dim_names;
}

}  // namespace

DeviceMesh::DeviceMesh(Shape shape, std::vector<std::string> dim_names)
    : DeviceMesh(DeviceType::CPU, std::move(shape), std::move(dim_names)) {}

DeviceMesh::DeviceMesh(DeviceType device_type, Shape shape, std::vector<std::string> dim_names) {
  dim_names = checked_names(shape, std::move(dim_names));
  ProcessGroupPtr world = world_group(device_type);
  TESSERA_CHECK(shape_numel(shape) == world->size(), "DeviceMesh: mesh shape ", shape_str(shape),
                " has ", shape_numel(shape), " ranks but the world has ", world->size(),
                " (start the job with mpirun -np ", shape_numel(shape), ")");
  auto impl = std::make_shared<Impl>();
  impl->device_type = device_type;
  impl->shape = shape;
  impl->names = std::move(dim_names);
  for (int r = 0; r < world->size(); ++r)
    impl->ranks.push_back(world->world_ranks()[size_t(r)]);
  impl->coordinate = unravel(world->rank(), shape);
  // One group per mesh dim. Every rank makes the same sequence of splits, so this is collective
  // over the world.
  const auto [colors, keys] = lines_through(impl->coordinate, shape);
  for (size_t m = 0; m < shape.size(); ++m)
    impl->groups.push_back(world->split(colors[m], keys[m], "mesh." + impl->names[m]));
  impl->host_groups = host_lines(device_type, impl->groups, colors, keys, impl->names);
  impl_ = std::move(impl);
}

DeviceMesh DeviceMesh::from_group(ProcessGroupPtr group, const std::string& dim_name,
                                  DeviceType device_type) {
  TESSERA_CHECK(group != nullptr, "DeviceMesh::from_group: the group is null");
  auto impl = std::make_shared<Impl>();
  impl->device_type = device_type;
  impl->shape = {group->size()};
  impl->names = checked_names(impl->shape, {dim_name});
  impl->ranks = group->world_ranks();
  impl->coordinate = {group->rank()};
  impl->groups = {std::move(group)};
  if (device_type == DeviceType::CPU) impl->host_groups = impl->groups;
  return DeviceMesh(std::shared_ptr<const Impl>(std::move(impl)));
}

DeviceMesh DeviceMesh::from_groups(std::vector<ProcessGroupPtr> groups,
                                   std::vector<std::string> dim_names, DeviceType device_type) {
  TESSERA_CHECK(!groups.empty(), "DeviceMesh::from_groups: no groups");
  auto impl = std::make_shared<Impl>();
  impl->device_type = device_type;
  for (size_t d = 0; d < groups.size(); ++d) {
    TESSERA_CHECK(groups[d] != nullptr, "DeviceMesh::from_groups: group ", d, " is null");
    impl->shape.push_back(groups[d]->size());
    impl->coordinate.push_back(groups[d]->rank());
  }
  impl->names = checked_names(impl->shape, std::move(dim_names));
  // The layout comes from every rank's coordinate and shape, exchanged over the CPU world (the
  // given groups, of any backend, carry nothing): a wrong group then cannot mismatch messages.
  const int64_t nd = int64_t(groups.size());
  ProcessGroupPtr world = world_group();
  std::vector<int64_t> mine(impl->coordinate);
  mine.insert(mine.end(), impl->shape.begin(), impl->shape.end());
  Tensor all = empty({world->size() * 2 * nd}, DType::Int64);
  world->all_gather_into_tensor(all, from_vector<int64_t>(mine, {2 * nd}))->wait();
  const std::vector<int64_t> table = all.to_vector<int64_t>();
  // Every rank computes the same layout from the same table; only the check of its own groups
  // against it is local, so the verdicts are combined before anyone throws.
  std::string problem;
  const int64_t n = shape_numel(impl->shape);
  if (n != world->size())
    problem = "the mesh " + shape_str(impl->shape) + " has " + std::to_string(n) +
              " ranks but the world has " + std::to_string(world->size());
  std::vector<int> at(size_t(n), -1);  // world rank at each row-major position
  for (int w = 0; w < world->size() && problem.empty(); ++w) {
    const int64_t* rec = table.data() + size_t(w) * size_t(2 * nd);
    const std::vector<int64_t> coord(rec, rec + nd);
    if (Shape(rec + nd, rec + 2 * nd) != impl->shape) {
      problem = "world rank " + std::to_string(w) + " passed groups of sizes " +
                shape_str(Shape(rec + nd, rec + 2 * nd));
      break;
    }
    int& slot = at[size_t(ravel(coord, impl->shape))];
    if (slot >= 0) {
      problem = "world ranks " + std::to_string(slot) + " and " + std::to_string(w) +
                " both sit at coordinate " + shape_str(coord);
      break;
    }
    slot = world->world_ranks()[size_t(w)];
  }
  for (int64_t d = 0; d < nd && problem.empty(); ++d) {
    std::vector<int> line;  // the ranks along dim d through this rank, in coordinate order
    std::vector<int64_t> c = impl->coordinate;
    for (c[size_t(d)] = 0; c[size_t(d)] < impl->shape[size_t(d)]; ++c[size_t(d)])
      line.push_back(at[size_t(ravel(c, impl->shape))]);
    if (line != groups[size_t(d)]->world_ranks())
      problem = "groups[" + std::to_string(d) + "] ('" + groups[size_t(d)]->name() +
                "') is not world rank " + std::to_string(world_rank()) +
                "'s line of ranks along mesh dim " + std::to_string(d);
  }
  Tensor failed = full({1}, problem.empty() ? 0.0 : 1.0, DType::Int64);
  world->all_reduce(failed, ReduceOp::Max)->wait();
  TESSERA_CHECK(failed.item<int64_t>() == 0, "DeviceMesh::from_groups: the groups do not form a ",
                "mesh: ", problem.empty() ? "another rank's groups do not fit" : problem,
                " (groups[d] must be this rank's group along mesh dim d, its rank there the "
                "coordinate along d)");
  const auto [colors, keys] = lines_through(impl->coordinate, impl->shape);
  impl->host_groups = host_lines(device_type, groups, colors, keys, impl->names);
  impl->ranks = std::move(at);
  impl->groups = std::move(groups);
  return DeviceMesh(std::shared_ptr<const Impl>(std::move(impl)));
}

DeviceType DeviceMesh::device_type() const {
  return impl_->device_type;
}

Device DeviceMesh::device() const {
  return current_device(device_type());
}

int64_t DeviceMesh::ndim() const {
  return int64_t(impl_->shape.size());
}
const Shape& DeviceMesh::shape() const {
  return impl_->shape;
}
int64_t DeviceMesh::size(int64_t mesh_dim) const {
  return impl_->shape[size_t(wrap_dim(mesh_dim, ndim(), "DeviceMesh::size"))];
}
int64_t DeviceMesh::size() const {
  return shape_numel(impl_->shape);
}
const std::vector<std::string>& DeviceMesh::dim_names() const {
  return impl_->names;
}

int64_t DeviceMesh::dim_index(const std::string& name) const {
  for (size_t i = 0; i < impl_->names.size(); ++i)
    if (impl_->names[i] == name) return int64_t(i);
  std::string known;
  for (const auto& n : impl_->names)
    known += (known.empty() ? "" : ", ") + n;
  TESSERA_FAIL("DeviceMesh: no mesh dim named '", name, "' (dims: ", known, ")");
}

const std::vector<int>& DeviceMesh::world_ranks() const {
  return impl_->ranks;
}

const std::vector<int64_t>& DeviceMesh::coordinate() const {
  TESSERA_CHECK(!impl_->coordinate.empty(), "DeviceMesh: this rank is not part of ", str());
  return impl_->coordinate;
}

std::vector<int64_t> DeviceMesh::coordinate_of(int world_rank) const {
  auto it = std::find(impl_->ranks.begin(), impl_->ranks.end(), world_rank);
  TESSERA_CHECK(it != impl_->ranks.end(), "DeviceMesh: world rank ", world_rank, " is not part of ",
                str());
  return unravel(it - impl_->ranks.begin(), impl_->shape);
}

int DeviceMesh::world_rank_at(const std::vector<int64_t>& coordinate) const {
  TESSERA_CHECK(coordinate.size() == impl_->shape.size(), "DeviceMesh: coordinate of ",
                coordinate.size(), " dims for ", str());
  for (size_t d = 0; d < coordinate.size(); ++d)
    TESSERA_CHECK(coordinate[d] >= 0 && coordinate[d] < impl_->shape[d],
                  "DeviceMesh: coordinate out of range for ", str());
  return impl_->ranks[size_t(ravel(coordinate, impl_->shape))];
}

const ProcessGroupPtr& DeviceMesh::group(int64_t mesh_dim) const {
  return impl_->groups[size_t(wrap_dim(mesh_dim, ndim(), "DeviceMesh::group"))];
}

const ProcessGroupPtr& DeviceMesh::host_group(int64_t mesh_dim) const {
  const int64_t m = wrap_dim(mesh_dim, ndim(), "DeviceMesh::host_group");
  TESSERA_CHECK(!impl_->host_groups.empty(), "DeviceMesh::host_group: ", str(),
                " was made by from_group over a group of its device, which cannot make a CPU "
                "group without every rank; make it with from_groups or DeviceMesh(type, shape)");
  return impl_->host_groups[size_t(m)];
}

DeviceMesh DeviceMesh::operator[](const std::string& name) const {
  return (*this)[std::vector<std::string>{name}];
}

DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& names) const {
  TESSERA_CHECK(!names.empty(), "DeviceMesh: sub-mesh of no dims");
  std::vector<int64_t> dims;
  for (const auto& n : names) {
    int64_t d = dim_index(n);
    TESSERA_CHECK(dims.empty() || d > dims.back(), "DeviceMesh: sub-mesh dims must be distinct ",
                  "and in mesh order");
    dims.push_back(d);
  }
  auto impl = std::make_shared<Impl>();
  impl->device_type = impl_->device_type;
  const std::vector<int64_t>& me = coordinate();
  for (int64_t d : dims) {
    impl->shape.push_back(impl_->shape[size_t(d)]);
    impl->names.push_back(impl_->names[size_t(d)]);
    impl->coordinate.push_back(me[size_t(d)]);
    impl->groups.push_back(impl_->groups[size_t(d)]);
    if (!impl_->host_groups.empty()) impl->host_groups.push_back(impl_->host_groups[size_t(d)]);
  }
  // Ranks of the sub-mesh: this rank's coordinate with the chosen dims varying.
  for (int64_t i = 0; i < shape_numel(impl->shape); ++i) {
    std::vector<int64_t> sub = unravel(i, impl->shape), full = me;
    for (size_t k = 0; k < dims.size(); ++k)
      full[size_t(dims[k])] = sub[k];
    impl->ranks.push_back(impl_->ranks[size_t(ravel(full, impl_->shape))]);
  }
  return DeviceMesh(std::shared_ptr<const Impl>(std::move(impl)));
}

DeviceMesh DeviceMesh::flatten(const std::string& name) const {
  std::string flat = name;
  if (flat.empty())
    for (const auto& n : impl_->names)
      flat += (flat.empty() ? "" : "_") + n;
  auto impl = std::make_shared<Impl>();
  impl->device_type = impl_->device_type;
  impl->shape = {size()};
  impl->names = {flat};
  impl->ranks = impl_->ranks;
  impl->coordinate = {ravel(coordinate(), impl_->shape)};
  // Sub-meshes that all ranks flatten at once partition the world; the lowest member names each.
  int color = *std::min_element(impl_->ranks.begin(), impl_->ranks.end());
  impl->groups = {
      world_group(impl_->device_type)->split(color, int(impl->coordinate[0]), "mesh." + flat)};
  impl->host_groups =
      host_lines(impl->device_type, impl->groups, {color}, {int(impl->coordinate[0])}, {flat});
  return DeviceMesh(std::shared_ptr<const Impl>(std::move(impl)));
}

bool DeviceMesh::operator==(const DeviceMesh& o) const {
  return impl_ == o.impl_ || (impl_->device_type == o.impl_->device_type &&
                              impl_->shape == o.impl_->shape && impl_->ranks == o.impl_->ranks);
}

std::string DeviceMesh::str() const {
  std::string s = "DeviceMesh(";
  if (impl_->device_type == DeviceType::CUDA) s += "'cuda', ";
  for (size_t d = 0; d < impl_->shape.size(); ++d)
    s += (d ? ", " : "") + impl_->names[d] + "=" + std::to_string(impl_->shape[d]);
  return s + ")";
}

}  // namespace tessera
