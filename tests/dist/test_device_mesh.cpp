// Meshes of a device type (over the world group of that device's backend) and meshes over
// existing groups. No second backend is built here, so the tests register one for CUDA that
// forwards every call to a host-staged CPU group and checks nothing itself: what they show is
// that a mesh of that device type is made from the registered backend's groups (its DTensors'
// pieces on the stand-in cuda:0), and that such a backend gets the argument checks, the debug
// signature check and the op counts without writing them.
#include <gtest/gtest.h>

#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"
#include "tessera/testing/stand_in_device.h"

using namespace tessera;
using tessera::testing::expect_error;

namespace {

int g_factory_calls = 0;
int g_forwarded = 0;  // calls that reached the test backend

// A backend that moves data through another group (host-staged, so device tensors reach MPI)
// and checks nothing.
class ForwardingGroup final : public ProcessGroup {
 public:
  explicit ForwardingGroup(ProcessGroupPtr to)
      : ProcessGroup(to->rank(), to->size(), to->world_ranks(), to->name()), to_(std::move(to)) {}
  WorkPtr all_reduce(Tensor& t, ReduceOp op) override { return on()->all_reduce(t, op); }
  WorkPtr all_gather_into_tensor(Tensor& out, const Tensor& in) override {
    return on()->all_gather_into_tensor(out, in);
  }
  WorkPtr all_gather(std::vector<Tensor>& outputs, const Tensor& in) override {
    return on()->all_gather(outputs, in);
  }
  WorkPtr reduce_scatter_tensor(Tensor& out, const Tensor& in, ReduceOp op) override {
    return on()->reduce_scatter_tensor(out, in, op);
  }
  WorkPtr reduce_scatter(Tensor& out, const std::vector<Tensor>& inputs, ReduceOp op) override {
    return on()->reduce_scatter(out, inputs, op);
  }
  WorkPtr all_to_all(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs) override {
    return on()->all_to_all(outputs, inputs);
  }
  WorkPtr broadcast(Tensor& t, int root) override { return on()->broadcast(t, root); }
  WorkPtr scatter(Tensor& out, const std::vector<Tensor>& inputs, int root) override {
    return on()->scatter(out, inputs, root);
  }
  WorkPtr send(const Tensor& t, int dst, int tag) override { return on()->send(t, dst, tag); }
  WorkPtr recv(Tensor& t, int src, int tag) override { return on()->recv(t, src, tag); }
  WorkPtr barrier() override { return on()->barrier(); }
  std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name) override {
    ProcessGroupPtr g = on()->split(color, key, name);
    return g ? std::make_shared<ForwardingGroup>(g) : nullptr;
  }

 private:
  const ProcessGroupPtr& on() {
    ++g_forwarded;
    return to_;
  }
  ProcessGroupPtr to_;
};

ProcessGroupPtr test_backend_world() {
  ++g_factory_calls;
  return std::make_shared<ForwardingGroup>(
      host_staged_group(world_group()->split(0, world_rank(), "test-backend-world")));
}

// A [4, 6] tensor distributed on `mesh` and gathered back must come back whole.
void expect_round_trip(const DeviceMesh& mesh, const std::vector<Placement>& placements) {
  const Tensor global = tessera::testing::index_tensor({4, 6}, DType::Float32);
  const DTensor d = distribute_tensor(global, mesh, placements);
  EXPECT_EQ(d.to_local().device(), mesh.device()) << mesh.str();
  tessera::testing::expect_local_matches(d, global);
  tessera::testing::expect_close(d.full_tensor(), global, 0.0, mesh.str());
}

}  // namespace

// Declared first: gtest runs a file's tests in order, and later tests register a backend.
TEST(DeviceMeshBackends, AMeshOfADeviceWithoutABackendIsAnErrorNamingTheDevice) {
  EXPECT_EQ(backend_name(DeviceType::CPU), "mpi");
  EXPECT_EQ(backend_name(DeviceType::CUDA), "");
  expect_error([] { register_backend(DeviceType::CPU, "other", test_backend_world); },
               {"the CPU's backend is MPI"});
  // Where NCCL is usable (a GPU per rank), a CUDA mesh takes it; the later tests register theirs
  // first, so this one then checks nothing more.
  const std::string why = nccl_unavailable();
  if (why.empty()) GTEST_SKIP() << "NCCL is usable here: a CUDA mesh would take it";
  expect_error([] { DeviceMesh(DeviceType::CUDA, Shape{world_size()}, {"x"}); },
               {"no communication backend for cuda tensors is registered",
                "NCCL is not usable (" + why + ")", "host_staged_backend()"});
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
  {
    tessera::testing::StandInDevice device;  // the pieces live on cuda:0
    expect_round_trip(mesh, {Shard(0)});
  }
  expect_error([] { register_backend(DeviceType::CUDA, "late", test_backend_world); },
               {"the cuda backend 'test' is already in use"});
}

