// The testing kit checks itself: its reference geometry against the runtime's layout over every
// mesh, placement list and edge shape of the world size; its checks against deliberate bugs
// (they must fail, naming rank and global index, and never hang); its parity runner against a
// data-parallel run that forgets to average its gradients.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "child_job.h"
#include "tessera/dtensor/layout.h"
#include "tessera/tessera.h"
#include "tessera/testing.h"
#include "tessera/testing/expect_contains.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// The messages of the GoogleTest failures `f` reports, intercepted instead of failing the test.
template <class F>
std::vector<std::string> failures_of(F&& f) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    f();
  }
  std::vector<std::string> out;
  for (int i = 0; i < results.size(); ++i)
    out.push_back(results.GetTestPartResult(i).message());
  return out;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& m : v)
    s.append(m).append("\n");
  return s;
}

const std::vector<DeviceMesh>& meshes() {
  static const std::vector<DeviceMesh> m = device_meshes();
  return m;
}

// Rank r holds rows r, r + n, r + 2n, ... while claiming Shard(0): a layout bug that keeps every
// shape right.
DTensor interleaved_rows(const Tensor& global, const DeviceMesh& mesh) {
  const int64_t n = mesh.size(), r = mesh.local_rank(0), rows = global.size(0) / n;
  std::vector<Tensor> picked;
  for (int64_t i = 0; i < rows; ++i)
    picked.push_back(kernels::narrow(global, 0, r + i * n, 1));
  return DTensor::from_local(kernels::cat(picked, 0), mesh, {Shard(0)}, global.shape());
}

}  // namespace

TEST(TestingKit, MeshShapesAreEveryFactorization) {
  EXPECT_EQ(mesh_shapes(1), (std::vector<Shape>{{1}}));
  EXPECT_EQ(mesh_shapes(3), (std::vector<Shape>{{3}}));
  EXPECT_EQ(mesh_shapes(8), (std::vector<Shape>{{8}, {2, 4}, {4, 2}, {2, 2, 2}}));
  EXPECT_EQ(mesh_shapes(12, 2), (std::vector<Shape>{{12}, {2, 6}, {3, 4}, {4, 3}, {6, 2}}));
  EXPECT_EQ(mesh_shapes(12).size(), 8u);  // and (2,2,3), (2,3,2), (3,2,2)
}

TEST(TestingKit, PlacementListsCoverEveryChoice) {
  // R, S(0), S(1), P on each of two mesh dims, plus [SS(0,2), S(0)] and [SS(1,2), S(1)].
  const auto lists = placement_lists({2, 2}, 2, {.strided = true});
  EXPECT_EQ(lists.size(), 18u);
  EXPECT_EQ(std::count(lists.begin(), lists.end(), Placements{StridedShard(0, 2), Shard(0)}), 1);
  EXPECT_EQ(placement_lists({4}, 3, {.partial = false}).size(), 4u);
  for (const Shape& s : edge_shapes({2, 2}, 2))
    EXPECT_EQ(s.size(), 2u);
  const auto shapes = edge_shapes({4}, 1);
  EXPECT_EQ(shapes, (std::vector<Shape>{{8}, {9}, {3}, {0}}));
}

TEST(TestingKit, IndexTensorValuesNameTheirIndex) {
  const Tensor t = index_tensor({3, 4}, DType::Float32);
  EXPECT_EQ(t.to_vector<double>()[6], 7.0);
  EXPECT_EQ(index_of_value(7.0, {3, 4}), (std::vector<int64_t>{1, 2}));
  EXPECT_FALSE(index_of_value(0.0, {3, 4}));
  EXPECT_FALSE(index_of_value(2.5, {3, 4}));
  TESSERA_EXPECT_CONTAINS(error_of([] { index_tensor({4}, DType::BFloat16); }), "bfloat16");
  TESSERA_EXPECT_CONTAINS(error_of([] {
                            index_tensor({5000, 5000}, DType::Float32);
                          }),
                          "[5000, 5000]");
}

TEST(TestingKit, MaxAbsDiffIsNaNWhenEitherSideHasNaN) {
  const double nan = std::numeric_limits<double>::quiet_NaN(),
               inf = std::numeric_limits<double>::infinity();
  const Tensor a = from_vector<double>({1, 2, 3}), b = from_vector<double>({1, nan, 3.5});
  EXPECT_TRUE(std::isnan(max_abs_diff(a, b))) << "a NaN was dropped as a difference of 0";
  EXPECT_TRUE(std::isnan(max_abs_diff(b, a)));
  EXPECT_TRUE(std::isnan(max_abs_diff(b, b))) << "NaN matches nothing, itself included";
  EXPECT_EQ(max_abs_diff(from_vector<double>({inf, -inf, 1}), from_vector<double>({inf, -inf, 3})),
            2.0);
  EXPECT_EQ(max_abs_diff(from_vector<double>({inf}), from_vector<double>({1})), inf);
}

