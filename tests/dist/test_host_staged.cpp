// The host-staged backend (host_staged_group): device tensors go through host memory over the
// CPU's MPI groups. No GPU is needed to test what it adds: the tests stand host memory in for
// cuda:0 (set_allocator and set_device_copy), so "device" tensors are ones the MPI group refuses
// and only the staging can move; every result is compared bit for bit with the same operation
// on CPU tensors over the CPU world group.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "common/counting_allocator.h"
#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using tessera::testing::expect_error;

namespace {

// cuda:0 made of host memory, with a count of the bytes copied to and from it.
class StandInCudaAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override { return nbytes ? std::malloc(nbytes) : nullptr; }
  void deallocate(void* ptr, size_t) override { std::free(ptr); }
  Device device() const override { return Device::cuda(0); }
};
StandInCudaAllocator g_stand_in;
int64_t g_copied_bytes = 0;
void stand_in_copy(void* dst, Device, const void* src, Device, size_t nbytes) {
  std::memcpy(dst, src, nbytes);
  g_copied_bytes += int64_t(nbytes);
}

class HostStaged : public ::testing::Test {
 protected:
  void SetUp() override {
    old_allocator_ = set_allocator(DeviceType::CUDA, &g_stand_in);
    old_copy_ = set_device_copy(&stand_in_copy);
  }
  void TearDown() override {
    set_allocator(DeviceType::CUDA, old_allocator_);
    set_device_copy(old_copy_);
  }
  ProcessGroupPtr staged_ = host_staged_group(world_group());
  ProcessGroupPtr cpu_ = world_group();

 private:
  Allocator* old_allocator_ = nullptr;
  DeviceCopyFn old_copy_ = nullptr;
};

// Values that differ per rank and per element: [rank * 100 + i] + offset.
Tensor values(const Shape& shape, double offset = 0.0) {
  const int64_t n = shape_numel(shape);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[size_t(i)] = float(world_rank() * 100 + i) + float(offset);
  return from_vector(v, shape);
}

Tensor on_device(const Tensor& t) {
  return t.to(Device::cuda(0));
}

// The device tensor is still on the device and holds what the CPU tensor holds, bit for bit.
void expect_same(const Tensor& device, const Tensor& cpu, const std::string& what) {
  EXPECT_TRUE(device.device().is_cuda()) << what;
  EXPECT_EQ(device.to(Device::cpu()).to_vector<float>(), cpu.to_vector<float>()) << what;
}

}  // namespace

TEST_F(HostStaged, TheMpiGroupRefusesDeviceTensorsThatStagingMoves) {
  Tensor d = on_device(values({3}));
  expect_error([&] { cpu_->all_reduce(d, ReduceOp::Sum)->wait(); }, {"all_reduce", "cuda:0"});
  Tensor c = values({3});
  cpu_->all_reduce(c, ReduceOp::Sum)->wait();
  staged_->all_reduce(d, ReduceOp::Sum)->wait();
  expect_same(d, c, "all_reduce");
}

