// The MPI process group's collectives for every dtype and reduce op (all-reduce, all-gather,
// reduce-scatter, broadcast, scatter), asynchronous operations, send and receive, and splitting
// the world, on worlds of 1, 2, 3, 4 and 8 ranks. Expected values are computed from the rank
// numbers alone. Tensors of other layouts: test_process_group_layouts.cpp, in the same binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "dist/process_group_util.h"
#include "tessera/comm/comm.h"
#include "tessera/core/core.h"

using namespace tessera;
using namespace tessera::process_group_test;

TEST(ProcessGroup, WorldDescribesTheJob) {
  auto g = world();
  EXPECT_EQ(g->name(), "world");
  EXPECT_EQ(g->size(), world_size());
  EXPECT_EQ(g->rank(), world_rank());
  std::vector<int> expected(size_t(g->size()));
  for (int r = 0; r < g->size(); ++r)
    expected[size_t(r)] = r;
  EXPECT_EQ(g->world_ranks(), expected);
}

TEST(ProcessGroup, AllReduceEveryDTypeAndOp) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  for (DType dt : kDTypes) {
    for (ReduceOp op : kOps) {
      if (dt == DType::Bool && op == ReduceOp::Avg) continue;  // an error: test_comm_errors
      SCOPED_TRACE(label(dt, op));
      Tensor t = make(dt, {3, 5}, [&](int64_t i) { return contribution(op, dt, me, i); });
      g->all_reduce(t, op)->wait();
      EXPECT_EQ(t.dtype(), dt);
      EXPECT_EQ(t.shape(), (Shape{3, 5}));
      std::vector<double> expected(15);
      for (int64_t i = 0; i < 15; ++i) {
        expected[size_t(i)] =
            expected_reduction(op, dt, n, [&](int r) { return contribution(op, dt, r, i); });
      }
      EXPECT_EQ(values(t), expected);
    }
  }
}

// 16-bit sums combine in float32 and round to nearest even. With two ranks that is exactly one
// float32 addition then one rounding; with more, each combining step rounds, so the result stays
// within a rounding step per rank of the float32 sum.
TEST(ProcessGroup, HalfSumRoundsFromFloat32) {
  auto g = world();
  const int n = g->size();
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int mantissa_bits = dt == DType::BFloat16 ? 7 : 10;
    const double unit = std::ldexp(1.0, -mantissa_bits);  // the spacing of values in [1, 2)
    // 1 + k * unit is exact in the dtype; sums of several of them are not.
    auto v = [&](int r, int64_t i) { return 1.0 + double((r + 3 * i) % 7 + 1) * unit; };
    Tensor t = make(dt, {8}, [&](int64_t i) { return v(g->rank(), i); });
    g->all_reduce(t, ReduceOp::Sum)->wait();
    const std::vector<double> got = values(t);
    for (int64_t i = 0; i < 8; ++i) {
      float sum = 0;
      for (int r = 0; r < n; ++r)
        sum += float(v(r, i));
      const double rounded =
          dt == DType::BFloat16 ? double(float(BFloat16(sum))) : double(float(Float16(sum)));
      if (n <= 2) {
        EXPECT_EQ(got[size_t(i)], rounded) << "element " << i;
      } else {
        const double ulp = std::ldexp(1.0, int(std::floor(std::log2(sum))) - mantissa_bits);
        EXPECT_LE(std::abs(got[size_t(i)] - double(sum)), double(n) * ulp) << "element " << i;
      }
    }
  }
}

TEST(ProcessGroup, AllGatherIntoTensorEveryDType) {
  auto g = world();
  const int n = g->size();
  for (DType dt : kDTypes) {
    SCOPED_TRACE(dtype_name(dt));
    auto v = [&](int r, int64_t i) {
      return dt == DType::Bool ? double((r + i) % 2) : double(r * 10 + i);
    };
    Tensor in = make(dt, {2, 3}, [&](int64_t i) { return v(g->rank(), i); });
    Tensor out = zeros({2 * n, 3}, dt);
    g->all_gather_into_tensor(out, in)->wait();
    std::vector<double> expected;
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < 6; ++i)
        expected.push_back(v(r, i));
    EXPECT_EQ(values(out), expected);
  }
}