TEST(DeviceMeshBackends, ABackendGetsTheChecksEveryBackendShares) {
  const int n = world_size();
  DeviceMesh mesh(DeviceType::CUDA, Shape{n}, {"x"});
  const ProcessGroupPtr& g = mesh.group(0);
  // Counted once, by the wrapper, and carried out by the backend.
  reset_comm_op_counts();
  const int before = g_forwarded;
  Tensor t = ones({3});
  g->all_reduce(t, ReduceOp::Sum)->wait();
  EXPECT_EQ(t.to_vector<float>(), std::vector<float>(3, float(n)));
  EXPECT_GT(g_forwarded, before);
  // The test backend's own all-reduce goes to a checked CPU group, which counts it too.
  EXPECT_EQ(comm_op_counts()["all_reduce"], 2);
  // Argument checks the backend does not make, on every rank before any data moves.
  const int forwarded = g_forwarded;
  Tensor undefined;
  expect_error([&] { g->all_reduce(undefined, ReduceOp::Sum); },
               {"all_reduce on group 'mesh.x'", "the tensor is an undefined tensor"});
  expect_error([&] { g->broadcast(t, n); },
               {"broadcast on group 'mesh.x'", "root", "is not a rank"});
  EXPECT_EQ(g_forwarded, forwarded) << "refused calls never reach the backend";
  // The debug signature check: rank 0 passes another shape, every rank gets the same error.
  if (n > 1) {
    set_debug_collectives(true);
    Tensor mine = ones({world_rank() == 0 ? 4 : 3});
    expect_error([&] { g->all_reduce(mine, ReduceOp::Sum); },
                 {"collective mismatch on group 'mesh.x'", "needs the same shape on every rank"});
    set_debug_collectives(false);
  }
}

// Host data (sizes, flags, agreement texts) travels on CPU groups over the same lines of ranks.
TEST(DeviceMeshBackends, EveryMeshHasCpuGroupsForHostData) {
  const int n = world_size();
  const Shape shape = n % 2 == 0 ? Shape{n / 2, 2} : Shape{n, 1};
  DeviceMesh cpu(shape, {"a", "b"});
  DeviceMesh cuda(DeviceType::CUDA, shape, {"a", "b"});
  for (int64_t m = 0; m < 2; ++m) {
    EXPECT_EQ(cpu.host_group(m), cpu.group(m)) << "a CPU mesh's own groups";
    const ProcessGroupPtr& host = cuda.host_group(m);
    EXPECT_NE(host, cuda.group(m));
    EXPECT_EQ(host->world_ranks(), cuda.group(m)->world_ranks());
    EXPECT_EQ(host->name(), "mesh." + cuda.dim_names()[size_t(m)] + ".host");
    Tensor rank = from_vector<int64_t>({int64_t(world_rank())});
    host->all_reduce(rank, ReduceOp::Max)->wait();  // a CPU tensor on a CPU group
    EXPECT_EQ(rank.item<int64_t>(), cuda.group(m)->world_ranks().back());
  }
  EXPECT_EQ(cuda["b"].host_group(0), cuda.host_group(1)) << "sub-meshes share them";
  EXPECT_EQ(cuda.flatten().host_group(0)->world_ranks(), cuda.world_ranks());
  const DeviceMesh over_groups =
      DeviceMesh::from_groups({cuda.group(0), cuda.group(1)}, {"a", "b"}, DeviceType::CUDA);
  EXPECT_EQ(over_groups.host_group(1)->world_ranks(), cuda.group(1)->world_ranks());
  const DeviceMesh one = DeviceMesh::from_group(cuda.group(0), "a", DeviceType::CUDA);
  expect_error([&] { one.host_group(0); }, {"made by from_group", "from_groups"});
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
