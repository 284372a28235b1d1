#include "nccl_channel.h"

#include <exception>

#include "../backoff.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"

namespace tessera::detail {

NcclChannel::~NcclChannel() {
  // An aborted communicator is gone already; destroying it again would fail.
  if (comm && !aborted.load()) lib.destroy(comm);
  if (stream) lib.destroy_stream(stream);
}

std::string NcclChannel::where() const {
  return "group '" + group_name + "' (rank " + std::to_string(rank) + " of " +
         std::to_string(size) + ", " + device.str() + ", NCCL)";
}

void NcclChannel::abort() {
  if (aborted.exchange(true)) return;
  lib.abort(comm);
}

NcclWork::NcclWork(NcclChannelPtr channel, std::string what, NcclLibrary::Event done,
                   std::vector<Tensor> keep, std::function<void()> then)
    : channel_(std::move(channel)),
      what_(std::move(what)),
      done_(done),
      keep_(std::move(keep)),
      then_(std::move(then)) {}

NcclWork::~NcclWork() {
  if (!finished_ && !channel_->aborted.load() && is_initialized()) {
    try {
      wait();
    } catch (const std::exception& e) {
      abort_job(std::string("a Work destroyed before completion failed: ") + e.what());
    }
  }
  channel_->lib.destroy_event(done_);
}

bool NcclWork::is_completed() {
  std::lock_guard<std::mutex> guard(mutex_);
  if (finished_) return true;
  NcclChannel& ch = *channel_;
  TESSERA_CHECK(!ch.aborted.load(), what_, " on ", ch.where(),
                " cannot complete: the group's communicator was aborted");
  const std::string failed = ch.lib.async_error(ch.comm);
  if (!failed.empty()) {
    // NCCL's rule after an asynchronous error: abort the communicator; the group is unusable.
    ch.abort();
    TESSERA_FAIL(what_, " on ", ch.where(), " failed: ", failed,
                 " (the communicator was aborted; make a new group)");
  }
  if (!ch.lib.event_done(done_)) return false;
  finished_ = true;
  keep_.clear();
  if (then_) {
    auto fn = std::move(then_);
    fn();
  }
  return true;
}

void NcclWork::wait() {
  for (Backoff backoff; !is_completed(); backoff.pause()) {
  }
}

std::string NcclWork::abort() {
  channel_->abort();
  return "aborted the NCCL communicator of " + channel_->where();
}

}  // namespace tessera::detail
