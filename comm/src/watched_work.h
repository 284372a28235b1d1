#pragma once
// The timeout watchdog any backend's work gets from CheckedProcessGroup (internal to comm/).
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "call_info.h"
#include "tessera/comm/process_group.h"

namespace tessera::detail {

// A checked group as its messages and the departure protocol name it.
struct GroupInfo {
  std::string name;
  int rank = 0;
  int size = 1;
  uint64_t id = 0;               // the same on every member (departures.h)
  std::vector<int> world_ranks;  // of the members, in group-rank order
  // Collectives this rank has started on the group; the next one's position (CallInfo::seq).
  std::shared_ptr<std::atomic<int64_t>> started;
};
using GroupInfoPtr = std::shared_ptr<const GroupInfo>;

// "all_reduce(sum) float32 [4] on group 'world' (rank 1 of 2)".
std::string describe(const CallInfo& call, const GroupInfo& group);

// Waits for `work` by polling is_completed() (backoff.h). After collective_timeout_seconds() it
// aborts the job naming what(); sooner when a member of `group` left the job without starting
// the collective number `seq` (>= 0).
void watched_wait(Work& work, const std::function<std::string()>& what, const GroupInfo& group,
                  int64_t seq);

// A backend's work behind the watchdog: wait() is watched_wait(); the rest is the backend's.
class WatchedWork final : public Work {
 public:
  WatchedWork(WorkPtr inner, CallInfo call, GroupInfoPtr group)
      : inner_(std::move(inner)), call_(std::move(call)), group_(std::move(group)) {}
  // A work dropped without a wait() is waited for, under the watchdog, before the backend's own
  // destructor (which waits without one) runs. One whose wait() was called, or whose
  // is_completed() threw, is the backend's to end.
  ~WatchedWork() override;
  void wait() override;
  bool is_completed() override;
  bool needs_polling() override { return inner_->needs_polling(); }
  bool poll() override { return inner_->poll(); }
  std::string abort() override { return inner_->abort(); }

 private:
  WorkPtr inner_;
  CallInfo call_;
  GroupInfoPtr group_;
  std::atomic<bool> waited_{false};  // or a failure was thrown to the caller
};

}  // namespace tessera::detail
