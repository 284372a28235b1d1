#include "watchdog.h"

#include <chrono>
#include <cstdio>

#include "fault.h"
#include "tessera/comm/agree.h"
#include "tessera/comm/runtime.h"

namespace tessera::ckpt {

Watchdog::Watchdog(std::string what) : what_(std::move(what)), step_("starting") {
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> g(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Watchdog::step(std::string name, bool armed) {
  {
    std::lock_guard<std::mutex> g(mutex_);
    step_ = std::move(name);
    armed_ = armed;
    ++generation_;
  }
  cv_.notify_all();
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    const uint64_t seen = generation_;
    if (!armed_) {
      cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      continue;
    }
    const auto limit = std::chrono::duration<double>(collective_timeout_seconds());
    const bool moved = cv_.wait_for(lock, limit, [&] { return stop_ || generation_ != seen; });
    if (moved) continue;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g s", collective_timeout_seconds());
    abort_job(what_ + ": step '" + step_ + "' did not finish within the collective timeout of " +
              buf + " (a rank failed or died before joining it; TESSERA_COLLECTIVE_TIMEOUT sets " +
              "the timeout)");
  }
}

Steps::Steps(ProcessGroupPtr pg, std::string context)
    : pg_(std::move(pg)), context_(std::move(context)), dog_(context_) {}

void Steps::run(const std::string& name, const std::function<void()>& f) {
  run_step(name, f, /*armed=*/true);
}

void Steps::run_local(const std::string& name, const std::function<void()>& f) {
  run_step(name, f, /*armed=*/false);
}

void Steps::run_step(const std::string& name, const std::function<void()>& f, bool armed) {
  dog_.step(name, armed);
  // Agreed twice: before the step, so that no rank enters its collective HDF5 calls while
  // another has already failed (it would wait inside them forever), and after it.
  std::string error;
  try {
    fault_point(name);
  } catch (...) {
    error = current_error_text();
  }
  agree(pg_, context_, error);
  try {
    f();
  } catch (...) {
    error = current_error_text();
  }
  agree(pg_, context_, error);
}

}  // namespace tessera::ckpt