// Exact checks compare integers as integers (2^53 + 1 and 2^53 are one double), and a NaN is
// reported as the largest difference, not dropped from it.
TEST(TestingKit, MismatchesKeepIntegersExactAndNaNLargest) {
  const int64_t big = int64_t(1) << 53;
  TESSERA_EXPECT_CONTAINS(
      tensor_mismatch(from_vector<int64_t>({big + 1}), from_vector<int64_t>({big})),
      "got 9007199254740993, want 9007199254740992");
  const double nan = std::numeric_limits<double>::quiet_NaN();
  TESSERA_EXPECT_CONTAINS(tensor_mismatch(from_vector<double>({2, nan}),
                                          from_vector<double>({1, 1}), Tolerance{1e-3, 0}),
                          "2 of 2 elements differ; first at global index [0]: got 2, want 1; "
                          "largest |difference| nan");
}

TEST(TestingKit, ReferenceWindowRefusesWhatNoDTensorCanBe) {
  TESSERA_EXPECT_CONTAINS(
      error_of([] {
        reference_window({8, 8}, {2, 2}, {0, 0}, {StridedShard(0, 3), Shard(0)});
      }),
      "must have split factor 2");
  TESSERA_EXPECT_CONTAINS(error_of([] { reference_window({8}, {2}, {0}, {Shard(1)}); }),
                          "S(1) on mesh dim 0 of a tensor of shape [8]");
}

// The reference geometry and the runtime's layout agree on every coordinate of every mesh of
// this world size, for every placement list (StridedShard included) and edge shape; and
// distribute_tensor passes the kit's own checks there.
TEST(TestingKit, ReferenceGeometryMatchesRuntimeLayout) {
  int compared = 0;
  for (const DeviceMesh& mesh : meshes())
    for (const Shape& shape : edge_shapes(mesh.shape(), 2))
      for (const Placements& p : placement_lists(mesh.shape(), 2, {.strided = true})) {
        for (int64_t i = 0; i < mesh.size(); ++i) {
          const auto coord = mesh_coordinate(i, mesh.shape());
          const Window w = reference_window(shape, mesh.shape(), coord, p);
          const LocalLayout l = compute_local_layout(shape, mesh.shape(), coord, p);
          ASSERT_EQ(w.shape, l.local_shape) << mesh.str() << placements_str(p) << shape_str(shape);
          ASSERT_EQ(w.offset, l.global_offset) << mesh.str() << placements_str(p);
          ++compared;
        }
        const Tensor global = index_tensor(shape);
        const DTensor dt = distribute_tensor(global, mesh, p);
        expect_local_matches(dt, global);
        expect_replicas_equal(dt);
      }
  EXPECT_GT(compared, 0);
}

TEST(TestingKit, ChecksFailTheBuggyLayoutOnTheRightRanks) {
  for (const DeviceMesh& mesh : meshes()) {
    if (mesh.ndim() != 1 || mesh.size() == 1) continue;
    const int64_t n = mesh.size(), r = mesh.local_rank(0);
    const Tensor global = index_tensor({2 * n, 3});
    const DTensor bad = interleaved_rows(global, mesh);
    const std::string local = joined(failures_of([&] { expect_local_matches(bad, global); }));
    // Rank r holds row r where row 2r belongs (rank 0: row n where row 1 belongs).
    const std::string want_row = std::to_string(r == 0 ? n : r), row = std::to_string(2 * r);
    TESSERA_EXPECT_CONTAINS(local, "rank " + std::to_string(world_rank()));
    TESSERA_EXPECT_CONTAINS(local, r == 0 ? "local [1, 0] = global index [1, 0]"
                                          : "local [0, 0] = global index [" + row + ", 0]");
    TESSERA_EXPECT_CONTAINS(local, "(the value of global index [" + want_row + ", 0])");
    // Gathered in the declared order the rows come out permuted.
    const std::string global_msg =
        joined(failures_of([&] { expect_close_global(bad, global, 0.0); }));
    TESSERA_EXPECT_CONTAINS(global_msg,
                            "first at global index [1, 0]: got " + std::to_string(3 * n + 1) +
                                " (the value of global index [" + std::to_string(n) + ", 0])");
    // The correct layout passes all three.
    const DTensor good = distribute_tensor(global, mesh, {Shard(0)});
    EXPECT_TRUE(failures_of([&] {
                  expect_local_matches(good, global);
                  expect_replicas_equal(good);
                  expect_close_global(good, global, 0.0);
                }).empty());
  }
}

