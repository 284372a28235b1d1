// Misuse of the DTensor API fails on every rank with a message that says what was wrong, and
// never leaves a rank waiting in a collective. The cases that could hang run in a child job of
// four ranks with a short collective timeout, so a hang fails one test instead of the whole job.
// Also: the text of visualize_sharding.
#include <gtest/gtest.h>

#include <cmath>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include "child_job.h"
#include "tessera/tessera.h"
#include "test_redistribute_reference.h"

using namespace tessera;
using namespace tessera::test_ref;

namespace {

DeviceMesh line_mesh() {
  return DeviceMesh({world_size()}, {"x"});
}

}  // namespace

TEST(DTensorMisuse, LocalShardPassedAsTheGlobalTensor) {
  DeviceMesh mesh = line_mesh();
  const Shape shape = {2 * world_size() + 1, 5};  // uneven: the last rank's piece is shorter
  const Tensor global = dyadic_tensor(shape, 1);
  Tensor piece =
      cut_window(global, reference_window(shape, mesh.shape(),
                                          mesh_coordinate(world_rank(), mesh.shape()), {Shard(0)}));
  // From the first rank (the default): the last rank's shorter piece is not the source's shape.
  const std::string from_first = error_of([&] { distribute_tensor(piece, mesh, {Shard(0)}); });
  TESSERA_EXPECT_CONTAINS(from_first, "passed Tensor[");
  TESSERA_EXPECT_CONTAINS(from_first, "the source rank 0 holds float64 [3, 5]");
  // Each rank its own: the pieces' shapes differ between ranks.
  const std::string msg = error_of([&] { distribute_tensor(piece, mesh, {Shard(0)}, kEveryRank); });
  TESSERA_EXPECT_CONTAINS(msg, "differ in global tensor");
  TESSERA_EXPECT_CONTAINS(msg, shape_str(piece.shape()));
  TESSERA_EXPECT_CONTAINS(msg, "every rank must pass the same global tensor");

  DTensor d = distribute_tensor(global, mesh, {Shard(0)});
  const std::string copy = error_of([&] { d.copy_from_full(d.to_local()); });
  TESSERA_EXPECT_CONTAINS(copy, "copy_from_full");
  TESSERA_EXPECT_CONTAINS(copy, shape_str(d.to_local().shape()));
  TESSERA_EXPECT_CONTAINS(copy, shape_str(shape));
}

// run_check compares replicas bit for bit: equal NaNs pass, integers that differ beyond 2^53 (equal
// as doubles) do not.
TEST(DTensorMisuse, RunCheckComparesReplicasBitForBit) {
  DeviceMesh mesh = line_mesh();
  const Tensor nan = from_vector<float>({1.0f, std::nanf(""), 3.0f});
  EXPECT_EQ(error_of([&] { DTensor::from_local(nan, mesh, {Replicate()}, std::nullopt, true); }),
            "");
  const int64_t big = int64_t(1) << 60;
  const Tensor ids = from_vector<int64_t>({big + (world_rank() == 1 ? 1 : 0)});
  const std::string msg =
      error_of([&] { DTensor::from_local(ids, mesh, {Replicate()}, std::nullopt, true); });
  TESSERA_EXPECT_CONTAINS(msg, "values differ across ranks");
}

TEST(DTensorMisuse, MeshLargerThanTheWorld) {
  const int n = world_size();
  const std::string msg = error_of([&] { DeviceMesh({n, 2}, {"dp", "tp"}); });
  TESSERA_EXPECT_CONTAINS(msg, shape_str({n, 2}));
  TESSERA_EXPECT_CONTAINS(
      msg, "has " + std::to_string(2 * n) + " ranks but the world has " + std::to_string(n));
  // Nothing was split: the world still works.
  Tensor t = ones({1}, DType::Float64);
  world_group()->all_reduce(t, ReduceOp::Sum)->wait();
  EXPECT_EQ(t.item<double>(), double(n));
}

