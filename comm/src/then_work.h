#pragma once
// A Work that finishes with a step of its own: what a group built on another group's operations
// (the generic all_gather_runs, the host-staged group) returns.
#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <string>

#include "tessera/comm/process_group.h"
#include "tessera/comm/runtime.h"

namespace tessera::detail {

// A work that runs `then` once, on the thread that finds `inner` complete (wait() or
// is_completed()), before reporting completion. The progress thread only polls `inner`.
class ThenWork final : public Work {
 public:
  ThenWork(WorkPtr inner, std::function<void()> then)
      : inner_(std::move(inner)), then_(std::move(then)) {}
  ~ThenWork() override {
    // Like any work dropped unfinished: its step still runs (gathered pieces reach their places,
    // staged outputs their device tensors). One whose failure a caller already got is not
    // waited for again: that would throw it once more and end the job over a handled error.
    try {
      // After finalize() nothing can communicate: waiting would only fail, and end the job.
      if (done_ || failed_.load() || !is_initialized()) return;
      wait();
    } catch (const std::exception& e) {
      abort_job(std::string("a Work destroyed before completion failed: ") + e.what());
    }
  }
  void wait() override {
    try {
      inner_->wait();
    } catch (...) {
      failed_.store(true);
      throw;
    }
    finish();
  }
  bool is_completed() override {
    bool complete = false;
    try {
      complete = inner_->is_completed();
    } catch (...) {
      failed_.store(true);
      throw;
    }
    if (!complete) return false;
    finish();
    return true;
  }
  bool needs_polling() override { return inner_->needs_polling(); }
  bool poll() override { return inner_->poll(); }
  std::string abort() override { return inner_->abort(); }

 private:
  // A step that threw keeps its error: every later wait() or is_completed() throws it again,
  // as a failed operation does, rather than report a completion that never happened.
  void finish() {
    std::lock_guard<std::mutex> guard(mutex_);
    if (error_) std::rethrow_exception(error_);
    if (done_) return;
    done_ = true;
    auto fn = std::move(then_);
    try {
      fn();
    } catch (...) {
      error_ = std::current_exception();
      failed_.store(true);
      throw;
    }
  }
  WorkPtr inner_;
  std::function<void()> then_;
  std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr error_;         // what `then` threw
  std::atomic<bool> failed_{false};  // `inner` or `then` threw to a caller
};

}  // namespace tessera::detail
