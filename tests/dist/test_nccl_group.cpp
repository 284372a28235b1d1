// The NCCL backend (nccl_backend) on the stand-in cuda:0, over NCCL emulated by MPI on the
// stand-in's memory (testing::use_emulated_nccl): the group's own code (bootstrap over MPI, the
// mapping of each operation onto NCCL calls, event-ordered completion, errors and aborts) runs
// as on a GPU; only the library under it differs. Every result is compared bit for bit with the
// same operation on CPU tensors over the CPU world group (values are small integers, so sums
// and products are exact in every dtype and the order of combining cannot matter).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing.h"
#include "tessera/testing/stand_in_device.h"

using namespace tessera;
using tessera::testing::expect_error;
using tessera::testing::StandInDevice;
using tessera::testing::use_emulated_nccl;

namespace {

class NcclGroup : public ::testing::Test {
 protected:
  // The emulation and its registration first: the stand-in then leaves the CUDA backend alone.
  tessera::detail::EmulatedNccl& nccl_ = use_emulated_nccl();
  StandInDevice device_;
  ProcessGroupPtr cuda_ = world_group(DeviceType::CUDA);
  ProcessGroupPtr cpu_ = world_group();
};

// Small integers that differ per rank and element, in `dtype`: 1 + (rank + i) % 3 (bool: odd).
Tensor values(const Shape& shape, DType dtype = DType::Float32, int salt = 0) {
  const int64_t n = shape_numel(shape);
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[size_t(i)] = dtype == DType::Bool ? double((world_rank() + i + salt) % 2)
                                        : double(1 + (world_rank() + i + salt) % 3);
  return from_vector(v, shape).to(dtype);
}

Tensor on_device(const Tensor& t) {
  return t.to(Device::cuda(0));
}

// Same dtype, still on the device, and the CPU tensor's values bit for bit.
void expect_same(const Tensor& device, const Tensor& cpu, const std::string& what) {
  EXPECT_TRUE(device.device().is_cuda()) << what;
  ASSERT_EQ(device.dtype(), cpu.dtype()) << what;
  EXPECT_EQ(device.to(Device::cpu()).to(DType::Float64).to_vector<double>(),
            cpu.to(DType::Float64).to_vector<double>())
      << what;
}

const std::vector<DType> kDTypes = {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16,
                                    DType::Int64,   DType::Int32,   DType::Bool};
const std::vector<ReduceOp> kOps = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min,
                                    ReduceOp::Product};

}  // namespace

TEST_F(NcclGroup, AllReduceOfEveryDtypeAndOpMatchesTheCpuGroup) {
  EXPECT_EQ(backend_name(DeviceType::CUDA), "nccl");
  for (DType dt : kDTypes)
    for (ReduceOp op : kOps) {
      if (dt == DType::Bool && op == ReduceOp::Avg) continue;  // refused by every backend
      const std::string what =
          std::string("all_reduce(") + reduce_op_name(op) + ") of " + dtype_name(dt);
      Tensor c = values({3, 5}, dt), d = on_device(c);
      cpu_->all_reduce(c, op)->wait();
      cuda_->all_reduce(d, op)->wait();
      expect_same(d, c, what);
    }
}

TEST_F(NcclGroup, StridedTensorsGoThroughContiguousBuffers) {
  const int n = world_size();
  // In place on a transposed view: the result lands in the caller's strided elements.
  Tensor base = values({4, 3}), dbase = on_device(base);
  Tensor c = base.as_strided({3, 4}, {1, 3}, 0), d = dbase.as_strided({3, 4}, {1, 3}, 0);
  cpu_->all_reduce(c, ReduceOp::Sum)->wait();
  cuda_->all_reduce(d, ReduceOp::Sum)->wait();
  expect_same(dbase, base, "all_reduce into a transposed view");
  // A strided input and a strided output of an all-gather.
  Tensor in = values({2, 3}).as_strided({3, 2}, {1, 3}, 0);
  Tensor cout = zeros({2, 3 * n}), dout = on_device(cout);
  Tensor cview = cout.as_strided({3 * n, 2}, {1, 3 * n}, 0);
  Tensor dview = dout.as_strided({3 * n, 2}, {1, 3 * n}, 0);
  cpu_->all_gather_into_tensor(cview, in)->wait();
  cuda_->all_gather_into_tensor(dview, on_device(in))->wait();
  expect_same(dout, cout, "all_gather_into_tensor into a strided view");
}

