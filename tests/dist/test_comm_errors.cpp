// How the comm layer fails: mismatched collectives caught by the debug check (the same error on
// every rank), invalid arguments, and — in a child job — a rank that never joins a collective or
// dies of an uncaught exception, both of which must end the whole job with a message.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "child_job.h"
#include "tessera/comm/comm.h"
#include "tessera/core/core.h"
#include "tessera/testing/expect_contains.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;

namespace {

using tessera::testing::error_of;

class DebugCollectives : public ::testing::Test {
 protected:
  void SetUp() override { set_debug_collectives(true); }
  void TearDown() override {
    set_debug_collectives(false);
    // Every rank leaves the test together, whatever it threw.
    world_group()->barrier()->wait();
  }
};

}  // namespace

TEST_F(DebugCollectives, DifferentShapesThrowOnEveryRank) {
  auto g = world_group();
  Tensor t = ones({g->rank() == 0 ? 4 : 5}, DType::Float32);
  const std::string msg = error_of([&] { g->all_reduce(t, ReduceOp::Sum)->wait(); });
  TESSERA_EXPECT_CONTAINS(msg, "[rank " + std::to_string(g->rank()) + "]");
  TESSERA_EXPECT_CONTAINS(msg, "collective mismatch on group 'world'");
  TESSERA_EXPECT_CONTAINS(msg, "needs the same shape on every rank");
  TESSERA_EXPECT_CONTAINS(msg, "rank 0: all_reduce(sum) float32 [4]");
  TESSERA_EXPECT_CONTAINS(msg, "rank 1: all_reduce(sum) float32 [5]");
  // Nothing was sent: the group still works.
  Tensor u = ones({3}, DType::Float32);
  g->all_reduce(u, ReduceOp::Sum)->wait();
  EXPECT_EQ(u.to_vector<float>(), std::vector<float>(3, float(g->size())));
}