TEST(DTensorMisuse, ShardDimOutOfRange) {
  DeviceMesh mesh = line_mesh();
  const Tensor global = dyadic_tensor({4, 6}, 2);
  std::string msg = error_of([&] { distribute_tensor(global, mesh, {Shard(5)}); });
  TESSERA_EXPECT_CONTAINS(msg, "S(5)");
  TESSERA_EXPECT_CONTAINS(msg, "[4, 6]");
  DTensor d = distribute_tensor(global, mesh, {Replicate()});
  msg = error_of([&] { d.redistribute({Shard(5)}); });
  TESSERA_EXPECT_CONTAINS(msg, "S(5)");
  msg = error_of([&] { DTensor::from_local(global, mesh, {Shard(-3)}); });
  TESSERA_EXPECT_CONTAINS(msg, "-3");
  // A negative dim that is in range means the same as its positive form.
  EXPECT_EQ(distribute_tensor(global, mesh, {Shard(-1)}).placements(), (Placements{Shard(1)}));
}

// With kEveryRank each rank cuts its window from its own tensor: a local shard passed as the
// global one (of a tensor that splits evenly, so the shapes agree) differs between the ranks,
// and so do replicas that drifted apart; both are refused on every rank.
TEST(DTensorMisuse, EveryRankSourcesWithDifferentValuesAreRefused) {
  if (world_size() == 1) GTEST_SKIP() << "needs several ranks";
  DeviceMesh mesh = line_mesh();
  const Tensor global = dyadic_tensor({2 * world_size(), 3}, 4);
  const Tensor piece = distribute_tensor(global, mesh, {Shard(0)}).to_local();
  TESSERA_EXPECT_CONTAINS(error_of([&] { distribute_tensor(piece, mesh, {Shard(0)}, kEveryRank); }),
                          "differ in global tensor values");
  Tensor drifted = global.clone();
  if (world_rank() == world_size() - 1) drifted.data<double>()[5] += 1e-9;
  TESSERA_EXPECT_CONTAINS(
      error_of([&] { distribute_tensor(drifted, mesh, {Replicate()}, kEveryRank); }),
      "differ in global tensor values");
  // The same values everywhere: accepted.
  EXPECT_EQ(distribute_tensor(global, mesh, {Shard(0)}, kEveryRank).full_tensor().shape(),
            global.shape());
}

// A product partial cannot hold one value on one coordinate: refused, not squared.
TEST(DTensorMisuse, PartialProductIsRefused) {
  DeviceMesh mesh = line_mesh();
  const Tensor global = dyadic_tensor({4, 6}, 2);
  for (const auto& f : std::vector<std::function<void()>>{
           [&] { distribute_tensor(global, mesh, {Partial(ReduceOp::Product)}); },
           [&] { DTensor::from_local(global, mesh, {Partial(ReduceOp::Product)}); },
           [&] {
             distribute_tensor(global, mesh, {Replicate()})
                 .redistribute({Partial(ReduceOp::Product)});
           }})
    TESSERA_EXPECT_CONTAINS(error_of(f), "Partial(product) is not supported");
}

TEST(DTensorMisuse, PlacementCountDiffersFromMeshDims) {
  DeviceMesh mesh = line_mesh();
  const Tensor global = dyadic_tensor({4, 6}, 3);
  std::string msg = error_of([&] { distribute_tensor(global, mesh, {Shard(0), Replicate()}); });
  TESSERA_EXPECT_CONTAINS(msg, "[S(0), R]");
  TESSERA_EXPECT_CONTAINS(msg, "2 entries");
  TESSERA_EXPECT_CONTAINS(msg, mesh.str());
  DTensor d = distribute_tensor(global, mesh, {Shard(0)});
  msg = error_of([&] { d.redistribute({}); });
  TESSERA_EXPECT_CONTAINS(msg, "0 entries");
  msg = error_of([&] { DTensor::from_local(global, mesh, {Replicate(), Replicate()}); });
  TESSERA_EXPECT_CONTAINS(msg, "2 entries");
}