TEST_F(NcclGroup, EveryOtherCollectiveMatchesTheCpuGroup) {
  const int n = world_size(), me = world_rank();
  {
    Tensor in = values({2, 3}, DType::Int64);
    Tensor c = zeros({2 * n, 3}, DType::Int64), d = on_device(c);
    cpu_->all_gather_into_tensor(c, in)->wait();
    cuda_->all_gather_into_tensor(d, on_device(in))->wait();
    expect_same(d, c, "all_gather_into_tensor");
  }
  {
    // Shapes differ per rank, rank 0's piece is empty.
    Tensor in = values({me});
    std::vector<Tensor> c, d;
    for (int r = 0; r < n; ++r) {
      c.push_back(zeros({r}));
      d.push_back(on_device(zeros({r})));
    }
    cpu_->all_gather(c, in)->wait();
    cuda_->all_gather(d, on_device(in))->wait();
    for (int r = 0; r < n; ++r)
      expect_same(d[size_t(r)], c[size_t(r)], "all_gather from rank " + std::to_string(r));
  }
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
    Tensor in = values({2 * n, 2}, DType::BFloat16);
    Tensor c = zeros({2, 2}, DType::BFloat16), d = on_device(c);
    cpu_->reduce_scatter_tensor(c, in, op)->wait();
    cuda_->reduce_scatter_tensor(d, on_device(in), op)->wait();
    expect_same(d, c, std::string("reduce_scatter_tensor(") + reduce_op_name(op) + ")");
  }
  {
    std::vector<Tensor> inputs, dev_inputs;
    for (int r = 0; r < n; ++r) {
      inputs.push_back(values({r + 1}, DType::Int32, r));
      dev_inputs.push_back(on_device(inputs.back()));
    }
    Tensor c = zeros({me + 1}, DType::Int32), d = on_device(c);
    cpu_->reduce_scatter(c, inputs, ReduceOp::Avg)->wait();
    cuda_->reduce_scatter(d, dev_inputs, ReduceOp::Avg)->wait();
    expect_same(d, c, "reduce_scatter(avg) of int32");
  }
  {
    std::vector<Tensor> inputs, dev_inputs, c, d;
    for (int r = 0; r < n; ++r) {
      inputs.push_back(values({(me + r) % 3}, DType::Float32, 10 * r));
      dev_inputs.push_back(on_device(inputs.back()));
      c.push_back(zeros({(r + me) % 3}));
      d.push_back(on_device(c.back()));
    }
    cpu_->all_to_all(c, inputs)->wait();
    cuda_->all_to_all(d, dev_inputs)->wait();
    for (int r = 0; r < n; ++r)
      expect_same(d[size_t(r)], c[size_t(r)], "all_to_all from rank " + std::to_string(r));
  }
  for (int root = 0; root < n; ++root) {
    Tensor c = values({4}, DType::Float16), d = on_device(c);
    cpu_->broadcast(c, root)->wait();
    cuda_->broadcast(d, root)->wait();
    expect_same(d, c, "broadcast from " + std::to_string(root));
  }
  {
    const int root = n - 1;
    std::vector<Tensor> inputs, dev_inputs;
    if (me == root)
      for (int r = 0; r < n; ++r) {
        inputs.push_back(values({r + 1}, DType::Float64, 7 * r));
        dev_inputs.push_back(on_device(inputs.back()));
      }
    Tensor c = zeros({me + 1}, DType::Float64), d = on_device(c);
    cpu_->scatter(c, inputs, root)->wait();
    cuda_->scatter(d, dev_inputs, root)->wait();
    expect_same(d, c, "scatter");
  }
  {
    // The default all_gather_runs: a padded all-gather, then the runs copied into place.
    std::vector<std::vector<GatherRun>> runs(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r)
      runs[size_t(r)] = {GatherRun{0, 4 * r + 1, 3}};
    Tensor in = values({3});
    Tensor c = full({4 * n}, -1.0), d = on_device(c);
    cpu_->all_gather_runs(c, in, runs)->wait();
    cuda_->all_gather_runs(d, on_device(in), runs)->wait();
    expect_same(d, c, "all_gather_runs");
  }
  cuda_->barrier()->wait();
}

