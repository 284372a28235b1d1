// The checkpoint plan's check that the ranks' windows of a tensor tile it (checkpoint/src/plan.h),
// at counts of windows no mpirun here reaches.
#include <gtest/gtest.h>

#include <vector>

#include "plan.h"
#include "tessera/testing/expect_error.h"

namespace tessera {
namespace {

using testing::expect_error;

// Rank r holds row r of a [n, 2] tensor.
std::vector<ckpt::Window> rows(int64_t n) {
  std::vector<ckpt::Window> w;
  for (int64_t r = 0; r < n; ++r)
    w.push_back({{r, 0}, {1, 2}});
  return w;
}

TEST(CheckpointPlan, ManyWindowsThatTileAreAccepted) {
  const auto got = ckpt::distinct_windows(rows(1000), "rows", {1000, 2}, "test");
  ASSERT_EQ(got.size(), 1000u);
  EXPECT_EQ(got[7].window.offset, (Shape{7, 0}));
  EXPECT_EQ(got[7].ranks, std::vector<int>{7});
  // Columns: every window spans dim 0 whole.
  std::vector<ckpt::Window> cols;
  for (int64_t c = 0; c < 600; ++c)
    cols.push_back({{0, c}, {3, 1}});
  EXPECT_EQ(ckpt::distinct_windows(cols, "cols", {3, 600}, "test").size(), 600u);
}

TEST(CheckpointPlan, ReplicasOfAWindowAreOneWindowWithTheirRanks) {
  std::vector<ckpt::Window> w;
  for (int64_t r = 0; r < 600; ++r)
    w.push_back({{r / 2, 0}, {1, 2}});  // ranks 2k and 2k + 1 hold row k
  w.push_back({{0, 0}, {0, 2}});        // an empty piece counts for nothing
  const auto got = ckpt::distinct_windows(w, "pairs", {300, 2}, "test");
  ASSERT_EQ(got.size(), 300u);
  EXPECT_EQ(got[299].ranks, (std::vector<int>{598, 599}));
}

// One overlap, made up for by a gap so that the sizes still add up to the tensor's: past 256
// windows the pairs were not compared, and such pieces were accepted (the file would hold the
// overlap twice and the gap never).
TEST(CheckpointPlan, AnOverlapAmongManyWindowsIsFound) {
  std::vector<ckpt::Window> w = rows(300);
  w[151] = {{150, 1}, {2, 1}};  // (150, 1) twice, (151, 0) never
  expect_error(
      [&] {
        ckpt::distinct_windows(w, "model/big", {300, 2}, "save");
      },
      {"save: 'model/big'", "rank 150 (at [150, 0], [1, 2])", "rank 151 (at [150, 1], [2, 1])",
       "overlap without being the same block"});
  // In 3 dims, among 512 windows, the overlapping ones far apart in rank order.
  std::vector<ckpt::Window> cube;
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t j = 0; j < 8; ++j)
      for (int64_t k = 0; k < 8; ++k)
        cube.push_back({{i, j, k}, {1, 1, 1}});
  cube[3] = {{7, 7, 6}, {1, 1, 2}};  // (0, 0, 3) never, (7, 7, 6) and (7, 7, 7) twice
  cube[5] = {{0, 0, 5}, {0, 1, 1}};  // (0, 0, 5) never
  expect_error(
      [&] {
        ckpt::distinct_windows(cube, "cube", {8, 8, 8}, "save");
      },
      {"rank 3 (at [7, 7, 6], [1, 1, 2])", "rank 510 (at [7, 7, 6], [1, 1, 1])", "overlap"});
}

TEST(CheckpointPlan, AGapAmongManyWindowsIsNamed) {
  std::vector<ckpt::Window> w = rows(300);
  w[42] = {{42, 0}, {1, 1}};
  expect_error(
      [&] {
        ckpt::distinct_windows(w, "gap", {300, 2}, "save");
      },
      {"'gap': the ranks' pieces cover 599 of the 600 elements of [300, 2]"});
}

TEST(CheckpointPlan, PiecesOutsideTheTensorOrOfAnotherRankAreNamed) {
  std::vector<ckpt::Window> w = rows(4);
  w[2] = {{3, 1}, {1, 2}};
  expect_error(
      [&] {
        ckpt::distinct_windows(w, "t", {4, 2}, "load");
      },
      {"rank 2's piece at [3, 1] of shape [1, 2] lies outside [4, 2]"});
  w[2] = {{2}, {1}};
  expect_error(
      [&] {
        ckpt::distinct_windows(w, "t", {4, 2}, "load");
      },
      {"rank 2's piece does not match the tensor's rank"});
}

// A window has 2^d corners; only the dims the windows split count, so a tensor of many dims
// split along one costs what a vector does (2^24 corners per window would not fit in memory).
TEST(CheckpointPlan, ManyDimsCostOnlyTheDimsTheWindowsSplit) {
  Shape global(24, 1);
  global[0] = 512;
  global[23] = 2;
  std::vector<ckpt::Window> w;
  for (int64_t r = 0; r < 512; ++r) {
    ckpt::Window piece{Shape(24, 0), global};
    piece.offset[0] = r;
    piece.shape[0] = 1;
    w.push_back(piece);
  }
  EXPECT_EQ(ckpt::distinct_windows(w, "deep", global, "save").size(), 512u);
  w[300].shape[0] = 0;  // row 300 never
  w[301].shape[0] = 2;  // rows 301 and 302, over 302's
  expect_error([&] { ckpt::distinct_windows(w, "deep", global, "save"); }, {"rank 301", "overlap"});
}

TEST(CheckpointPlan, ScalarsAndEmptyTensors) {
  EXPECT_EQ(ckpt::distinct_windows({{{}, {}}, {{}, {}}}, "s", {}, "t").size(), 1u);
  EXPECT_TRUE(
      ckpt::distinct_windows({{{0, 0}, {0, 3}}, {{0, 0}, {0, 3}}}, "e", {0, 3}, "t").empty());
}

}  // namespace
}  // namespace tessera
