#pragma once
// How a thread waits for communication that moves only while it is polled (internal to comm/).
//
// A backend may move its transfers only inside its own calls (MPI), so a waiter keeps polling:
// each round of a large collective waits for the next poll. Spinning first costs nothing when no
// other rank wants the core; yielding hands the core over when ranks outnumber cores; only a wait
// long enough to be a stalled or much slower rank sleeps between polls.
#include <chrono>
#include <thread>

namespace tessera::detail {

class Backoff {
 public:
  using Clock = std::chrono::steady_clock;

  // Call after each unsuccessful poll.
  void pause() {
    if (++polls_ <= kSpinPolls) return;
    if (waited() < kYieldPhase) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kSleep);
    }
  }
  int polls() const { return polls_; }
  Clock::duration waited() const { return Clock::now() - start_; }

 private:
  static constexpr int kSpinPolls = 64;
  static constexpr std::chrono::milliseconds kYieldPhase{1000};
  static constexpr std::chrono::microseconds kSleep{500};

  Clock::time_point start_ = Clock::now();
  int polls_ = 0;
};

}  // namespace tessera::detail