TEST(DTensorMisuse, LocalShapeInconsistentWithGlobalShape) {
  DeviceMesh mesh = line_mesh();
  // 7 rows over 2 or 4 ranks: no rank's piece has 5 rows.
  const Tensor local = zeros({5, 3}, DType::Float64);
  const std::string msg = error_of([&] {
    DTensor::from_local(local, mesh, {Shard(0)}, Shape{7, 3});
  });
  TESSERA_EXPECT_CONTAINS(msg, "from_local");
  TESSERA_EXPECT_CONTAINS(msg, "[5, 3]");
  TESSERA_EXPECT_CONTAINS(msg, "[7, 3]");
  const Window w = reference_window({7, 3}, mesh.shape(),
                                    mesh_coordinate(world_rank(), mesh.shape()), {Shard(0)});
  TESSERA_EXPECT_CONTAINS(msg, shape_str(w.shape));
}

TEST(DTensorMisuse, UnknownSubMeshName) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  std::string msg = error_of([&] { mesh["pp"]; });
  TESSERA_EXPECT_CONTAINS(msg, "'pp'");
  TESSERA_EXPECT_CONTAINS(msg, "dp, tp");
  msg = error_of([&] { mesh.group("pp"); });
  TESSERA_EXPECT_CONTAINS(msg, "'pp'");
  msg = error_of([&] { mesh[std::vector<std::string>{"tp", "dp"}]; });
  TESSERA_EXPECT_CONTAINS(msg, "in mesh order");
  EXPECT_EQ(mesh["tp"].size(), 2);
}

// ---- visualize_sharding ----

namespace {

// The line of `table` that starts with `prefix`, or "".
std::string line_starting(const std::string& table, const std::string& prefix) {
  size_t pos = 0;
  while (pos < table.size()) {
    size_t end = table.find('\n', pos);
    if (end == std::string::npos) end = table.size();
    std::string line = table.substr(pos, end - pos);
    if (line.rfind(prefix, 0) == 0) return line;
    pos = end + 1;
  }
  return "";
}

std::string block_str(const Window& w) {
  std::string s = "[";
  for (size_t d = 0; d < w.shape.size(); ++d)
    s += (d ? ", " : "") + std::to_string(w.offset[d]) + ":" +
         std::to_string(w.offset[d] + w.shape[d]);
  return s + "]";
}

void check_table(const DTensor& d, const std::string& partial_note) {
  const std::string table = visualize_sharding(d);
  const DeviceMesh& mesh = d.mesh();
  TESSERA_EXPECT_CONTAINS(table, shape_str(d.shape()));
  TESSERA_EXPECT_CONTAINS(table, placements_str(d.placements()));
  for (int r = 0; r < world_size(); ++r) {
    const std::vector<int64_t> c = mesh_coordinate(r, mesh.shape());
    const std::string line = line_starting(table, coordinate_str(c));
    ASSERT_FALSE(line.empty()) << "no row for " << coordinate_str(c) << " in\n" << table;
    const Window w = reference_window(d.shape(), mesh.shape(), c, d.placements());
    // Built piecewise: GCC 12 warns (-Wrestrict) on " " + std::to_string(r).
    std::string rank_cell = " ";
    rank_cell += std::to_string(r);
    rank_cell += " ";
    TESSERA_EXPECT_CONTAINS(line, rank_cell);
    TESSERA_EXPECT_CONTAINS(line, block_str(w));
    const bool empty = shape_numel(w.shape) == 0;
    EXPECT_EQ(line.find("empty") != std::string::npos, empty) << line;
    if (!partial_note.empty()) {
      TESSERA_EXPECT_CONTAINS(line, partial_note);
    }
  }
}

}  // namespace