TEST(TestingKit, ExpectErrorReportsACallThatDidNotThrow) {
  EXPECT_EQ(joined(failures_of([] { expect_error([] {}, {"needle"}); })),
            "Failed\nexpected an error containing 'needle'\n");
  // With no needles: any tessera::Error passes, and no error is reported as such.
  EXPECT_EQ(joined(failures_of([] { expect_error([] {}, std::vector<std::string>{}); })),
            "Failed\nexpected a tessera::Error\n");
  EXPECT_TRUE(failures_of([] {
                expect_error([] { TESSERA_FAIL("any"); }, std::vector<std::string>{});
              }).empty());
}

// Reported at the caller's line, as the checks are, not in the header.
TEST(TestingKit, ExpectErrorReportsAtTheCallersLine) {
  ::testing::TestPartResultArray results;
  int line = 0;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    line = __LINE__ + 1;
    expect_error([] { TESSERA_FAIL("other"); }, {"needle"});
  }
  ASSERT_EQ(results.size(), 1);
  EXPECT_EQ(results.GetTestPartResult(0).line_number(), line);
  EXPECT_EQ(std::string(results.GetTestPartResult(0).file_name()), std::string(__FILE__));
  TESSERA_EXPECT_CONTAINS(results.GetTestPartResult(0).message(), "missing 'needle' in: ");
}

TEST(TestingKit, ReplicasEqualFindsTheOddRankOut) {
  for (const DeviceMesh& mesh : meshes()) {
    if (mesh.size() == 1) continue;
    // Replicate on the last mesh dim, whatever the others do.
    Placements p(size_t(mesh.ndim()), Shard(0));
    p.back() = Replicate();
    const Tensor global = dyadic_tensor({8, 4}, 5);
    const DTensor good = distribute_tensor(global, mesh, p);
    Tensor local = good.to_local().clone();
    const int64_t last = mesh.ndim() - 1, odd = mesh.size(last) - 1;
    const bool is_odd = mesh.local_rank(last) == odd;
    if (is_odd && local.numel() > 1) {
      std::vector<double> v = local.to_vector<double>();
      v[1] += 0.25;
      local = from_vector<double>(v, local.shape());
    }
    const DTensor bad = DTensor::from_local(local, mesh, p, global.shape());
    const std::string msg = joined(failures_of([&] { expect_replicas_equal(bad); }));
    if (is_odd && local.numel() > 1) {
      TESSERA_EXPECT_CONTAINS(msg, "rank " + std::to_string(world_rank()) + " (coordinate");
      TESSERA_EXPECT_CONTAINS(msg, "is Replicate) but differ in 1 of");
      TESSERA_EXPECT_CONTAINS(msg, "first at local [0, 1] = global index");
    } else {
      EXPECT_EQ(msg, "") << mesh.str();
    }
    // A rank that disagrees on the global shape holds a piece of another shape: the check
    // reports it rather than leave the ranks in a collective of mismatched sizes.
    const Tensor other_global = is_odd ? kernels::narrow(global, 1, 0, 3).contiguous() : global;
    const Window w = reference_window(other_global.shape(), mesh.shape(), mesh.coordinate(), p);
    const DTensor wrong =
        DTensor::from_local(cut_window(other_global, w), mesh, p, other_global.shape());
    const std::string shape_msg = joined(failures_of([&] { expect_replicas_equal(wrong); }));
    if (is_odd) {
      TESSERA_EXPECT_CONTAINS(shape_msg, ", 3] float64 and [");
    } else {
      EXPECT_EQ(shape_msg, "");
    }
    // So does the global comparison, on every rank, before any piece is gathered.
    const std::string global_msg =
        joined(failures_of([&] { expect_close_global(wrong, global, 0.0); }));
    TESSERA_EXPECT_CONTAINS(global_msg, is_odd ? "describes the DTensor as [8, 3] float64"
                                               : "not compared: another rank's piece");
    EXPECT_NE(joined(failures_of([&] { expect_close_global(good, wrong, 0.0); })), "");
    expect_replicas_equal(good);
  }
}

