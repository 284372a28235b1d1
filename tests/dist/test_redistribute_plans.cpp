// The plan cache: one plan per (mesh shape, global shape, placements), reused, and bounded so a
// program whose shapes keep changing does not grow it forever. The plan search: where the ordered
// planner would route a large tensor through Replicate, a cheaper sequence of steps is taken.
#include <gtest/gtest.h>

#include "tessera/tessera.h"
#include "tessera/testing.h"

using namespace tessera;

namespace {

DTensorSpec rows_spec(const DeviceMesh& mesh, int64_t rows) {
  return DTensorSpec(mesh, {Shard(0)}, Shape{rows, 4}, DType::Float32);
}

TEST(RedistributePlanCache, ReusesAPlanAndForgetsTheLeastRecentlyUsed) {
  DeviceMesh mesh(Shape{world_size()}, {"x"});
  const Placements to = {Replicate()};
  const auto first = plan_redistribute(rows_spec(mesh, 1), to);
  EXPECT_EQ(plan_redistribute(rows_spec(mesh, 1), to), first) << "the same key made a new plan";
  // Twice the capacity of other shapes, as a run with ever new sequence lengths would ask for.
  constexpr int64_t kShapes = 2 * 4096;
  std::shared_ptr<const RedistributePlan> recent;
  for (int64_t rows = 2; rows < 2 + kShapes; ++rows)
    recent = plan_redistribute(rows_spec(mesh, rows), to);
  EXPECT_LE(redistribute_plan_cache_size(), size_t(4096));
  EXPECT_EQ(plan_redistribute(rows_spec(mesh, 1 + kShapes), to), recent);
  // The first plan was dropped; asked for again it is made anew, the same steps.
  const auto again = plan_redistribute(rows_spec(mesh, 1), to);
  EXPECT_NE(again, first);
  EXPECT_EQ(again->str(), first->str());
}

// clear_redistribute_plan_cache empties the cache; plans handed out before stay usable, and the
// plans made again have the same steps and move the same values.
TEST(RedistributePlanCache, ClearEmptiesItAndPlansAreMadeAgain) {
  DeviceMesh mesh(Shape{world_size()}, {"x"});
  const Tensor global = tessera::testing::random_tensor({5, 3}, 7, DType::Float32);  // uneven
  const DTensor rows = distribute_tensor(global, mesh, {Shard(0)});
  const DTensor before = rows.redistribute({Shard(1)});
  const auto kept = plan_redistribute(rows.spec(), {Shard(1)});
  ASSERT_GT(redistribute_plan_cache_size(), size_t(0));
  clear_redistribute_plan_cache();
  EXPECT_EQ(redistribute_plan_cache_size(), size_t(0));
  EXPECT_FALSE(kept->str().empty());
  const auto again = plan_redistribute(rows.spec(), {Shard(1)});
  EXPECT_NE(again, kept) << "the cleared plan was handed out again";
  EXPECT_EQ(again->str(), kept->str());
  EXPECT_EQ(redistribute_plan_cache_size(), size_t(1));
  const DTensor after = rows.redistribute({Shard(1)});
  tessera::testing::expect_close(after.to_local(), before.to_local(), 0, "S(0) -> S(1)");
  tessera::testing::expect_close(after.full_tensor(), global, 0, "full tensor");
}

// On a (2, 2) mesh, 1 MiB of float32: FSDP x TP's layout of a row-parallel weight, [SS(1, 2),
// S(1)], into data-parallel rows [S(0), R] gathers each half once (dp, then tp after re-cutting
// rows), 1/2 MiB per rank, where undoing both shards first gathers the whole tensor (3/4 MiB).
// Fully sharded rows to rows over tp only, [S(0), S(0)] -> [R, S(0)], likewise saves a quarter.
TEST(RedistributePlanSearch, LargeTensorsAvoidGatheringEverything) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  const int64_t bytes = 512 * 512 * 4;
  auto plan = [&](const Placements& from, const Placements& to) {
    return plan_redistribute(DTensorSpec(mesh, from, Shape{512, 512}, DType::Float32), to);
  };
  const auto strided = plan({StridedShard(1, 2), Shard(1)}, {Shard(0), Replicate()});
  EXPECT_EQ(strided->bytes_moved, bytes / 2) << strided->str();
  for (const RedistributeStep& s : strided->steps)
    EXPECT_NE(s.after, (Placements{Replicate(), Replicate()})) << strided->str();
  const auto rows = plan({Shard(0), Shard(0)}, {Replicate(), Shard(0)});
  EXPECT_LT(rows->bytes_moved, 3 * bytes / 4) << rows->str();
  // Small tensors keep the ordered plan where the cheaper one takes another collective: a
  // collective's fixed cost outweighs the bytes saved.
  const auto small =
      plan_redistribute(DTensorSpec(mesh, {Shard(0), Shard(0)}, Shape{8, 8}, DType::Float32),
                        {Replicate(), Shard(0)});
  ASSERT_FALSE(small->steps.empty());
  EXPECT_STREQ(small->steps[0].transition->name(), "shard_to_replicate") << small->str();
  EXPECT_STREQ(rows->steps[0].transition->name(), "shard_to_shard") << rows->str();
}

}  // namespace