TEST(VisualizeSharding, NamesEachCoordinatesBlockAndEmptyShards) {
  DeviceMesh mesh = line_mesh();
  // One row more than half the ranks: the last ranks hold nothing.
  const Shape shape = {world_size() / 2 + 1, 4};
  check_table(distribute_tensor(dyadic_tensor(shape, 4), mesh, {Shard(0)}), "");
  check_table(distribute_tensor(dyadic_tensor(shape, 4), mesh, {Shard(1)}), "");
  if (world_size() == 4) {
    DeviceMesh two({2, 2}, {"dp", "tp"});
    check_table(distribute_tensor(dyadic_tensor({3, 5}, 5), two, {Shard(0), Shard(0)}), "");
    check_table(distribute_tensor(dyadic_tensor({3, 5}, 5), two, {Shard(1), Partial()}),
                "partial(tp)");
  }
}

// ---- cases that hang when one rank fails before a collective the others enter ----

namespace {

using test::ChildResult;

// Runs this binary's `MisuseChild.DISABLED_<name>` on four ranks with a 5 s collective timeout.
ChildResult run_child(const std::string& name) {
  std::array<char, 4096> self{};
  const ssize_t len = readlink("/proc/self/exe", self.data(), self.size() - 1);
  if (len <= 0) {
    ChildResult result;
    result.output = "cannot find this executable";
    return result;
  }
  return test::run_child_job(4,
                             test::shell_quoted(std::string(self.data(), size_t(len))) +
                                 " --gtest_also_run_disabled_tests --gtest_color=no"
                                 " --gtest_filter=MisuseChild.DISABLED_" +
                                 name,
                             "OMP_NUM_THREADS=1 TESSERA_COLLECTIVE_TIMEOUT=5", 120);
}

// Only rank 0 of the two-rank job starts the child (fewer idle ranks competing with it for the
// cores); the others wait at the barrier.
class NeverHangs : public ::testing::Test {
 protected:
  void SetUp() override {
    if (world_size() != 2) GTEST_SKIP() << "the four-rank child job is started from the 2-rank run";
  }
  void TearDown() override { world_group()->barrier()->wait(); }
  void expect_child_passes(const std::string& name) {
    if (world_rank() != 0) return;
    ChildResult r = run_child(name);
    const bool passed = r.exit_code == 0 &&
                        r.output.find("collective timeout") == std::string::npos &&
                        r.output.find("[  PASSED  ] 1 test") != std::string::npos;
    EXPECT_TRUE(passed) << "child job exit code " << r.exit_code << " after " << r.seconds
                        << " s:\n"
                        << r.output;
  }
};

// The pieces of [3, 2] under [S(0), S(0)] on (2, 2): rows 1, 1, 1, 0. The mesh-dim-0 groups of
// column 0 agree on the shape, those of column 1 do not.
Tensor nested_piece() {
  const Window w =
      reference_window({3, 2}, {2, 2}, mesh_coordinate(world_rank(), {2, 2}), {Shard(0), Shard(0)});
  return cut_window(dyadic_tensor({3, 2}, 6), w);
}

}  // namespace

TEST(MisuseChild, DISABLED_DistributeNestedLocalPieces) {
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  Tensor piece = nested_piece();
  const std::string msg = error_of([&] {
    distribute_tensor(piece, mesh, {Shard(0), Shard(0)}, kEveryRank);
  });
  TESSERA_EXPECT_CONTAINS(msg, "differ in global tensor");
}

// The control: pieces that differ along mesh dim 0 in every column fail on every rank at once.
TEST(MisuseChild, DISABLED_DistributeLocalPiecesDifferingInEveryColumn) {
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  const Window w = reference_window({3, 2}, {2, 2}, mesh_coordinate(world_rank(), {2, 2}),
                                    {Shard(0), Replicate()});
  Tensor piece = cut_window(dyadic_tensor({3, 2}, 6), w);
  const std::string msg = error_of([&] {
    distribute_tensor(piece, mesh, {Shard(0), Replicate()}, kEveryRank);
  });
  TESSERA_EXPECT_CONTAINS(msg, "differ in global tensor");
}