// Ranks that place one tensor differently (each piece right for its own placements) are
// reported before any piece is gathered, on every rank.
TEST(TestingKit, GlobalChecksReportRanksThatPlaceTheTensorOtherwise) {
  if (world_size() == 1) GTEST_SKIP() << "needs two ranks";
  const DeviceMesh mesh({world_size()}, {"x"});
  const Tensor global = dyadic_tensor({2 * world_size(), 2 * world_size()}, 3);
  const bool odd = world_rank() % 2 == 1;
  const Placements p{odd ? Shard(1) : Shard(0)};
  const DTensor dt = DTensor::from_local(
      cut_window(global, reference_window(global.shape(), mesh.shape(), mesh.coordinate(), p)),
      mesh, p, global.shape());
  const std::string msg = joined(failures_of([&] { expect_close_global(dt, global, 0.0); }));
  TESSERA_EXPECT_CONTAINS(msg, odd ? "places the DTensor as [S(1)], rank 0 (first on mesh dim 0) "
                                     "as [S(0)]"
                                   : "not compared: another rank's piece");
}

TEST(TestingKit, PartialPiecesAreCheckedByTheirSum) {
  const DeviceMesh& mesh = meshes().front();
  const Tensor global = dyadic_tensor({6, 2}, 11);
  // Any split is allowed: rank 0 holds the value plus (n - 1) * 0.5, the others -0.5 each.
  const double delta = world_rank() == 0 ? 0.5 * double(world_size() - 1) : -0.5;
  const Tensor piece = world_rank() == 0 ? add(global, delta) : full_like(global, delta);
  const DTensor dt = DTensor::from_local(piece, mesh, {Partial()}, global.shape());
  expect_local_matches(dt, global);
  const DTensor off = DTensor::from_local(add(piece, 1.0), mesh, {Partial()}, global.shape());
  const std::string msg = joined(failures_of([&] { expect_local_matches(off, global); }));
  TESSERA_EXPECT_CONTAINS(msg, "reduced over its Partial mesh dims");
  TESSERA_EXPECT_CONTAINS(msg, "12 of 12 elements differ");
}

namespace {

// Rows of the global batch: even over 1, 2, 3, 4 and 8 ranks.
constexpr int64_t kRows = 24;

// y = W x + b fitted to a target on a global batch of kRows rows; on a mesh the rows are split
// over the world (data parallelism by hand), and `average` says whether the gradients are
// averaged before the step (forgetting it is the bug under test).
MakeRun regression(bool average, bool global_loss = true) {
  return [=](const DeviceMesh* mesh) {
    struct State {
      Generator gen{3};
      std::shared_ptr<Linear> lin = std::make_shared<Linear>(4, 2, true, gen);
      std::unique_ptr<SGD> opt;
    };
    auto st = std::make_shared<State>();
    st->opt = std::make_unique<SGD>(st->lin->parameters(), SGDOptions{.lr = 0.1});
    TrainingRun run;
    run.step = [=](int step) {
      const int64_t n = mesh ? world_size() : 1, r = mesh ? world_rank() : 0;
      // Values in [-1, 1]: a well-conditioned fit, so float32 rounding stays near 1e-7.
      const Tensor x =
          mul(dyadic_tensor({kRows, 4}, 100 + uint64_t(step), DType::Float32), 1.0 / 16);
      const Tensor t =
          mul(dyadic_tensor({kRows, 2}, 200 + uint64_t(step), DType::Float32), 1.0 / 16);
      const Tensor xs = kernels::narrow(x, 0, r * kRows / n, kRows / n).contiguous();
      const Tensor ts = kernels::narrow(t, 0, r * kRows / n, kRows / n).contiguous();
      st->opt->zero_grad();
      const Tensor loss = mean(square(sub((*st->lin)(xs), ts)));
      backward(loss);
      if (mesh && average)
        for (Parameter* p : st->lin->parameters()) {
          Tensor g = p->grad();
          world_group()->all_reduce(g, ReduceOp::Avg)->wait();
        }
      st->opt->step();
      const double l = loss.item<float>();
      return mesh && global_loss ? world_mean(l) : l;
    };
    run.parameters = [=] { return st->lin->state_dict(); };
    return run;
  };
}

}  // namespace

