#pragma once
// Turns a stuck HDF5 call into an abort with a message (internal to checkpoint/). tessera's own
// collectives time out by themselves; the MPI-IO calls inside HDF5 block without a limit, and a
// rank that never joins one (it died, or failed before it) would leave the others waiting
// forever. Each step of a file operation restarts the clock; one step that outlasts the
// collective timeout aborts the job, naming the file, the step and the rank.
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace tessera::ckpt {

class Watchdog {
 public:
  explicit Watchdog(std::string what);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  // Names the step about to run and restarts the clock.
  void step(std::string name);

 private:
  void run();
  std::string what_, step_;
  std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tessera::ckpt
