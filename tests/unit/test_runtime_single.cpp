// A process started without mpirun is a world of one rank, and every collective works on it.
#include <gtest/gtest.h>

#include "tessera/comm/comm.h"
#include "tessera/core/core.h"

using namespace tessera;

namespace {

ProcessGroupPtr world() {
  init();  // idempotent: each test may be the first one run in its process
  return world_group();
}

std::vector<double> values(const Tensor& t) {
  return t.to_vector<double>();
}

}  // namespace

TEST(RuntimeSingle, InitGivesAWorldOfOne) {
  auto g = world();
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(world_size(), 1);
  EXPECT_EQ(world_rank(), 0);
  EXPECT_EQ(g->size(), 1);
  EXPECT_EQ(g->rank(), 0);
  EXPECT_EQ(g->name(), "world");
  EXPECT_EQ(g->world_ranks(), std::vector<int>{0});
  EXPECT_EQ(error_rank(), 0);
}

TEST(RuntimeSingle, AllReduceIsIdentityForEveryOp) {
  auto g = world();
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16, DType::Int64,
                   DType::Int32}) {
    for (ReduceOp op :
         {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + reduce_op_name(op));
      Tensor t = arange(-3, 9, 1, dt);
      g->all_reduce(t, op)->wait();
      EXPECT_EQ(values(t), values(arange(-3, 9, 1, dt)));
    }
  }
  Tensor flags = from_vector<bool>({true, false, true});
  g->all_reduce(flags, ReduceOp::Product)->wait();
  EXPECT_EQ(flags.to_vector<bool>(), (std::vector<bool>{true, false, true}));
}

TEST(RuntimeSingle, GathersScattersAndPointToPointAreCopies) {
  auto g = world();
  Tensor in = arange(0, 6, 1, DType::Float32);
  Tensor out = zeros({6}, DType::Float32);
  g->all_gather_into_tensor(out, in)->wait();
  EXPECT_EQ(values(out), values(in));

  std::vector<Tensor> outputs = {zeros({6}, DType::Float32)};
  g->all_gather(outputs, in)->wait();
  EXPECT_EQ(values(outputs[0]), values(in));

  Tensor rs = zeros({6}, DType::Float32);
  g->reduce_scatter_tensor(rs, in, ReduceOp::Sum)->wait();
  EXPECT_EQ(values(rs), values(in));
  Tensor rs2 = zeros({6}, DType::Float32);
  g->reduce_scatter(rs2, {in}, ReduceOp::Max)->wait();
  EXPECT_EQ(values(rs2), values(in));

  std::vector<Tensor> a2a_out = {zeros({6}, DType::Float32)};
  g->all_to_all(a2a_out, {in})->wait();
  EXPECT_EQ(values(a2a_out[0]), values(in));

  Tensor b = arange(0, 4, 1, DType::Int64);
  g->broadcast(b, 0)->wait();
  EXPECT_EQ(values(b), values(arange(0, 4, 1, DType::Int64)));

  Tensor sc = zeros({6}, DType::Float32);
  g->scatter(sc, {in}, 0)->wait();
  EXPECT_EQ(values(sc), values(in));

  Tensor got = zeros({6}, DType::Float32);
  WorkPtr r = g->recv(got, 0, 3);
  WorkPtr s = g->send(in, 0, 3);
  s->wait();
  r->wait();
  EXPECT_EQ(values(got), values(in));
  g->barrier()->wait();
}

TEST(RuntimeSingle, SplitOfOneRank) {
  auto g = world();
  auto sub = g->split(5, 0, "solo");
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  EXPECT_EQ(sub->name(), "solo");
  Tensor t = full({3}, 2.5, DType::Float64);
  sub->all_reduce(t, ReduceOp::Avg)->wait();
  EXPECT_EQ(values(t), std::vector<double>(3, 2.5));
  EXPECT_EQ(g->split(-1, 0, "nobody"), nullptr);
}

TEST(RuntimeSingle, SettingsAreValidated) {
  world();
  const double before = collective_timeout_seconds();
  set_collective_timeout_seconds(12.5);
  EXPECT_EQ(collective_timeout_seconds(), 12.5);
  EXPECT_THROW(set_collective_timeout_seconds(0), Error);
  EXPECT_THROW(set_collective_timeout_seconds(-3), Error);
  EXPECT_EQ(collective_timeout_seconds(), 12.5);
  set_collective_timeout_seconds(before);
  set_debug_collectives(true);
  EXPECT_TRUE(debug_collectives());
  // The debug check runs on a world of one too.
  Tensor t = ones({2}, DType::Float32);
  world_group()->all_reduce(t, ReduceOp::Sum)->wait();
  set_debug_collectives(false);
  EXPECT_FALSE(debug_collectives());
}

// Last: nothing can communicate after finalize, and MPI cannot start again.
TEST(RuntimeSingle, FinalizeIsIdempotentAndFinal) {
  auto g = world();
  finalize();
  finalize();
  EXPECT_FALSE(is_initialized());
  EXPECT_THROW(world_group(), Error);
  Tensor t = ones({2}, DType::Float32);
  EXPECT_THROW(g->all_reduce(t, ReduceOp::Sum), Error);
  EXPECT_THROW(init(), Error);
}