TEST(TestingKit, ParityRunnerPassesCorrectDataParallelism) {
  const ParityOptions opts{.steps = 5, .loss = {1e-5, 1e-6}, .parameters = {1e-5, 1e-6}};
  const auto results = expect_parity(regression(true), meshes(), opts);
  ASSERT_EQ(results.size(), meshes().size());
  for (const auto& r : results) {
    EXPECT_FALSE(r.divergence) << r.str();
    if (world_rank() == 0) std::printf("[parity] %s\n", r.str().c_str());
  }
}

TEST(TestingKit, ParityRunnerNamesTheFirstDivergence) {
  if (world_size() == 1) GTEST_SKIP() << "one rank has nothing to average";
  const ParityOptions opts{.steps = 5};
  const Trajectory reference = record_trajectory(regression(true), nullptr, opts);
  const DeviceMesh& mesh = meshes().front();
  const ParityResult r = run_parity(regression(false), mesh, reference, opts);
  ASSERT_TRUE(r.divergence);
  // The loss of step 0 comes before any update; the first parameter in name order is off after.
  EXPECT_EQ(r.divergence->step, 0);
  EXPECT_EQ(r.divergence->what, "bias");
  TESSERA_EXPECT_CONTAINS(r.str(), "diverges after step 0 in bias: ");
  const ParityResult local = run_parity(regression(true, false), mesh, reference, opts);
  ASSERT_TRUE(local.divergence);
  TESSERA_EXPECT_CONTAINS(local.divergence->detail, "ranks disagree: rank 0 returned");
  // Through expect_parity the divergence is a test failure naming mesh, step and parameter.
  const std::string msg =
      joined(failures_of([&] { expect_parity(regression(false), {mesh}, opts); }));
  TESSERA_EXPECT_CONTAINS(msg, mesh.str() + ": diverges after step 0 in bias");
  // A reference that depends on the rank (here its data) is reported as such.
  const MakeRun rank_seeded = [](const DeviceMesh* m) {
    auto w = std::make_shared<double>(1.0);
    TrainingRun run;
    run.step = [w, m](int) {
      *w *= 0.5;
      return m ? *w : *w + world_rank();
    };
    run.parameters = [w] {
      return std::map<std::string, Tensor>{{"w", from_vector<double>({*w})}};
    };
    return run;
  };
  const std::string ref_msg =
      joined(failures_of([&] { expect_parity(rank_seeded, {}, {.steps = 2}); }));
  TESSERA_EXPECT_CONTAINS(ref_msg, "the reference run differs across ranks (loss of step 0: 0.5");
}