// FSDP's layout: the input is this rank's slot of the output (MPI_IN_PLACE).
TEST(ProcessGroup, AllGatherIntoTensorInPlace) {
  auto g = world();
  const int n = g->size();
  Tensor out = zeros({2 * n, 3}, DType::Float32);
  Tensor mine = kernels::narrow(out, 0, 2 * g->rank(), 2);
  mine.copy_(make(DType::Float32, {2, 3}, [&](int64_t i) { return g->rank() * 100.0 + i; }));
  g->all_gather_into_tensor(out, mine)->wait();
  std::vector<double> expected;
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < 6; ++i)
      expected.push_back(r * 100.0 + i);
  EXPECT_EQ(values(out), expected);

  // An input lying in another rank's slot is read before any slot is written.
  Tensor out2 = zeros({2 * n, 3}, DType::Float32);
  Tensor next_slot = kernels::narrow(out2, 0, 2 * ((g->rank() + 1) % n), 2);
  next_slot.copy_(make(DType::Float32, {2, 3}, [&](int64_t i) { return g->rank() * 100.0 + i; }));
  g->all_gather_into_tensor(out2, next_slot)->wait();
  EXPECT_EQ(values(out2), expected);
}

TEST(ProcessGroup, ReduceScatterTensorEveryDTypeAndOp) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  for (DType dt : kDTypes) {
    for (ReduceOp op : kOps) {
      if (dt == DType::Bool && op == ReduceOp::Avg) continue;
      SCOPED_TRACE(label(dt, op));
      Tensor in = make(dt, {2 * n, 3}, [&](int64_t i) { return contribution(op, dt, me, i); });
      Tensor out = zeros({2, 3}, dt);
      g->reduce_scatter_tensor(out, in, op)->wait();
      std::vector<double> expected(6);
      for (int64_t j = 0; j < 6; ++j) {
        const int64_t i = me * 6 + j;  // this rank's block of the input
        expected[size_t(j)] =
            expected_reduction(op, dt, n, [&](int r) { return contribution(op, dt, r, i); });
      }
      EXPECT_EQ(values(out), expected);
    }
  }
}

TEST(ProcessGroup, BroadcastFromEveryRoot) {
  auto g = world();
  for (int root = 0; root < g->size(); ++root) {
    for (DType dt : kDTypes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " root " + std::to_string(root));
      auto v = [&](int64_t i) { return dt == DType::Bool ? double(i % 2) : double(root * 10 + i); };
      Tensor t = g->rank() == root ? make(dt, {4, 3}, v) : zeros({4, 3}, dt);
      g->broadcast(t, root)->wait();
      EXPECT_EQ(values(t), values(make(dt, {4, 3}, v)));
    }
  }
}

// The root sends (s + 1) % 3 elements to rank s: uneven, some empty.
TEST(ProcessGroup, ScatterUneven) {
  auto g = world();
  const int n = g->size();
  const int root = n - 1;
  auto len = [](int s) { return int64_t((s + 1) % 3); };
  auto v = [](int s, int64_t j) { return 10.0 * s + double(j); };
  for (bool root_output_in_place : {false, true}) {
    SCOPED_TRACE(root_output_in_place ? "root's output is its own input" : "separate tensors");
    std::vector<Tensor> inputs;
    std::vector<int64_t> sizes;
    int64_t total = 0;
    for (int s = 0; s < n; ++s) {
      sizes.push_back(len(s));
      total += len(s);
    }
    Tensor whole = empty({total}, DType::Float32);
    Tensor out = full({len(g->rank())}, -1, DType::Float32);
    if (g->rank() == root) {
      inputs = kernels::split(whole, sizes, 0);
      for (int s = 0; s < n; ++s) {
        inputs[size_t(s)].copy_(make(DType::Float32, {len(s)}, [&](int64_t j) { return v(s, j); }));
      }
      if (root_output_in_place) out = inputs[size_t(root)];
    }
    g->scatter(out, inputs, root)->wait();
    std::vector<double> expected;
    for (int64_t j = 0; j < len(g->rank()); ++j)
      expected.push_back(v(g->rank(), j));
    EXPECT_EQ(values(out), expected);
  }
}

