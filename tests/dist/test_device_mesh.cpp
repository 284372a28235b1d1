// Meshes of a device type (over the world group of that device's backend) and meshes over
// existing groups. No second backend is built here, so the tests register one for CUDA that is
// a copy of the MPI world: what they check is that a mesh of that device type is made from the
// registered backend's groups, not from MPI's world.
#include <gtest/gtest.h>

#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::expect_error;

namespace {

int g_factory_calls = 0;

ProcessGroupPtr test_backend_world() {
  ++g_factory_calls;
  return world_group()->split(0, world_rank(), "test-backend-world");
}

// A [4, 6] tensor distributed on `mesh` and gathered back must come back whole.
void expect_round_trip(const DeviceMesh& mesh, const std::vector<Placement>& placements) {
  const Tensor global = tessera::testing::index_tensor({4, 6}, DType::Float32);
  const DTensor d = distribute_tensor(global, mesh, placements);
  tessera::testing::expect_local_matches(d, global);
  tessera::testing::expect_close(d.full_tensor(), global, 0.0, mesh.str());
}

}  // namespace

// Declared first: gtest runs a file's tests in order, and later tests register a backend.
TEST(DeviceMeshBackends, AMeshOfADeviceWithoutABackendIsAnErrorNamingTheDevice) {
  EXPECT_EQ(backend_name(DeviceType::CPU), "mpi");
  EXPECT_EQ(backend_name(DeviceType::CUDA), "");
  expect_error([] { DeviceMesh(DeviceType::CUDA, Shape{world_size()}, {"x"}); },
               {"no communication backend for cuda tensors is registered"});
  expect_error([] { register_backend(DeviceType::CPU, "other", test_backend_world); },
               {"the CPU's backend is MPI"});
}

TEST(DeviceMeshBackends, AMeshOfADeviceTypeUsesThatDevicesBackend) {
  register_backend(DeviceType::CUDA, "test", test_backend_world);
  EXPECT_EQ(backend_name(DeviceType::CUDA), "test");
  const int n = world_size();
  DeviceMesh mesh(DeviceType::CUDA, Shape{n}, {"x"});
  DeviceMesh again(DeviceType::CUDA, Shape{n}, {"y"});
  EXPECT_EQ(g_factory_calls, 1) << "the backend's world group is made once";
  EXPECT_NE(world_group(DeviceType::CUDA), world_group());
  EXPECT_EQ(mesh.device_type(), DeviceType::CUDA);
  EXPECT_EQ(mesh.str(), "DeviceMesh('cuda', x=" + std::to_string(n) + ")");
  EXPECT_NE(mesh, DeviceMesh(Shape{n}, {"x"})) << "same ranks, another device type";
  EXPECT_EQ(mesh["x"].device_type(), DeviceType::CUDA);
  EXPECT_EQ(mesh.flatten().device_type(), DeviceType::CUDA);
  expect_round_trip(mesh, {Shard(0)});
  expect_error([] { register_backend(DeviceType::CUDA, "late", test_backend_world); },
               {"the cuda backend 'test' is already in use"});
}

TEST(DeviceMeshFromGroups, AOneDimMeshOverAGroup) {
  const int n = world_size();
  const DeviceMesh mesh = DeviceMesh::from_group(world_group(), "x");
  EXPECT_EQ(mesh, DeviceMesh(Shape{n}, {"x"}));
  EXPECT_EQ(mesh.group(0), world_group());
  EXPECT_EQ(mesh.coordinate(), std::vector<int64_t>{world_rank()});
  expect_round_trip(mesh, {Shard(1)});
  expect_round_trip(mesh, {Replicate()});
}

TEST(DeviceMeshFromGroups, AnNDimMeshOverTheGroupsOfAnother) {
  for (const Shape& shape : tessera::testing::mesh_shapes(world_size())) {
    const DeviceMesh made(shape);
    std::vector<ProcessGroupPtr> groups;
    for (int64_t d = 0; d < made.ndim(); ++d)
      groups.push_back(made.group(d));
    const DeviceMesh mesh = DeviceMesh::from_groups(groups, made.dim_names());
    SCOPED_TRACE(mesh.str());
    EXPECT_EQ(mesh, made);
    EXPECT_EQ(mesh.world_ranks(), made.world_ranks());
    EXPECT_EQ(mesh.coordinate(), made.coordinate());
    std::vector<Placement> placements(size_t(mesh.ndim()), Replicate());
    placements[0] = Shard(0);
    if (mesh.ndim() > 1) placements[1] = Shard(1);
    expect_round_trip(mesh, placements);
  }
}

TEST(DeviceMeshFromGroups, GroupsThatDoNotFormAMeshAreAnErrorOnEveryRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs a 2 x 2 mesh";
  const DeviceMesh made(Shape{2, 2}, {"a", "b"});
  // Rank 0 passes its groups in the wrong order: its coordinates disagree with the others'.
  std::vector<ProcessGroupPtr> groups = {made.group(0), made.group(1)};
  if (world_rank() == 0) std::swap(groups[0], groups[1]);
  const std::string mine = world_rank() == 0 ? "groups[0] ('mesh.b') is not world rank 0's line"
                                             : "another rank's groups do not fit";
  expect_error(
      [&] {
        DeviceMesh::from_groups(groups, {"a", "b"});
      },
      {"DeviceMesh::from_groups: the groups do not form a mesh", mine});
  // A mesh that leaves out world ranks.
  expect_error([&] { DeviceMesh::from_groups({made.group(0)}, {"a"}); },
               {"the mesh [2] has 2 ranks but the world has 4"});
}