// Each call carries its position among the group's collectives. Ranks can only reach a check at
// different positions when a collective escaped it: here rank 1 makes one with the check off.
TEST_F(DebugCollectives, DifferentPositionsThrowOnEveryRank) {
  auto g = world_group();
  if (g->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  Tensor extra = ones({2}, DType::Float32);
  WorkPtr pending;
  set_debug_collectives(false);
  if (g->rank() == 1) pending = g->all_reduce(extra, ReduceOp::Sum);
  set_debug_collectives(true);
  const std::string msg = error_of([&] { g->barrier()->wait(); });
  TESSERA_EXPECT_CONTAINS(msg, "collective mismatch on group 'world'");
  TESSERA_EXPECT_CONTAINS(msg, "the ranks are at different positions in the group's sequence");
  TESSERA_EXPECT_CONTAINS(msg, "a rank skipped a collective or made an extra one");
  // The others make the collective rank 1 made, so that every rank is in step again.
  set_debug_collectives(false);
  if (g->rank() != 1) g->all_reduce(extra, ReduceOp::Sum)->wait();
  if (pending) pending->wait();
  EXPECT_EQ(extra.to_vector<float>(), std::vector<float>(2, float(g->size())));
}

TEST_F(DebugCollectives, DifferentOperationsThrowOnEveryRank) {
  auto g = world_group();
  const int n = g->size();
  Tensor t = ones({4}, DType::Float32);
  Tensor out = zeros({4 * n}, DType::Float32);
  const std::string msg = error_of([&] {
    if (g->rank() == 0) {
      g->all_reduce(t, ReduceOp::Sum)->wait();
    } else {
      g->all_gather_into_tensor(out, t)->wait();
    }
  });
  TESSERA_EXPECT_CONTAINS(msg, "the ranks called different operations");
  TESSERA_EXPECT_CONTAINS(msg, "rank 0: all_reduce(sum) float32 [4]");
  TESSERA_EXPECT_CONTAINS(
      msg, "rank 1: all_gather_into_tensor float32 [4] -> [" + std::to_string(4 * n) + "]");
}

TEST_F(DebugCollectives, DifferentReduceOpsDtypesAndRootsThrow) {
  auto g = world_group();
  const bool first = g->rank() == 0;
  Tensor t = ones({2}, DType::Float32);
  std::string msg =
      error_of([&] { g->all_reduce(t, first ? ReduceOp::Sum : ReduceOp::Max)->wait(); });
  TESSERA_EXPECT_CONTAINS(msg, "rank 0: all_reduce(sum) float32 [2]");
  TESSERA_EXPECT_CONTAINS(msg, "rank 1: all_reduce(max) float32 [2]");

  Tensor d = ones({2}, first ? DType::Float32 : DType::Float64);
  msg = error_of([&] { g->broadcast(d, 0)->wait(); });
  TESSERA_EXPECT_CONTAINS(msg, "rank 0: broadcast(root 0) float32 [2]");
  TESSERA_EXPECT_CONTAINS(msg, "rank 1: broadcast(root 0) float64 [2]");

  msg = error_of([&] { g->broadcast(t, first ? 0 : 1)->wait(); });
  TESSERA_EXPECT_CONTAINS(msg, "rank 0: broadcast(root 0) float32 [2]");
  TESSERA_EXPECT_CONTAINS(msg, "rank 1: broadcast(root 1) float32 [2]");
}

// Rank 0 expects one element too many from rank 1 in an all_to_all.
TEST_F(DebugCollectives, UnevenCountsThatDoNotPairUpThrow) {
  auto g = world_group();
  const int n = g->size();
  std::vector<Tensor> inputs;
  std::vector<Tensor> outputs;
  for (int s = 0; s < n; ++s) {
    inputs.push_back(ones({2}, DType::Float32));
    const bool wrong = g->rank() == 0 && s == 1;
    outputs.push_back(zeros({wrong ? 3 : 2}, DType::Float32));
  }
  const std::string msg = error_of([&] { g->all_to_all(outputs, inputs)->wait(); });
  TESSERA_EXPECT_CONTAINS(msg, "all_to_all sizes do not pair up");
  TESSERA_EXPECT_CONTAINS(msg, "rank 0 expects 3 elements from rank 1, which sends 2");
}

namespace {

// all_gather_runs of 10 elements per rank into 10 * (size + 1): runs[s] puts rank s's input at
// 10 * s. `edit` changes this rank's copy of the runs before the call.
std::string gather_runs_error(
    const std::function<void(std::vector<std::vector<GatherRun>>&)>& edit) {
  auto g = world_group();
  const int n = g->size();
  std::vector<std::vector<GatherRun>> runs;
  for (int s = 0; s < n; ++s)
    runs.push_back({{0, 10 * s, 10}});
  edit(runs);
  Tensor in = full({10}, g->rank() + 1, DType::Float32);
  Tensor out = zeros({10 * (n + 1)}, DType::Float32);
  return error_of([&] { g->all_gather_runs(out, in, runs)->wait(); });
}

}  // namespace

// The runs must be given alike on every rank: rank 1's list for its own input totals 8 elements
// where every other rank's totals 10, so they would keep 2 stale elements.
TEST_F(DebugCollectives, GatherRunsWhoseTotalsDifferThrowOnEveryRank) {
  if (world_group()->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const std::string msg = gather_runs_error([](auto& runs) {
    if (world_group()->rank() == 1) runs[1][0].length = 8;
  });
  TESSERA_EXPECT_CONTAINS(msg, "collective mismatch on group 'world'");
  TESSERA_EXPECT_CONTAINS(msg, "all_gather_runs sizes do not pair up");
  TESSERA_EXPECT_CONTAINS(msg, "rank 0 expects 10 elements from rank 1, which sends 8");
}

// Same totals, another place: rank 1 puts its own piece at the spare end of the output.
TEST_F(DebugCollectives, GatherRunsThatDifferInPlaceThrowOnEveryRank) {
  if (world_group()->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int n = world_group()->size();
  const std::string msg = gather_runs_error([n](auto& runs) {
    if (world_group()->rank() == 1) runs[1][0].dst = 10 * n;
  });
  TESSERA_EXPECT_CONTAINS(msg, "collective mismatch on group 'world'");
  TESSERA_EXPECT_CONTAINS(msg, "all_gather_runs needs the same runs on every rank");
  TESSERA_EXPECT_CONTAINS(msg, "rank 1's runs[1] differ from rank 0's (10 elements in both");
}

// Uneven collectives legitimately differ in shape: the check must let them through.
TEST_F(DebugCollectives, MatchingUnevenCallsPass) {
  auto g = world_group();
  const int n = g->size();
  Tensor in = full({g->rank() + 1}, g->rank(), DType::Int64);
  std::vector<Tensor> outputs;
  for (int r = 0; r < n; ++r)
    outputs.push_back(zeros({r + 1}, DType::Int64));
  EXPECT_EQ(error_of([&] { g->all_gather(outputs, in)->wait(); }), "");
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(outputs[size_t(r)].to_vector<int64_t>(), std::vector<int64_t>(size_t(r + 1), r));
  }
  EXPECT_EQ(gather_runs_error([](auto&) {}), "");
  auto sub = g->split(g->rank() % 2, g->rank(), "halves");
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(error_of([&] { sub->barrier()->wait(); }), "");
}

// A receive that gets fewer elements than its tensor holds fails in its completion step; every
// later wait() and is_completed() of that Work reports the same failure, never a completion
// whose tensor was not filled.
TEST(CommErrors, AFailedCompletionStaysFailed) {
  auto g = world_group();
  if (g->rank() > 1) return;
  if (g->rank() == 0) {
    g->send(ones({2}, DType::Float32), 1, 21)->wait();
    return;
  }
  Tensor in = zeros({4}, DType::Float32);
  WorkPtr r = g->recv(in, 0, 21);
  const std::string first = error_of([&] { r->wait(); });
  TESSERA_EXPECT_CONTAINS(first, "received 2 elements from rank 0");
  EXPECT_EQ(error_of([&] { r->wait(); }), first);
  EXPECT_EQ(error_of([&] { r->is_completed(); }), first);
}

TEST(CommErrors, InvalidArgumentsNameTheProblem) {
  auto g = world_group();
  const int n = g->size();
  const std::string where =
      "on group 'world' (rank " + std::to_string(g->rank()) + " of " + std::to_string(n) + ")";
  Tensor in = ones({2, 3}, DType::Float32);
  Tensor bad_out = zeros({7, 3}, DType::Float32);
  std::string msg = error_of([&] { g->all_gather_into_tensor(bad_out, in); });
  TESSERA_EXPECT_CONTAINS(msg, "all_gather_into_tensor " + where);
  TESSERA_EXPECT_CONTAINS(msg, "output shape [7, 3] must be [" + std::to_string(2 * n) + ", 3]");
  TESSERA_EXPECT_CONTAINS(msg, "input shape [2, 3]");

  Tensor int_out = zeros({2 * n, 3}, DType::Int32);
  msg = error_of([&] { g->all_gather_into_tensor(int_out, in); });
  TESSERA_EXPECT_CONTAINS(msg, "output dtype int32 differs from input dtype float32");

  Tensor rs_out = zeros({2, 3}, DType::Float32);
  msg = error_of([&] { g->reduce_scatter_tensor(rs_out, in, ReduceOp::Sum); });
  if (n > 1) {
    TESSERA_EXPECT_CONTAINS(msg, "input shape [2, 3] must be [" + std::to_string(2 * n) + ", 3]");
  }

  std::vector<Tensor> one_output = {zeros({2, 3}, DType::Float32)};
  msg = error_of([&] { g->all_gather(one_output, in); });
  TESSERA_EXPECT_CONTAINS(
      msg, "outputs has 1 tensors but the group has " + std::to_string(n) + " ranks");

  msg = error_of([&] { g->broadcast(in, n); });
  TESSERA_EXPECT_CONTAINS(msg, "root " + std::to_string(n) + " is not a rank of the group");

  msg = error_of([&] { g->send(in, 0, -1); });
  TESSERA_EXPECT_CONTAINS(msg, "send " + where + ": tag -1 is outside MPI's 0..");

  Tensor flags = ones({4}, DType::Bool);
  msg = error_of([&] { g->all_reduce(flags, ReduceOp::Avg); });
  TESSERA_EXPECT_CONTAINS(msg, "reduce op avg is undefined for bool tensors");

  Tensor undefined;
  msg = error_of([&] { g->all_reduce(undefined, ReduceOp::Sum); });
  TESSERA_EXPECT_CONTAINS(msg, "the tensor is an undefined tensor");

  const int root = 0;
  Tensor out = zeros({1}, DType::Float32);
  std::vector<Tensor> pieces(size_t(n), ones({1}, DType::Float32));
  if (g->rank() != root) {
    msg = error_of([&] { g->scatter(out, pieces, root); });
    TESSERA_EXPECT_CONTAINS(msg, "only the root (rank 0) passes inputs");
  }
  // No rank communicated above, so the group is in step.
  g->barrier()->wait();
}

// ---- A child job under mpirun ----

namespace {

using test::ChildResult;

// Runs `comm_timeout_child <mode> <timeout>` on two ranks, with `settings` (VAR=value ...) in
// its environment; `timeout` (the command) bounds the test even if the abort never happens.
ChildResult run_child(const std::string& mode, const std::string& timeout,
                      const std::string& settings = "") {
  return test::run_child_job(2, test::shell_quoted(TESSERA_CHILD_EXE) + " " + mode + " " + timeout,
                             settings, 90);
}

// Only rank 0 starts the child job, the others wait for it at the barrier.
class ChildJob : public ::testing::Test {
 protected:
  bool launcher() const { return world_group()->rank() == 0; }
  void TearDown() override { world_group()->barrier()->wait(); }
};

}  // namespace

// The control: the same job without a failure succeeds, so the failures below are the child's.
TEST_F(ChildJob, CompletesWhenEveryRankJoins) {
  if (!launcher()) return;
  ChildResult r = run_child("ok", "30");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output, "child ok: 3");
}

namespace {

// A directory holding only `timeout` and `false` from this PATH: no ssh, no rsh.
std::string path_without_remote_shells() {
  char tmpl[] = "/tmp/tessera_nossh_XXXXXX";
  const char* dir = mkdtemp(tmpl);
  if (dir == nullptr) return "";
  const std::string path = std::getenv("PATH") ? std::getenv("PATH") : "";
  for (const std::string tool : {"timeout", "false"}) {
    size_t pos = 0;
    while (pos <= path.size()) {
      size_t end = path.find(':', pos);
      if (end == std::string::npos) end = path.size();
      std::string candidate = path.substr(pos, end - pos);
      candidate += '/';
      candidate += tool;
      std::string link = dir;
      link += '/';
      link += tool;
      if (access(candidate.c_str(), X_OK) == 0 && symlink(candidate.c_str(), link.c_str()) == 0)
        break;
      pos = end + 1;
    }
  }
  return dir;
}

}  // namespace

// OpenMPI refuses to start when it finds no remote shell, even for a job on this machine only;
// the child jobs must not depend on one being installed.
TEST_F(ChildJob, StartsWithoutSshOrRshOnThePath) {
  if (!launcher()) return;
  const std::string dir = path_without_remote_shells();
  ASSERT_FALSE(dir.empty());
  ChildResult r = run_child("ok", "30", "PATH='" + dir + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output, "child ok: 3");
  for (const char* tool : {"/timeout", "/false"})
    unlink((dir + tool).c_str());
  rmdir(dir.c_str());
}

TEST_F(ChildJob, CollectiveTimeoutAbortsTheJob) {
  if (!launcher()) return;
  // Through the environment variable, as a user would set it.
  ChildResult r = run_child("timeout", "env", "TESSERA_COLLECTIVE_TIMEOUT=2");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output, "[rank 0] tessera: all_reduce(sum) float32 [4, 4]");
  TESSERA_EXPECT_CONTAINS(r.output, "on group 'stuck_group' (rank 0 of 2)");
  TESSERA_EXPECT_CONTAINS(r.output, "did not complete within the collective timeout of 2 s");
}

