// Every pair of placements on every mesh the world size allows (all pairs of S(0), S(1), R and
// P(sum) per mesh dim up to 2-D, a subset with nested shards on (2, 2, 2)), shapes that divide
// evenly, unevenly and leave shards empty. First two small cases that each check one plan
// without any collective after it, so they fail cleanly; last the pairs of the risky partition
// (see Partition in test_redistribute_sweep.h), after every other result is in.
#include <gtest/gtest.h>

#include <tuple>

#include "tessera/tessera.h"
#include "test_redistribute_reference.h"
#include "test_redistribute_sweep.h"

using namespace tessera;
using namespace tessera::test_ref;

namespace {

// A (2, n / 2) mesh for the 2-D cases that must run at 4 and 8 ranks.
DeviceMesh two_dim_mesh() {
  return DeviceMesh({2, world_size() / 2}, {"dp", "tp"});
}

// Redistributes the distributed `global` and compares this rank's piece with the reference,
// with no collective afterwards: a rank that throws cannot leave the others waiting.
std::string single_step_problem(const DeviceMesh& mesh, const Tensor& global, const Placements& src,
                                const Placements& dst) {
  const std::vector<int64_t> coord = mesh_coordinate(world_rank(), mesh.shape());
  DTensor x = distribute_tensor(global, mesh, src);
  std::string problem;
  const std::string error = error_of([&] {
    DTensor y = x.redistribute(dst);
    problem = tensor_mismatch(
        y.to_local(),
        cut_window(global, reference_window(global.shape(), mesh.shape(), coord, dst)));
  });
  return error.empty() ? problem : error;
}

}  // namespace

// Rank (i, j) must end with block j of block i of the columns. Mesh dim 0 turning S(0) into an
// outer S(1) cannot be one all-to-all over mesh dim 0: the columns rank (i, j) needs sit on
// ranks with other j.
TEST(RedistributeTargeted, ShardToOuterShardOfADimAnInnerShardAlreadyCuts) {
  if (world_size() != 4 && world_size() != 8) GTEST_SKIP() << "needs 4 or 8 ranks";
  DeviceMesh mesh = two_dim_mesh();
  // Every level divides evenly, so the pieces have the right shapes either way.
  const Tensor global = dyadic_tensor({8, 16}, 11);
  EXPECT_EQ(single_step_problem(mesh, global, {Shard(0), Shard(1)}, {Shard(1), Shard(1)}), "")
      << mesh.str() << " [S(0), S(1)] -> [S(1), S(1)] at "
      << coordinate_str(mesh_coordinate(world_rank(), mesh.shape()));
}

// Gathering even column pieces on a rank whose piece has no rows.
TEST(RedistributeTargeted, GatherColumnsOfAnEmptyRowShard) {
  if (world_size() != 4 && world_size() != 8) GTEST_SKIP() << "needs 4 or 8 ranks";
  DeviceMesh mesh = two_dim_mesh();
  // One row over dp = 2: rank row 1 holds none; the columns split evenly over tp.
  const Tensor global = dyadic_tensor({1, 2 * mesh.size(1)}, 12);
  EXPECT_EQ(single_step_problem(mesh, global, {Shard(0), Shard(1)}, {Shard(0), Replicate()}), "")
      << mesh.str() << " [S(0), S(1)] -> [S(0), R] at "
      << coordinate_str(mesh_coordinate(world_rank(), mesh.shape()));
}

// Pieces above a MiB travel as several all-to-alls of row ranges of the source dim; uneven
// shapes so that the ranges differ between ranks, and a source dim other than 0.
TEST(RedistributeTargeted, ShardToShardOfLargePiecesInRowRanges) {
  if (world_size() < 2 || world_size() > 4) GTEST_SKIP() << "needs 2 to 4 ranks";
  DeviceMesh mesh({world_size()}, {"x"});
  const Tensor matrix = dyadic_tensor({2101, 1299}, 13);
  const Tensor cube = dyadic_tensor({3, 701, 650}, 14);
  for (const auto& [global, src, dst] :
       {std::tuple{matrix, Shard(0), Shard(1)}, std::tuple{matrix, Shard(1), Shard(0)},
        std::tuple{cube, Shard(2), Shard(1)}}) {
    EXPECT_EQ(single_step_problem(mesh, global, {src}, {dst}), "")
        << shape_str(global.shape()) << " " << src.str() << " -> " << dst.str();
  }
}

