// The plan cache: one plan per (mesh shape, global shape, placements), reused, and bounded so a
// program whose shapes keep changing does not grow it forever.
#include <gtest/gtest.h>

#include "tessera/tessera.h"

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

}  // namespace
