// Background progress: a Work handed to progress_in_background moves while its rank makes no
// MPI call at all, which is what lets FSDP's prefetch overlap communication with compute.
#include <gtest/gtest.h>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tessera/comm/comm.h"
#include "tessera/comm/detail/progress_cpus.h"
#include "tessera/core/core.h"

using namespace tessera;

namespace {

namespace fs = std::filesystem;

Tensor rank_filled(int64_t n, int rank) {
  return full(Shape{n}, double(rank + 1), DType::Float32);
}

// A folder every rank of this job names alike (from rank 0's process id), for signals that must
// not go through MPI.
fs::path job_folder(const ProcessGroupPtr& pg) {
  Tensor id = full(Shape{1}, pg->rank() == 0 ? double(getpid()) : 0.0, DType::Float64);
  pg->broadcast(id, 0)->wait();
  const fs::path dir = fs::temp_directory_path() /
                       ("tessera_progress_" + std::to_string(int64_t(id.to_vector<double>()[0])));
  if (pg->rank() == 0) fs::create_directories(dir);
  pg->barrier()->wait();
  return dir;
}

// The ring all-reduce runs in rounds, and a round starts only when every rank has progressed the
// previous one. The last rank makes no MPI call after issuing it until the others have finished
// theirs, which they tell it through files: they can finish only if its progress thread moves its
// rounds. Nothing is timed; the limit below only turns a broken progress thread into a failure
// instead of a hang.
TEST(BackgroundProgress, CollectiveCompletesWhileARankMakesNoMpiCall) {
  ProcessGroupPtr pg = world_group();
  if (pg->size() < 2) GTEST_SKIP() << "needs a peer";
  constexpr auto kGiveUp = std::chrono::seconds(120);
  const fs::path dir = job_folder(pg);
  const int64_t n = 1 << 20;  // 4 MiB: several rounds, beyond the eager limit
  Tensor t = rank_filled(n, pg->rank());
  WorkPtr work = pg->all_reduce(t, ReduceOp::Avg);
  progress_in_background(work);
  if (pg->rank() == pg->size() - 1) {
    const auto give_up = std::chrono::steady_clock::now() + kGiveUp;
    int finished = 0;
    while (finished < pg->size() - 1 && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      finished = 0;
      for (int r = 0; r + 1 < pg->size(); ++r)
        finished += fs::exists(dir / ("done." + std::to_string(r)));
    }
    EXPECT_EQ(finished, pg->size() - 1)
        << "the others' all-reduce did not complete while this rank made no MPI call";
    work->wait();
  } else {
    work->wait();
    std::ofstream(dir / ("done." + std::to_string(pg->rank()))) << "done\n";
  }
  // The completion step (dividing for Avg) still ran, on this thread.
  const double expected = double(pg->size() + 1) / 2.0;
  const std::vector<float> v = t.to_vector<float>();
  EXPECT_FLOAT_EQ(v.front(), float(expected));
  EXPECT_FLOAT_EQ(v.back(), float(expected));
  pg->barrier()->wait();
  if (pg->rank() == 0) fs::remove_all(dir);
}

TEST(BackgroundProgress, WorksMayBeWaitedDroppedOrAlreadyComplete) {
  ProcessGroupPtr pg = world_group();
  for (int round = 0; round < 3; ++round) {
    Tensor out = empty(Shape{int64_t(pg->size()) * 4096}, DType::Float32);
    Tensor in = rank_filled(4096, pg->rank());
    WorkPtr gather = pg->all_gather_into_tensor(out, in);
    progress_in_background(gather);
    progress_in_background(gather);  // twice is harmless
    Tensor dropped = rank_filled(1024, pg->rank());
    {
      // Dropped without wait(): its destructor (on whichever thread holds it last) waits for it
      // and still writes the result.
      WorkPtr w = pg->all_reduce(dropped, ReduceOp::Sum);
      progress_in_background(w);
    }
    gather->wait();
    progress_in_background(gather);  // completed: no-op
    for (int r = 0; r < pg->size(); ++r)
      EXPECT_FLOAT_EQ(out.to_vector<float>()[size_t(r) * 4096 + 17], float(r + 1));
    EXPECT_FLOAT_EQ(dropped.to_vector<float>()[3], float(pg->size() * (pg->size() + 1) / 2));
  }
}

using detail::CpuList;

TEST(ProgressPlacement, CpuListsReadAndWriteTheKernelsFormat) {
  EXPECT_EQ(detail::parse_cpu_list("0-3,8,10-11\n", "t"), (CpuList{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(detail::parse_cpu_list("5", "t"), (CpuList{5}));
  EXPECT_EQ(detail::parse_cpu_list("3,1-2,2", "t"), (CpuList{1, 2, 3}));
  EXPECT_EQ(detail::format_cpu_list({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(detail::format_cpu_list({}), "");
  for (const char* bad : {"3-1", "a", "1,", ",1", "1--2", "-1", "1;2"}) {
    try {
      detail::parse_cpu_list(bad, "Cpus_allowed_list");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("Cpus_allowed_list: '") + bad + "'"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(ProgressPlacement, ThreadsGetTheCpusNoRankIsBoundTo) {
  const CpuList sixteen = detail::parse_cpu_list("0-15", "t");
  // Two ranks bound to a core each (Open MPI's default for 2 ranks): a block of the rest each.
  const std::vector<CpuList> two_bound = {{0}, {1}};
  EXPECT_EQ(detail::progress_cpus_for(two_bound, 0, sixteen), detail::parse_cpu_list("2-8", "t"));
  EXPECT_EQ(detail::progress_cpus_for(two_bound, 1, sixteen), detail::parse_cpu_list("9-15", "t"));
  // Ranks not bound, or bound to every CPU between them: nothing is spare.
  EXPECT_EQ(detail::progress_cpus_for({sixteen, sixteen}, 0, sixteen), CpuList{});
  EXPECT_EQ(detail::progress_cpus_for({{0, 1}, {2, 3}}, 1, {0, 1, 2, 3}), CpuList{});
  // Fewer spare CPUs than ranks: one each, taking turns.
  const std::vector<CpuList> three = {{0}, {1}, {2}};
  EXPECT_EQ(detail::progress_cpus_for(three, 0, {0, 1, 2, 3, 4}), CpuList{3});
  EXPECT_EQ(detail::progress_cpus_for(three, 1, {0, 1, 2, 3, 4}), CpuList{4});
  EXPECT_EQ(detail::progress_cpus_for(three, 2, {0, 1, 2, 3, 4}), CpuList{3});
  // Two ranks sharing CPU 0 of a 2-CPU machine: both threads on CPU 1.
  EXPECT_EQ(detail::progress_cpus_for({{0}, {0}}, 1, {0, 1}), CpuList{1});
  // The job's CPUs unknown: the thread stays.
  EXPECT_EQ(detail::progress_cpus_for(two_bound, 0, {}), CpuList{});
}

CpuList own_affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  CpuList cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

// Wherever the launcher put the ranks, the progress thread runs where init planned, and never on
// a CPU its rank is bound to unless it stays on the rank's own. Registered once more with both
// ranks bound to CPU 0 (TESSERA_TEST_RANKS_BOUND_TO=0), where a second CPU must take the threads.
TEST(ProgressPlacement, ThreadRunsOnThePlannedCpus) {
  ProcessGroupPtr pg = world_group();
  const CpuList planned = detail::planned_progress_cpus();
  const CpuList mine = own_affinity();
  for (int c : planned)
    EXPECT_FALSE(std::binary_search(mine.begin(), mine.end(), c))
        << "planned CPU " << c << " is one this rank is bound to (" << detail::format_cpu_list(mine)
        << ")";
  if (const char* bound = std::getenv("TESSERA_TEST_RANKS_BOUND_TO")) {
    ASSERT_EQ(detail::format_cpu_list(mine), bound) << "the launcher did not bind as asked";
    const CpuList online = detail::parse_cpu_list(
        [] {
          std::ifstream in("/sys/devices/system/cpu/online");
          std::string t;
          std::getline(in, t);
          return t;
        }(),
        "online");
    if (online.size() < 2) GTEST_SKIP() << "one CPU online: none can be spare";
    EXPECT_FALSE(planned.empty()) << "ranks bound to CPU " << bound << " of "
                                  << detail::format_cpu_list(online)
                                  << ", yet their progress threads stay there";
  }
  if (pg->size() < 2) return;  // the thread starts with the first work that needs polling
  Tensor t = rank_filled(1 << 18, pg->rank());
  WorkPtr work = pg->all_reduce(t, ReduceOp::Sum);
  progress_in_background(work);
  work->wait();
  EXPECT_EQ(detail::format_cpu_list(progress_stats().cpus), detail::format_cpu_list(planned));
}

}  // namespace