TEST_F(ChildJob, CollectiveTimeoutOnNcclAbortsTheCommunicatorThenTheJob) {
  if (!launcher()) return;
  ChildResult r = run_child("nccl_timeout", "2");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output, "[rank 0] tessera: all_reduce(sum) float32 [4, 4]");
  TESSERA_EXPECT_CONTAINS(r.output, "did not complete within the collective timeout of 2 s");
  TESSERA_EXPECT_CONTAINS(
      r.output, "aborted the NCCL communicator of group 'stuck_group' (rank 0 of 2, cuda:0, NCCL)");
}

TEST_F(ChildJob, UncaughtExceptionAbortsTheJob) {
  if (!launcher()) return;
  // A long collective timeout: only the terminate handler can end the job this early.
  ChildResult r = run_child("throw", "100");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output,
                          "[rank 1] tessera: uncaught exception: child rank 1 fails on purpose");
}

TEST_F(ChildJob, DebugMismatchFromTheEnvironmentAbortsTheJob) {
  if (!launcher()) return;
  ChildResult r = run_child("mismatch", "100", "TESSERA_DEBUG_COLLECTIVES=1");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
  TESSERA_EXPECT_CONTAINS(
      r.output, "tessera: uncaught exception: collective mismatch on group 'stuck_group'");
  TESSERA_EXPECT_CONTAINS(
      r.output, "rank 0: all_reduce(sum) float32 [4, 4]; rank 1: all_reduce(sum) float32 [4, 5]");
}