TEST_F(NcclGroup, SendsAndReceivesPairUpInARing) {
  const int n = world_size(), me = world_rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  Tensor mine = on_device(values({5}, DType::Int64));
  Tensor got = on_device(zeros({5}, DType::Int64));
  // Even ranks send first, odd ranks receive first: NCCL's send waits for its receiver.
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  if (me % 2 == 0) {
    WorkPtr s = cuda_->send(mine, next);
    cuda_->recv(got, prev)->wait();
    s->wait();
  } else {
    cuda_->recv(got, prev)->wait();
    cuda_->send(mine, next)->wait();
  }
  std::vector<int64_t> want;
  for (int64_t i = 0; i < 5; ++i)
    want.push_back(1 + (prev + i) % 3);
  EXPECT_EQ(got.to(Device::cpu()).to_vector<int64_t>(), want);
}

TEST_F(NcclGroup, AnOperationCompletesOnlyWhenEveryMemberIssuedIt) {
  const int n = world_size(), me = world_rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  Tensor d = on_device(values({3}));
  if (me == 0) {
    WorkPtr w = cuda_->all_reduce(d, ReduceOp::Sum);
    // Rank 1 issues its all_reduce only after the CPU barrier below.
    EXPECT_FALSE(w->is_completed());
    cpu_->barrier()->wait();
    w->wait();
    EXPECT_TRUE(w->is_completed());
  } else {
    cpu_->barrier()->wait();
    cuda_->all_reduce(d, ReduceOp::Sum)->wait();
  }
  Tensor c = values({3});
  cpu_->all_reduce(c, ReduceOp::Sum)->wait();
  expect_same(d, c, "the all_reduce issued late by the other ranks");
}

TEST_F(NcclGroup, SplitGroupsHaveCommunicatorsOfTheirOwn) {
  const int me = world_rank();
  ProcessGroupPtr half = cuda_->split(me % 2, me, "half");
  ProcessGroupPtr cpu_half = cpu_->split(me % 2, me, "half_cpu");
  ASSERT_NE(half, nullptr);
  EXPECT_EQ(half->size(), cpu_half->size());
  Tensor c = values({6}, DType::Int32), d = on_device(c);
  cpu_half->all_reduce(c, ReduceOp::Sum)->wait();
  half->all_reduce(d, ReduceOp::Sum)->wait();
  expect_same(d, c, "all_reduce on a split group");
  EXPECT_EQ(cuda_->split(-1, me, "none"), nullptr);
}

TEST_F(NcclGroup, RefusesTensorsOfAnotherDeviceNamingIt) {
  Tensor host = values({3});
  expect_error([&] { cuda_->all_reduce(host, ReduceOp::Sum)->wait(); },
               {"all_reduce(sum) float32 [3]", "group 'world'", "is on cpu",
                "NCCL group moves tensors on cuda:0"});
  // Nothing was issued: the group still works.
  Tensor c = values({2}), d = on_device(c);
  cpu_->all_reduce(c, ReduceOp::Max)->wait();
  cuda_->all_reduce(d, ReduceOp::Max)->wait();
  expect_same(d, c, "all_reduce after a refused call");
}