TEST_F(HostStaged, EveryCollectiveMatchesTheCpuGroup) {
  const int n = world_size(), me = world_rank();
  {
    Tensor c = values({2, 3}), d = on_device(c);
    cpu_->all_reduce(c, ReduceOp::Max)->wait();
    staged_->all_reduce(d, ReduceOp::Max)->wait();
    expect_same(d, c, "all_reduce(max)");
  }
  {
    Tensor in = values({2, 3});
    Tensor c = zeros({2 * n, 3}), d = on_device(c);
    cpu_->all_gather_into_tensor(c, in)->wait();
    staged_->all_gather_into_tensor(d, on_device(in))->wait();
    expect_same(d, c, "all_gather_into_tensor");
  }
  {
    // Shapes differ per rank.
    Tensor in = values({me + 1});
    std::vector<Tensor> c, d;
    for (int r = 0; r < n; ++r) {
      c.push_back(zeros({r + 1}));
      d.push_back(on_device(zeros({r + 1})));
    }
    cpu_->all_gather(c, in)->wait();
    staged_->all_gather(d, on_device(in))->wait();
    for (int r = 0; r < n; ++r)
      expect_same(d[size_t(r)], c[size_t(r)], "all_gather from rank " + std::to_string(r));
  }
  {
    Tensor in = values({2 * n, 2});
    Tensor c = zeros({2, 2}), d = on_device(c);
    cpu_->reduce_scatter_tensor(c, in, ReduceOp::Sum)->wait();
    staged_->reduce_scatter_tensor(d, on_device(in), ReduceOp::Sum)->wait();
    expect_same(d, c, "reduce_scatter_tensor");
  }
  {
    std::vector<Tensor> inputs, dev_inputs;
    for (int r = 0; r < n; ++r) {
      inputs.push_back(values({r + 2}, r));
      dev_inputs.push_back(on_device(inputs.back()));
    }
    Tensor c = zeros({me + 2}), d = on_device(c);
    cpu_->reduce_scatter(c, inputs, ReduceOp::Sum)->wait();
    staged_->reduce_scatter(d, dev_inputs, ReduceOp::Sum)->wait();
    expect_same(d, c, "reduce_scatter");
  }
  {
    std::vector<Tensor> inputs, dev_inputs, c, d;
    for (int r = 0; r < n; ++r) {
      inputs.push_back(values({me + r + 1}, 10 * r));
      dev_inputs.push_back(on_device(inputs.back()));
      c.push_back(zeros({r + me + 1}));
      d.push_back(on_device(c.back()));
    }
    cpu_->all_to_all(c, inputs)->wait();
    staged_->all_to_all(d, dev_inputs)->wait();
    for (int r = 0; r < n; ++r)
      expect_same(d[size_t(r)], c[size_t(r)], "all_to_all from rank " + std::to_string(r));
  }
  {
    const int root = n - 1;
    Tensor c = values({4}), d = on_device(c);
    cpu_->broadcast(c, root)->wait();
    staged_->broadcast(d, root)->wait();
    expect_same(d, c, "broadcast");
  }
  {
    const int root = 0;
    std::vector<Tensor> inputs, dev_inputs;
    if (me == root)
      for (int r = 0; r < n; ++r) {
        inputs.push_back(values({r + 1}, 7 * r));
        dev_inputs.push_back(on_device(inputs.back()));
      }
    Tensor c = zeros({me + 1}), d = on_device(c);
    cpu_->scatter(c, inputs, root)->wait();
    staged_->scatter(d, dev_inputs, root)->wait();
    expect_same(d, c, "scatter");
  }
}