// A rank that calls exit() while the others wait in a collective ends the job at once, not at
// the collective timeout (set long here, as a safety net only), naming the rank that left.
TEST_F(ChildJob, EarlyExitEndsTheJobNamingTheRank) {
  if (!launcher()) return;
  ChildResult r = run_child("exit", "env", "TESSERA_COLLECTIVE_TIMEOUT=120");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output,
                          "[rank 0] tessera: all_reduce(sum) float32 [4, 4] on group "
                          "'stuck_group' (rank 0 of 2) cannot complete");
  TESSERA_EXPECT_CONTAINS(r.output,
                          "world rank 1 has left the job (it exited without calling "
                          "tessera::finalize()");
  TESSERA_EXPECT_CONTAINS(r.output, "having started 0 collectives on group 'stuck_group'");
  EXPECT_EQ(r.output.find("collective timeout"), std::string::npos) << r.output;
}

// A collective the backend refused before starting it (a device tensor to the MPI group) does
// not count as started: the rank that caught the error and ended is reported at once to the
// rank waiting in that collective, not after the collective timeout.
TEST_F(ChildJob, ACollectiveTheBackendRefusedDoesNotCountAsStarted) {
  if (!launcher()) return;
  ChildResult r = run_child("refused", "env", "TESSERA_COLLECTIVE_TIMEOUT=120");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output, "rank 1 caught:");
  TESSERA_EXPECT_CONTAINS(r.output,
                          "world rank 1 has left the job (it called tessera::finalize())");
  TESSERA_EXPECT_CONTAINS(r.output, "having started 0 collectives on group 'stuck_group'");
}