TEST_F(NcclGroup, RanksSharingOneGpuAreRefusedOnEveryRank) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  nccl_.pretend_one_gpu(true);
  expect_error([] { nccl_backend()(); }, {"ranks 0 and 1 both drive GPU",
                                          "NCCL needs a GPU per rank", "host_staged_backend()"});
  nccl_.pretend_one_gpu(false);
}

// A split whose NCCL bootstrap fails on the members of one new group only (ranks 0 and 1 report
// one GPU, the others a GPU each): those members throw and catch it, and the others must not be
// left waiting for them in a split of their own. Were they, the short collective timeout would
// end the job at the barrier below instead of letting it hang.
TEST_F(NcclGroup, ASplitThatFailsOnSomeMembersLeavesTheOthersFree) {
  const int n = world_size(), me = world_rank();
  if (n < 3) GTEST_SKIP() << "needs three ranks";
  const double timeout = collective_timeout_seconds();
  set_collective_timeout_seconds(20);
  nccl_.pretend_one_gpu(me < 2);
  if (me < 2) {
    expect_error([&] { cuda_->split(0, me, "pair"); }, {"ranks 0 and 1 both drive GPU"});
  } else {
    ProcessGroupPtr rest = cuda_->split(1, me, "rest");
    EXPECT_NE(rest, nullptr);
    Tensor d = on_device(ones({2}));
    if (rest) rest->all_reduce(d, ReduceOp::Sum)->wait();
    EXPECT_EQ(d.to(Device::cpu()).to_vector<float>(), std::vector<float>(2, float(n - 2)));
  }
  nccl_.pretend_one_gpu(false);
  cpu_->barrier()->wait();
  set_collective_timeout_seconds(timeout);
}

TEST_F(NcclGroup, AFailedTransferAbortsTheCommunicatorAndNamesTheOperation) {
  const int me = world_rank(), n = world_size();
  ProcessGroupPtr doomed = cuda_->split(0, me, "doomed");
  const int64_t aborts = nccl_.aborts();
  nccl_.fail_next("link down (emulated)");
  Tensor d = on_device(values({3}));
  expect_error([&] { doomed->all_reduce(d, ReduceOp::Sum)->wait(); },
               {"all_reduce(sum) float32 [3]", "group 'doomed'",
                "rank " + std::to_string(me) + " of " + std::to_string(n), "cuda:0",
                "failed: link down (emulated)", "the communicator was aborted"});
  EXPECT_EQ(nccl_.aborts(), aborts + 1);
  expect_error([&] { doomed->broadcast(d, 0)->wait(); },
               {"broadcast", "group 'doomed'", "communicator was aborted"});
  // Other groups are untouched.
  Tensor c = values({3}), e = on_device(c);
  cpu_->all_reduce(c, ReduceOp::Sum)->wait();
  cuda_->all_reduce(e, ReduceOp::Sum)->wait();
  expect_same(e, c, "all_reduce on the world after another group failed");
}

TEST_F(NcclGroup, AMeshOfCudaTensorsRedistributesOverIt) {
  const int n = world_size();
  DeviceMesh mesh(DeviceType::CUDA, Shape{n}, {"x"});
  DeviceMesh cpu_mesh(Shape{n}, {"x"});
  const Tensor global = tessera::testing::random_tensor({5, 3}, 31, DType::Float32);
  DTensor d = distribute_tensor(global, mesh, {Shard(0)}).redistribute({Shard(1)});
  DTensor c = distribute_tensor(global, cpu_mesh, {Shard(0)}).redistribute({Shard(1)});
  expect_same(d.to_local(), c.to_local(), "S(0) -> S(1)");
  expect_same(d.full_tensor(), global, "full_tensor");
}
