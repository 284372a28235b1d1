#pragma once
// One NCCL communicator with the stream its operations run on, and the Work of one operation
// (internal to comm/). Shared by the group and its in-flight works, so that it outlives both.
//
// Ordering, as c10d's NCCL backend keeps it: an operation's stream first waits for an event
// recorded on the compute stream when the operation is issued (its inputs were written by kernels
// queued before), and the operation ends with an event recorded on its own stream. The work is
// complete when that event is: wait() blocks the host until then, so that whatever the caller
// queues afterwards, on any stream, sees the results. Steps that finish an operation (copying
// a staged output into the caller's tensor, dividing for Avg) are queued on the compute stream
// at completion, by the thread that finds the operation complete.
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "nccl_library.h"
#include "tessera/comm/process_group.h"

namespace tessera::detail {

struct NcclChannel {
  NcclLibrary& lib;
  NcclLibrary::Comm comm = nullptr;
  NcclLibrary::Stream stream = nullptr;
  NcclLibrary::Stream compute = nullptr;
  Device device;
  std::string group_name;
  int rank = 0;
  int size = 1;
  std::atomic<bool> aborted{false};

  NcclChannel(NcclLibrary& l, Device d, std::string name, int r, int n)
      : lib(l), device(d), group_name(std::move(name)), rank(r), size(n) {}
  ~NcclChannel();
  NcclChannel(const NcclChannel&) = delete;
  NcclChannel& operator=(const NcclChannel&) = delete;

  // "group 'tp' (rank 1 of 2, cuda:0, NCCL)": what every message of the backend names.
  std::string where() const;
  // Aborts the communicator once; later operations on the group fail saying so.
  void abort();
};
using NcclChannelPtr = std::shared_ptr<NcclChannel>;

class NcclWork final : public Work {
 public:
  // `what` names the operation ("all_reduce(sum) float32 [4]"); `done` is the event recorded
  // after it; `keep` holds the buffers it reads and writes; `then` finishes it.
  NcclWork(NcclChannelPtr channel, std::string what, NcclLibrary::Event done,
           std::vector<Tensor> keep, std::function<void()> then);
  // An unfinished work is waited for: NCCL may still write into the buffers it keeps.
  ~NcclWork() override;
  void wait() override;
  // Throws, naming the operation and group, when the communicator failed or was aborted.
  bool is_completed() override;
  std::string abort() override;

 private:
  NcclChannelPtr channel_;
  std::string what_;
  NcclLibrary::Event done_;
  std::vector<Tensor> keep_;
  std::function<void()> then_;
  std::mutex mutex_;
  bool finished_ = false;
};

}  // namespace tessera::detail