// The control: every rank ending through exit() after its last collective is a normal end.
TEST_F(ChildJob, ExitAfterTheLastCollectiveIsANormalEnd) {
  if (!launcher()) return;
  ChildResult r = run_child("exit_all", "env", "TESSERA_COLLECTIVE_TIMEOUT=120");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output, "child ok: 3");
}

// A rank that skips one of two identical all-reduces and then ends: the first pairs with its
// only one (nothing can tell them apart), and the second is named as never joined, with or
// without the debug check, instead of waiting for the timeout.
TEST_F(ChildJob, SkippedCollectiveEndsTheJobNamingTheRank) {
  for (const std::string debug : {"0", "1"}) {
    if (!launcher()) return;
    ChildResult r = run_child("skip", "env",
                              "TESSERA_COLLECTIVE_TIMEOUT=120 TESSERA_DEBUG_COLLECTIVES=" + debug);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_LT(r.seconds, 60) << r.output;
    TESSERA_EXPECT_CONTAINS(r.output,
                            "world rank 1 has left the job (it called tessera::finalize()) "
                            "having started 1 collective on group 'stuck_group', and this is "
                            "collective #2 there");
    if (debug == "1") {
      TESSERA_EXPECT_CONTAINS(r.output, "[rank 0] tessera: debug check before all_reduce(sum)");
    }
  }
}