TEST_F(HostStaged, GatherRunsKeepWhatNoRunWrites) {
  const int n = world_size();
  // Rank r's [3] piece lands at 4 * r + 1 of a [4 * n] tensor: index 4 * r stays as it was.
  std::vector<std::vector<GatherRun>> runs(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    runs[size_t(r)] = {GatherRun{0, 4 * r + 1, 3}};
  Tensor in = values({3});
  Tensor c = full({4 * n}, -1.0), d = on_device(c);
  cpu_->all_gather_runs(c, in, runs)->wait();
  staged_->all_gather_runs(d, on_device(in), runs)->wait();
  expect_same(d, c, "all_gather_runs");
  EXPECT_EQ(d.to(Device::cpu()).to_vector<float>()[0], -1.0f);
}

TEST_F(HostStaged, SendAndRecvPassDeviceTensorsAround) {
  const int n = world_size(), me = world_rank();
  if (n == 1) GTEST_SKIP() << "needs a peer";
  Tensor out = on_device(values({5}));
  Tensor got = on_device(zeros({5}));
  WorkPtr r = staged_->recv(got, (me + n - 1) % n, 3);
  WorkPtr s = staged_->send(out, (me + 1) % n, 3);
  s->wait();
  r->wait();
  const int from = (me + n - 1) % n;
  std::vector<float> want;
  for (int i = 0; i < 5; ++i)
    want.push_back(float(from * 100 + i));
  EXPECT_EQ(got.to(Device::cpu()).to_vector<float>(), want);
}

TEST_F(HostStaged, ResultsLandOnCompletionOrWhenTheWorkIsDropped) {
  const int n = world_size();
  Tensor d = on_device(ones({3}));
  WorkPtr w = staged_->all_reduce(d, ReduceOp::Sum);
  while (!w->is_completed()) {
  }
  expect_same(d, full({3}, double(n)), "after is_completed()");
  w->wait();  // a second completion copies nothing again
  expect_same(d, full({3}, double(n)), "after wait()");
  Tensor e = on_device(ones({3}));
  staged_->all_reduce(e, ReduceOp::Sum);  // the work is dropped at once
  expect_same(e, full({3}, double(n)), "after dropping the work");
}

// Where something can pin, the host buffers are pinned (both copies then run at full speed).
TEST_F(HostStaged, StagingBuffersArePinnedWhereSomethingCanPin) {
  tessera::testing::CountingHostAllocator pool;
  Allocator* before = set_pinned_allocator(&pool);
  Tensor c = values({2, 3}), d = on_device(c);
  cpu_->all_reduce(c, ReduceOp::Sum)->wait();
  EXPECT_EQ(pool.allocations, 0) << "CPU tensors are not staged";
  staged_->all_reduce(d, ReduceOp::Sum)->wait();
  EXPECT_EQ(pool.allocations, 1) << "one pinned buffer, read and written in place";
  expect_same(d, c, "all_reduce through a pinned buffer");
  const int n = world_size();
  Tensor out = on_device(zeros({2 * n, 3}));
  staged_->all_gather_into_tensor(out, on_device(values({2, 3})))->wait();
  EXPECT_EQ(pool.allocations, 3) << "one buffer for the input, one for the output";
  set_pinned_allocator(before);
}

TEST_F(HostStaged, HostTensorsPassThroughWithoutCopies) {
  const int64_t before = g_copied_bytes;
  Tensor c = values({64});
  Tensor reference = c.clone();
  staged_->all_reduce(c, ReduceOp::Sum)->wait();
  cpu_->all_reduce(reference, ReduceOp::Sum)->wait();
  EXPECT_EQ(c.to_vector<float>(), reference.to_vector<float>());
  EXPECT_EQ(g_copied_bytes, before) << "a CPU tensor needs no staging";
  Tensor d = on_device(values({64}));
  const int64_t staged_before = g_copied_bytes;
  staged_->all_reduce(d, ReduceOp::Sum)->wait();
  EXPECT_EQ(g_copied_bytes - staged_before, 2 * 64 * 4) << "one copy to the host, one back";
}

TEST_F(HostStaged, SplitGroupsStageToo) {
  const int me = world_rank();
  ProcessGroupPtr half = staged_->split(me % 2, me, "half");
  ASSERT_NE(half, nullptr);
  Tensor d = on_device(full({2}, double(me)));
  half->all_reduce(d, ReduceOp::Sum)->wait();
  double want = 0;
  for (int r = me % 2; r < world_size(); r += 2)
    want += r;
  expect_same(d, full({2}, want), "all_reduce over the split group");
  EXPECT_EQ(staged_->split(-1, me, "none"), nullptr);
}

TEST_F(HostStaged, AsTheCudaBackendItCarriesAMeshOfCudaTensors) {
  register_backend(DeviceType::CUDA, "mpi", host_staged_backend());
  const int n = world_size();
  DeviceMesh mesh(DeviceType::CUDA, Shape{n}, {"x"});
  EXPECT_EQ(backend_name(DeviceType::CUDA), "mpi");
  const ProcessGroupPtr& g = mesh.group(0);
  Tensor d = on_device(values({4}));
  Tensor c = values({4});
  reset_comm_op_counts();
  g->all_reduce(d, ReduceOp::Sum)->wait();
  // Checked and counted once, by the device world's wrapper (not again by the CPU world's).
  EXPECT_EQ(comm_op_counts()["all_reduce"], 1);
  cpu_->all_reduce(c, ReduceOp::Sum)->wait();
  expect_same(d, c, "all_reduce over the cuda mesh");
  // The checks every backend gets apply to device tensors too, on every rank.
  Tensor undefined;
  expect_error([&] { g->all_reduce(undefined, ReduceOp::Sum); },
               {"all_reduce on group 'mesh.x'", "the tensor is an undefined tensor"});
}

// A device tensor that requires grad, under grad mode, takes the result as a host one does: the
// copy back from the host writes it whatever autograd says of it (it threw in wait()).
TEST_F(HostStaged, ADeviceTensorThatRequiresGradTakesTheResult) {
  const int n = world_size();
  Tensor d = on_device(ones({3}));
  d.set_requires_grad(true);
  staged_->all_reduce(d, ReduceOp::Sum)->wait();
  expect_same(d, full({3}, double(n)), "after wait()");
}
