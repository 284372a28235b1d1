// Background progress: a Work handed to progress_in_background moves while its rank makes no
// MPI call at all, which is what lets FSDP's prefetch overlap communication with compute.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "tessera/comm/comm.h"
#include "tessera/core/core.h"

using namespace tessera;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

Tensor rank_filled(int64_t n, int rank) {
  return full(Shape{n}, double(rank + 1), DType::Float32);
}

// The ring all-reduce runs in rounds, and a round starts only when every rank has progressed the
// previous one. The last rank sleeps without calling MPI right after issuing it: the others can
// finish long before it wakes only if its progress thread moves its rounds.
TEST(BackgroundProgress, CollectiveCompletesWhileARankMakesNoMpiCall) {
  ProcessGroupPtr pg = world_group();
  if (pg->size() < 2) GTEST_SKIP() << "needs a peer";
  constexpr double kSleep = 3.0;
  const int64_t n = 1 << 20;  // 4 MiB: several rounds, beyond the eager limit
  Tensor t = rank_filled(n, pg->rank());
  pg->barrier()->wait();
  const Clock::time_point start = Clock::now();
  WorkPtr work = pg->all_reduce(t, ReduceOp::Avg);
  progress_in_background(work);
  if (pg->rank() == pg->size() - 1) {
    std::this_thread::sleep_for(std::chrono::duration<double>(kSleep));
    work->wait();
  } else {
    work->wait();
    const double waited = seconds_since(start);
    EXPECT_LT(waited, kSleep / 2) << "the all-reduce waited for the sleeping rank's own MPI calls";
  }
  // The completion step (dividing for Avg) still ran, on this thread.
  const double expected = double(pg->size() + 1) / 2.0;
  const std::vector<float> v = t.to_vector<float>();
  EXPECT_FLOAT_EQ(v.front(), float(expected));
  EXPECT_FLOAT_EQ(v.back(), float(expected));
  pg->barrier()->wait();
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