TEST(MisuseChild, DISABLED_RunCheckOneReplicaDiffers) {
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  Tensor local = dyadic_tensor({2, 3}, 7);
  if (world_rank() == 3) local.data<double>()[0] += 1;
  const std::string msg = error_of([&] {
    DTensor::from_local(local, mesh, {Replicate(), Replicate()}, std::nullopt, true);
  });
  TESSERA_EXPECT_CONTAINS(msg, "values differ across ranks");
}

TEST(MisuseChild, DISABLED_RunCheckOneRankHasTheWrongPiece) {
  DeviceMesh mesh({4}, {"x"});
  // [7, 3] over 4 ranks: pieces of 2, 2, 2, 1 rows; the last rank passes 2.
  Tensor local = zeros({2, 3}, DType::Float64);
  const std::string msg = error_of([&] {
    DTensor::from_local(local, mesh, {Shard(0)}, Shape{7, 3}, /*run_check=*/true);
  });
  EXPECT_FALSE(msg.empty()) << "every rank must learn that the DTensor is inconsistent";
  if (world_rank() == 3) {
    TESSERA_EXPECT_CONTAINS(msg, "[2, 3]");
  }
}

// ---- inputs that differ across ranks: every rank throws before any data moves ----

namespace {

// Every rank's message must carry every needle; afterwards the world still works (no rank was
// left inside a collective).
void expect_everywhere(const std::string& msg, const std::vector<std::string>& needles) {
  EXPECT_FALSE(msg.empty()) << "rank " << world_rank() << " did not throw";
  for (const std::string& n : needles) {
    TESSERA_EXPECT_CONTAINS(msg, n);
  }
  Tensor t = ones({1}, DType::Float64);
  world_group()->all_reduce(t, ReduceOp::Sum)->wait();
  EXPECT_EQ(t.item<double>(), double(world_size()));
}

}  // namespace

TEST(MisuseChild, DISABLED_RunCheckInputsDiffer) {
  DeviceMesh line({4}, {"x"}), square({2, 2}, {"dp", "tp"});
  const bool odd = world_rank() == 1;
  // One rank passes float64, the others float32: a later full_tensor() would mix them.
  Tensor piece = zeros({2, 3}, odd ? DType::Float64 : DType::Float32);
  expect_everywhere(
      error_of([&] { DTensor::from_local(piece, line, {Shard(0)}, std::nullopt, true); }),
      {"from_local(run_check)", "ranks 0 and 1 differ in dtype", "float64", "float32"});
  // Placements that differ.
  Tensor same = zeros({2, 3}, DType::Float32);
  expect_everywhere(
      error_of([&] {
        DTensor::from_local(same, line, {odd ? Shard(1) : Shard(0)}, Shape{8, 3}, true);
      }),
      {"differ in placements", "[S(1)]", "[S(0)]"});
  // Meshes that differ (both span the world).
  expect_everywhere(error_of([&] {
                      if (odd)
                        DTensor::from_local(same, square, {Shard(0), Shard(0)}, Shape{8, 3}, true);
                      else
                        DTensor::from_local(same, line, {Shard(0)}, Shape{8, 3}, true);
                    }),
                    {"differ in mesh", "DeviceMesh(dp=2, tp=2)", "DeviceMesh(x=4)"});
  // The control: consistent inputs pass.
  EXPECT_EQ(error_of([&] { DTensor::from_local(same, line, {Shard(0)}, Shape{8, 3}, true); }), "");
}

