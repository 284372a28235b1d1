// StridedShard, the layout FSDP makes of a dim tensor parallelism already split: rank (i, j) of
// a (dp, tp) mesh under [StridedShard(0, tp), Shard(0)] holds chunk i of chunk j of dim 0, and
// redistributing to and from the plain layouts keeps the logical order.
#include <gtest/gtest.h>

#include "tessera/tessera.h"
#include "test_redistribute_reference.h"
#include "test_redistribute_sweep.h"

using namespace tessera;
using namespace tessera::test_ref;

TEST(RedistributeStrided, TwoByTwo) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  run_pairs(mesh, strided_lists(mesh), strided_lists(mesh), kShapes, Partition::plain());
}

TEST(RedistributeStrided, TwoByFourAndFourByTwo) {
  if (world_size() != 8) GTEST_SKIP() << "needs 8 ranks";
  for (const Shape& shape : {Shape{2, 4}, Shape{4, 2}}) {
    DeviceMesh mesh(shape, {"dp", "tp"});
    run_pairs(mesh, strided_lists(mesh), strided_lists(mesh), kShapes, Partition::plain());
  }
}

// The reference itself, against rows worked out by hand: rank (i, j) holds chunk i of chunk j.
TEST(RedistributeStrided, HandWorkedRowsOnTwoByTwo) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  const Placements fsdp_tp = {StridedShard(0, 2), Shard(0)};
  const std::vector<int64_t> c = mesh_coordinate(world_rank(), mesh.shape());
  const int64_t i = c[0], j = c[1];
  // 8 rows: tp cuts 4 + 4, dp cuts each into 2 + 2.
  std::vector<double> even = {double(4 * j + 2 * i), double(4 * j + 2 * i + 1)};
  // 7 rows: tp cuts 4 + 3, dp cuts 4 into 2 + 2 and 3 into 2 + 1.
  const std::vector<std::vector<std::vector<double>>> uneven = {{{0, 1}, {4, 5}}, {{2, 3}, {6}}};
  for (int64_t n : {8, 7}) {
    Tensor global = arange(0, double(n), 1, DType::Float64);
    const std::vector<double>& want = n == 8 ? even : uneven[size_t(i)][size_t(j)];
    EXPECT_EQ(reference_window({n}, mesh.shape(), c, fsdp_tp).offset[0], int64_t(want[0]));
    DTensor d = distribute_tensor(global, mesh, fsdp_tp);
    EXPECT_EQ(d.to_local().to_vector<double>(), want) << "n = " << n;
    EXPECT_EQ(d.full_tensor().to_vector<double>(), global.to_vector<double>());
    DTensor back = d.redistribute({Shard(0), Replicate()});
    EXPECT_EQ(back.to_local().to_vector<double>(),
              cut_window(global, reference_window({n}, mesh.shape(), c, {Shard(0), Replicate()}))
                  .to_vector<double>());
  }
}