TEST(ProcessGroup, AsyncOperationsOverlap) {
  auto g = world();
  const int n = g->size();
  Tensor a = full({16}, g->rank() + 1, DType::Float64);
  Tensor in = full({2}, g->rank(), DType::Int64);
  Tensor gathered = zeros({2 * n}, DType::Int64);
  WorkPtr first = g->all_reduce(a, ReduceOp::Sum);
  WorkPtr second = g->all_gather_into_tensor(gathered, in);
  WorkPtr third = g->barrier();
  // Waited out of order: completion does not depend on it.
  third->wait();
  second->wait();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!first->is_completed() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  ASSERT_TRUE(first->is_completed());
  first->wait();  // a second wait after completion is a no-op
  EXPECT_EQ(values(a), std::vector<double>(16, n * (n + 1) / 2.0));
  std::vector<double> expected;
  for (int r = 0; r < n; ++r)
    expected.insert(expected.end(), {double(r), double(r)});
  EXPECT_EQ(values(gathered), expected);
}

TEST(ProcessGroup, SendRecvRing) {
  auto g = world();
  const int n = g->size();
  const int dst = (g->rank() + 1) % n;
  const int src = (g->rank() + n - 1) % n;
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Int64}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor out = make(dt, {3, 2}, [&](int64_t i) { return g->rank() * 10.0 + i; });
    // The receive lands in a transposed (non-contiguous) view.
    Tensor backing = zeros({2, 3}, dt);
    Tensor in = kernels::transpose(backing, 0, 1);
    WorkPtr r = g->recv(in, src, 7);
    WorkPtr s = g->send(out, dst, 7);
    s->wait();
    r->wait();
    EXPECT_EQ(values(in), values(make(dt, {3, 2}, [&](int64_t i) { return src * 10.0 + i; })));
  }
}

TEST(ProcessGroup, SplitIntoEvenAndOddRanks) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  const int parity = me % 2;
  auto sub = g->split(parity, me, "parity");
  ASSERT_NE(sub, nullptr);
  std::vector<int> members;
  for (int r = parity; r < n; r += 2)
    members.push_back(r);
  EXPECT_EQ(sub->name(), "parity");
  EXPECT_EQ(sub->size(), int(members.size()));
  EXPECT_EQ(sub->rank(), me / 2);
  EXPECT_EQ(sub->world_ranks(), members);

  Tensor t = full({5}, me, DType::Int64);
  sub->all_reduce(t, ReduceOp::Sum)->wait();
  double sum = 0;
  for (int r : members)
    sum += r;
  EXPECT_EQ(values(t), std::vector<double>(5, sum));

  Tensor gathered = zeros({sub->size()}, DType::Int32);
  sub->all_gather_into_tensor(gathered, full({1}, me, DType::Int32))->wait();
  EXPECT_EQ(values(gathered), std::vector<double>(members.begin(), members.end()));

  // Key orders the new ranks: a descending key reverses the world order.
  auto reversed = g->split(0, -me, "reversed");
  ASSERT_NE(reversed, nullptr);
  EXPECT_EQ(reversed->rank(), n - 1 - me);
  Tensor who = full({1}, me, DType::Int64);
  reversed->broadcast(who, 0)->wait();
  EXPECT_EQ(who.item<int64_t>(), n - 1);

  // A negative color leaves a rank out; a split of a split works too.
  auto without_zero = g->split(me == 0 ? -1 : 0, me, "without_zero");
  if (me == 0) {
    EXPECT_EQ(without_zero, nullptr);
  } else {
    ASSERT_NE(without_zero, nullptr);
    EXPECT_EQ(without_zero->size(), n - 1);
    EXPECT_EQ(without_zero->rank(), me - 1);
    auto nested = without_zero->split(me % 2, me, "nested");
    ASSERT_NE(nested, nullptr);
    Tensor c = ones({2}, DType::Float32);
    nested->all_reduce(c, ReduceOp::Sum)->wait();
    int expected = 0;
    for (int r = 1; r < n; ++r)
      expected += (r % 2 == me % 2);
    EXPECT_EQ(values(c), std::vector<double>(2, expected));
  }
}