// Without the debug check, shapes that differ surface as MPI's truncation on the rank that
// receives too much; that rank's message says what it means and how to find the culprit.
TEST_F(ChildJob, DifferentShapesWithoutTheDebugCheckSayWhatHappened) {
  if (!launcher()) return;
  ChildResult r = run_child("gather_shapes", "100");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output,
                          "[rank 0] tessera: uncaught exception: all_gather_into_tensor float32 "
                          "[2] -> [4] on group 'stuck_group' (rank 0 of 2) failed");
  TESSERA_EXPECT_CONTAINS(r.output,
                          "the ranks called this collective with different shapes or dtypes");
  TESSERA_EXPECT_CONTAINS(r.output, "TESSERA_DEBUG_COLLECTIVES=1");
}

// Broadcast roots that differ are what MPI cannot see (docs/comm.md): without the debug check
// each rank keeps its own value; with it every rank is told.
TEST_F(ChildJob, DifferentBroadcastRootsNeedTheDebugCheck) {
  if (!launcher()) return;
  ChildResult r = run_child("broadcast_roots", "100");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output, "rank 0 holds 1 after the broadcast");
  TESSERA_EXPECT_CONTAINS(r.output, "rank 1 holds 2 after the broadcast");
  r = run_child("broadcast_roots", "100", "TESSERA_DEBUG_COLLECTIVES=1");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output, "the ranks called different operations");
  TESSERA_EXPECT_CONTAINS(r.output, "rank 0: broadcast(root 0)");
  TESSERA_EXPECT_CONTAINS(r.output, "rank 1: broadcast(root 1)");
}

// A work whose wait() threw has told its caller: dropping it must not end the job, whether the
// progress thread found the error first, wait() or is_completed() found it itself, or the
// host-staged group's work wraps the failed one. Rank 0 catches MPI's truncation, and both ranks
// then all_reduce.
TEST_F(ChildJob, DroppingAWorkWhoseErrorWasCaughtKeepsTheJobGoing) {
  if (!launcher()) return;
  for (const std::string how : {"progress", "direct", "polled", "staged"}) {
    ChildResult r = run_child("failed_wait_" + how, "30");
    EXPECT_EQ(r.exit_code, 0) << how << ": " << r.output;
    TESSERA_EXPECT_CONTAINS(r.output, "rank 0 caught: [rank 0] all_gather_into_tensor float32");
    TESSERA_EXPECT_CONTAINS(r.output, "the ranks called this collective with different shapes");
    TESSERA_EXPECT_CONTAINS(r.output, "child ok: 3");
    EXPECT_EQ(r.output.find("destroyed before completion"), std::string::npos) << r.output;
  }
}

// A completed host-staged work that nobody waited for, dropped after tessera::finalize(): there
// is nothing left to communicate, and its destructor must not try (and end the job).
TEST_F(ChildJob, AWorkDroppedAfterFinalizeIsANormalEnd) {
  if (!launcher()) return;
  ChildResult r = run_child("work_past_finalize", "30");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  TESSERA_EXPECT_CONTAINS(r.output, "rank 0 finalized with an unwaited work");
  TESSERA_EXPECT_CONTAINS(r.output, "rank 1 finalized with an unwaited work");
}
