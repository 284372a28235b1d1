// Background progress: a Work handed to progress_in_background moves while its rank makes no
// MPI call at all, which is what lets FSDP's prefetch overlap communication with compute.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tessera/comm/comm.h"
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

}  // namespace