// A NaN loss on every rank is a loss that diverged, not ranks that disagree.
TEST(TestingKit, ParityRunnerReportsANaNLossAsADivergence) {
  const MakeRun nan_run = [](const DeviceMesh*) {
    TrainingRun run;
    run.step = [](int) { return std::numeric_limits<double>::quiet_NaN(); };
    run.parameters = [] { return std::map<std::string, Tensor>{{"w", from_vector<double>({1})}}; };
    return run;
  };
  const DeviceMesh& mesh = meshes().front();
  const std::string msg =
      joined(failures_of([&] { expect_parity(nan_run, {mesh}, {.steps = 1}); }));
  EXPECT_EQ(msg.find("differs across ranks"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("ranks disagree"), std::string::npos) << msg;
  TESSERA_EXPECT_CONTAINS(msg, mesh.str() + ": diverges after step 0 in loss");
}

TEST(TestingKit, ParityRunnerStopsEveryRankWhenOnlySomeLossesDiverge) {
  if (world_size() == 1) GTEST_SKIP() << "needs ranks whose references differ";
  // A reference that depends on the rank, and a mesh run that takes rank 0's values (as a
  // parallelized model does): the loss diverges on every rank but 0. Its parameters are read
  // through a collective, as a state_dict gathering DTensors is; rank 0 went into it alone.
  const MakeRun rank_seeded = [](const DeviceMesh* m) {
    auto w = std::make_shared<double>(1.0);
    TrainingRun run;
    run.step = [w, m](int) {
      *w *= 0.5;
      return m ? *w : *w + world_rank();
    };
    run.parameters = [w, m] {
      const double v = m ? world_mean(*w) : *w;
      return std::map<std::string, Tensor>{{"w", from_vector<double>({v})}};
    };
    return run;
  };
  const ParityOptions opts{.steps = 3};
  const Trajectory reference = record_trajectory(rank_seeded, nullptr, opts);
  const ParityResult r = run_parity(rank_seeded, meshes().front(), reference, opts);
  ASSERT_TRUE(r.divergence);
  EXPECT_EQ(r.divergence->step, 0);
  if (world_rank() == 0) {
    EXPECT_EQ(r.divergence->what, "(on other ranks)");
    TESSERA_EXPECT_CONTAINS(r.divergence->detail, "rank(s) 1");
  } else {
    EXPECT_EQ(r.divergence->what, "loss");
  }
  // The world is still in step: one more collective completes on every rank.
  EXPECT_EQ(world_mean(1.0), 1.0);
}

namespace {

// This binary as a 2-rank child job running the disabled TestingKitChild tests `gtest_flags`
// select, with environment `settings`.
tessera::test::ChildResult run_child_tests(const std::string& gtest_flags,
                                           const std::string& settings) {
  std::array<char, 4096> self{};
  const ssize_t len = readlink("/proc/self/exe", self.data(), self.size() - 1);
  TESSERA_CHECK(len > 0, "readlink(/proc/self/exe) failed");
  return tessera::test::run_child_job(
      2,
      tessera::test::shell_quoted(std::string(self.data(), size_t(len))) +
          " --gtest_also_run_disabled_tests --gtest_color=no " + gtest_flags,
      settings, 120);
}

}  // namespace

// Run only as a child job (below): fails on the last rank alone.
TEST(TestingKitChild, DISABLED_FailsOnTheLastRankOnly) {
  EXPECT_NE(world_rank(), world_size() - 1) << "the deliberate failure";
}

// Run only as a child job (below), with --gtest_fail_fast: the first fails on rank 0 alone, the
// second needs every rank in a collective.
TEST(TestingKitChild, DISABLED_FailFastA_FailsOnRankZeroOnly) {
  EXPECT_NE(world_rank(), 0) << "the deliberate failure";
}
TEST(TestingKitChild, DISABLED_FailFastB_NeedsEveryRank) {
  EXPECT_EQ(world_mean(1.0), 1.0);
}

// With --gtest_fail_fast every rank skips the tests after one that failed on any rank: a rank
// that passed it and went on alone would wait in the next test's collectives for ranks that
// skipped it.
TEST(TestingKit, FailFastSkipsTheSameTestsOnEveryRank) {
  if (world_size() != 2) GTEST_SKIP() << "the child job is started from the 2-rank run";
  if (world_rank() == 0) {
    const tessera::test::ChildResult r =
        run_child_tests("--gtest_fail_fast --gtest_filter=TestingKitChild.DISABLED_FailFast*",
                        "OMP_NUM_THREADS=1 TESSERA_COLLECTIVE_TIMEOUT=20");
    EXPECT_NE(r.exit_code, 0) << r.output;
    TESSERA_EXPECT_CONTAINS(r.output, "[rank 1] [  FAILED  ] TestingKitChild.DISABLED_FailFastA");
    TESSERA_EXPECT_CONTAINS(r.output,
                            "\n[  SKIPPED ] TestingKitChild.DISABLED_FailFastB_NeedsEveryRank");
    TESSERA_EXPECT_CONTAINS(r.output, "[ tessera ] tests failed on rank(s) 0 of 2");
  }
  world_group()->barrier()->wait();
}

// The MPI main reports a test that failed on rank 1 only as failed in rank 0's report and
// summary, and the job fails naming rank 1.
TEST(TestingKit, MainReportsAFailureOnAnyRank) {
  if (world_size() != 2) GTEST_SKIP() << "the child job is started from the 2-rank run";
  if (world_rank() == 0) {
    const tessera::test::ChildResult r = run_child_tests(
        "--gtest_filter=TestingKitChild.DISABLED_FailsOnTheLastRankOnly", "OMP_NUM_THREADS=1");
    EXPECT_NE(r.exit_code, 0) << r.output;
    TESSERA_EXPECT_CONTAINS(r.output, "[rank 1] [  FAILED  ] TestingKitChild.");
    TESSERA_EXPECT_CONTAINS(r.output, "failed on rank(s) 1 of 2 (their failures");
    TESSERA_EXPECT_CONTAINS(r.output,
                            "\n[  FAILED  ] TestingKitChild.DISABLED_FailsOnTheLastRankOnly (");
    TESSERA_EXPECT_CONTAINS(r.output, "\n[  FAILED  ] 1 test, listed below:");
    TESSERA_EXPECT_CONTAINS(r.output, "[ tessera ] tests failed on rank(s) 1 of 2");
  }
  world_group()->barrier()->wait();
}
