#pragma once
// A Work that finishes with a step of its own: what a group built on another group's operations
// (the generic all_gather_runs, the host-staged group) returns.
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
    // staged outputs their device tensors).
    try {
      if (!done_) wait();
    } catch (const std::exception& e) {
      abort_job(std::string("a Work destroyed before completion failed: ") + e.what());
    }
  }
  void wait() override {
    inner_->wait();
    finish();
  }
  bool is_completed() override {
    if (!inner_->is_completed()) return false;
    finish();
    return true;
  }
  bool needs_polling() override { return inner_->needs_polling(); }
  bool poll() override { return inner_->poll(); }
  std::string abort() override { return inner_->abort(); }

 private:
  void finish() {
    std::lock_guard<std::mutex> guard(mutex_);
    if (done_) return;
    done_ = true;
    auto fn = std::move(then_);
    fn();
  }
  WorkPtr inner_;
  std::function<void()> then_;
  std::mutex mutex_;
  bool done_ = false;
};

}  // namespace tessera::detail