TEST(MisuseChild, DISABLED_DistributePlacementsOrMeshDiffer) {
  DeviceMesh line({4}, {"x"}), square({2, 2}, {"dp", "tp"});
  const bool odd = world_rank() == 2;
  const Tensor global = dyadic_tensor({8, 4}, 8);
  for (int src : {-1, 0}) {
    SCOPED_TRACE("src_rank " + std::to_string(src));
    expect_everywhere(
        error_of([&] { distribute_tensor(global, line, {odd ? Replicate() : Shard(0)}, src); }),
        {"distribute_tensor", "ranks 0 and 2 differ in placements", "[R]", "[S(0)]"});
    expect_everywhere(error_of([&] {
                        if (odd)
                          distribute_tensor(global, square, {Shard(0), Shard(1)}, src);
                        else
                          distribute_tensor(global, line, {Shard(0)}, src);
                      }),
                      {"differ in mesh", "DeviceMesh(dp=2, tp=2)", "DeviceMesh(x=4)"});
  }
  // src_rank differing between ranks.
  expect_everywhere(error_of([&] { distribute_tensor(global, line, {Shard(0)}, odd ? 1 : 0); }),
                    {"differ in src_rank"});
}

TEST(MisuseChild, DISABLED_DistributeFromSourceMisuse) {
  DeviceMesh line({4}, {"x"});
  const Tensor global = dyadic_tensor({8, 4}, 9);
  // The source passes nothing: every rank hears it, none waits for the header.
  expect_everywhere(error_of([&] {
                      distribute_tensor(world_rank() == 0 ? Tensor() : global, line, {Shard(0)}, 0);
                    }),
                    {"[rank 0]", "the source rank passed an undefined tensor"});
  // Rank 3 passes a tensor of another shape: the source throws too.
  expect_everywhere(error_of([&] {
                      distribute_tensor(world_rank() == 3 ? dyadic_tensor({2, 4}, 9) : global, line,
                                        {Shard(0)}, 0);
                    }),
                    {"[rank 3] passed", "[2, 4]", "the source rank 0 holds float64 [8, 4]"});
  // A src_rank that is neither a constant nor a rank of the mesh, on every rank or on one.
  expect_everywhere(error_of([&] { distribute_tensor(global, line, {Shard(0)}, -5); }),
                    {"src_rank -5 is neither kMeshFirstRank", "DeviceMesh(x=4)"});
  expect_everywhere(
      error_of([&] { distribute_tensor(global, line, {Shard(0)}, world_rank() == 1 ? -5 : 0); }),
      {"[rank 1]", "src_rank -5 is neither kMeshFirstRank", "differ in src_rank"});
  expect_everywhere(error_of([&] { distribute_tensor(global, line, {Shard(0)}, 4); }),
                    {"src_rank 4 is neither kMeshFirstRank"});
  // The control: undefined tensors off the source are fine.
  DTensor d = distribute_tensor(world_rank() == 0 ? global : Tensor(), line, {Shard(0)}, 0);
  EXPECT_EQ(tensor_mismatch(d.full_tensor(), global), "");
}

TEST_F(NeverHangs, RunCheckWithDifferentDtypesPlacementsOrMeshes) {
  expect_child_passes("RunCheckInputsDiffer");
}

TEST_F(NeverHangs, DistributeTensorWithDifferentPlacementsMeshesOrSources) {
  expect_child_passes("DistributePlacementsOrMeshDiffer");
}

TEST_F(NeverHangs, DistributeTensorFromAMisusedSource) {
  expect_child_passes("DistributeFromSourceMisuse");
}

TEST_F(NeverHangs, ControlDistributeTensorFailingAtTheFirstMeshDim) {
  expect_child_passes("DistributeLocalPiecesDifferingInEveryColumn");
}

TEST_F(NeverHangs, DistributeTensorWithNestedLocalPieces) {
  expect_child_passes("DistributeNestedLocalPieces");
}

TEST_F(NeverHangs, RunCheckWithOneDifferentReplicaOnATwoDimMesh) {
  expect_child_passes("RunCheckOneReplicaDiffers");
}

TEST_F(NeverHangs, RunCheckWithOneRankHoldingTheWrongPiece) {
  expect_child_passes("RunCheckOneRankHasTheWrongPiece");
}
