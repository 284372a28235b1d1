#pragma once
// Turns a stuck HDF5 call into an abort with a message (internal to checkpoint/). tessera's own
// collectives time out by themselves; the MPI-IO calls inside HDF5 block without a limit, and a
// rank that never joins one (it died, or failed before it) would leave the others waiting
// forever. Each step of a file operation restarts the clock; one step that outlasts the
// collective timeout aborts the job, naming the file, the step and the rank.
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "tessera/comm/process_group.h"

namespace tessera::ckpt {

class Watchdog {
 public:
  explicit Watchdog(std::string what);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  // Names the step about to run and restarts the clock; an unarmed step has no time limit.
  void step(std::string name, bool armed = true);

 private:
  void run();
  std::string what_, step_;
  std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  bool armed_ = true;
  bool stop_ = false;
  std::thread thread_;
};

// The steps of a collective file operation. Each runs on every rank under the watchdog, between
// two agreements (agree.h), so a failure on one rank stops every rank at the same step, with the
// same error, instead of leaving the others inside a collective HDF5 call. (A step's body must
// not fail on one rank before reaching its collective calls; the calls themselves return on
// every rank.)
class Steps {
 public:
  Steps(ProcessGroupPtr pg, std::string context);
  void run(const std::string& name, const std::function<void()>& f);
  // A step whose body makes no collective call (reading with no MPI-IO collective): it cannot
  // wait on another rank, so it runs with no time limit; only slow storage makes it long.
  void run_local(const std::string& name, const std::function<void()>& f);

 private:
  void run_step(const std::string& name, const std::function<void()>& f, bool armed);

  ProcessGroupPtr pg_;
  std::string context_;
  Watchdog dog_;
};

}  // namespace tessera::ckpt