TEST(RedistributePairs, OneDimMeshAllPairs) {
  DeviceMesh mesh({world_size()}, {"x"});
  auto lists = placement_lists({world_size()}, 2);
  run_pairs(mesh, lists, lists, kShapes);
}

namespace {

std::vector<Placements> three_dim_lists() {
  const Placement S0 = Shard(0), S1 = Shard(1), R = Replicate(), P = Partial();
  // Nested shards of one dim (two and three levels), mixed dims, and partials next to shards.
  return {
      {R, R, R},   {S0, S0, R}, {S0, S1, S0}, {S0, S0, S0}, {S1, R, S1},
      {R, S0, S0}, {P, S0, R},  {S1, P, P},   {P, P, P},    {R, P, S1},
  };
}

// The meshes of the 2-D and 3-D sweeps for this world size, with their placement lists.
struct Sweep {
  DeviceMesh mesh;
  std::vector<Placements> lists;
};

std::vector<Sweep> sweeps() {
  std::vector<Sweep> out;
  for (const DeviceMesh& mesh : device_meshes()) {
    if (mesh.ndim() == 2) out.push_back({mesh, placement_lists(mesh.shape(), 2)});
    if (mesh.ndim() == 3) out.push_back({mesh, three_dim_lists()});
  }
  return out;
}

}  // namespace

TEST(RedistributePairs, MultiDimMeshesAllPairs) {
  if (world_size() != 4 && world_size() != 8) GTEST_SKIP() << "needs 4 or 8 ranks";
  for (const Sweep& s : sweeps())
    run_pairs(s.mesh, s.lists, s.lists, kShapes, Partition::plain());
}

// ---- last: the risky partition ----

namespace {

// A rank left waiting by a failure in these pairs ends the job after this timeout rather than the
// main's two minutes; ample for these small tensors even on a crowded machine.
constexpr double kRiskyTimeoutSeconds = 30;

}  // namespace

TEST(RedistributePairsRisky, MultiDimMeshesAllPairs) {
  if (world_size() != 4 && world_size() != 8) GTEST_SKIP() << "needs 4 or 8 ranks";
  set_collective_timeout_seconds(kRiskyTimeoutSeconds);
  for (const Sweep& s : sweeps())
    run_pairs(s.mesh, s.lists, s.lists, kShapes, Partition::risky());
}

TEST(RedistributePairsRisky, Strided) {
  if (world_size() != 4 && world_size() != 8) GTEST_SKIP() << "needs 4 or 8 ranks";
  set_collective_timeout_seconds(kRiskyTimeoutSeconds);
  for (const DeviceMesh& mesh : device_meshes())
    if (mesh.ndim() == 2)
      run_pairs(mesh, strided_lists(mesh), strided_lists(mesh), kShapes, Partition::risky());
}

// Tensors large enough that the plan search (plan_redistribute) replaces some ordered plans by
// cheaper ones: every pair of the 2-D and strided lists, checked like the small ones.
TEST(RedistributePairsRisky, LargeShapesWithSearchedPlans) {
  if (world_size() != 4 && world_size() != 8) GTEST_SKIP() << "needs 4 or 8 ranks";
  set_collective_timeout_seconds(kRiskyTimeoutSeconds);
  for (const DeviceMesh& mesh : device_meshes()) {
    if (mesh.ndim() != 2) continue;
    std::vector<Placements> lists = placement_lists(mesh.shape(), 2);
    for (const Placements& p : strided_lists(mesh))
      if (p[0].is_strided_shard()) lists.push_back(p);
    run_pairs(mesh, lists, lists, {{192, 352}}, Partition::all());
  }
}
