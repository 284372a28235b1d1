#include "watched_work.h"

#include <chrono>
#include <cstdio>
#include <exception>

#include "backoff.h"
#include "departures.h"
#include "tessera/comm/runtime.h"

namespace tessera::detail {

namespace {

// Polls between two looks for ranks that left the job (a look is a probe of its own).
constexpr int kPollsPerDepartureLook = 16;
constexpr int kFirstDepartureLook = 64;

// Stops what the work still runs on a device before the job ends; "; <what it did>" for the
// message. A failure to stop must not keep the job from ending.
std::string stopped(Work& work) {
  try {
    const std::string what = work.abort();
    return what.empty() ? "" : "; " + what;
  } catch (const std::exception& e) {
    return std::string("; stopping its transfers failed too: ") + e.what();
  }
}

}  // namespace

std::string describe(const CallInfo& call, const GroupInfo& group) {
  return to_string(call) + " on group '" + group.name + "' (rank " + std::to_string(group.rank) +
         " of " + std::to_string(group.size) + ")";
}

void watched_wait(Work& work, const std::function<std::string()>& what, const GroupInfo& group,
                  int64_t seq) {
  const double timeout = collective_timeout_seconds();
  for (Backoff backoff; !work.is_completed(); backoff.pause()) {
    const int polls = backoff.polls();
    if (seq >= 0 && polls >= kFirstDepartureLook && polls % kPollsPerDepartureLook == 0) {
      const std::string gone = departed_before(group.id, group.world_ranks, group.name, seq);
      if (!gone.empty()) abort_job(what() + " cannot complete: " + gone + stopped(work));
    }
    if (std::chrono::duration<double>(backoff.waited()).count() > timeout) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%g s", timeout);
      abort_job(what() + " did not complete within the collective timeout of " + buf +
                ": a rank of the group has not called it, or called a different operation "
                "(TESSERA_DEBUG_COLLECTIVES=1 checks that every rank calls the same one; "
                "TESSERA_COLLECTIVE_TIMEOUT sets the timeout)" +
                stopped(work));
    }
  }
  work.wait();  // completed: reports nothing new, but keeps wait()'s contract for any backend
}

WatchedWork::~WatchedWork() {
  if (waited_.load() || !is_initialized()) return;
  try {
    wait();
  } catch (const std::exception& e) {
    // A destructor cannot report the failure to anyone.
    abort_job(std::string("a Work destroyed before completion failed: ") + e.what());
  }
}

bool WatchedWork::is_completed() {
  try {
    return inner_->is_completed();
  } catch (...) {
    // The caller has the failure; waiting again at destruction would only throw it once more.
    waited_.store(true);
    throw;
  }
}

void WatchedWork::wait() {
  waited_.store(true);
  watched_wait(
      *inner_, [this] { return describe(call_, *group_); }, *group_, call_.seq);
}

}  // namespace tessera::detail
