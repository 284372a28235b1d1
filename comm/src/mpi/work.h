#pragma once
// The Work of an MPI operation: its requests, the buffers MPI reads and writes until they
// complete, and what to do afterwards (divide for Avg, copy staged results into the caller's
// tensors). Waiting polls, so a collective that never completes aborts the job with a message
// instead of hanging.
#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../call_info.h"
#include "tessera/comm/process_group.h"

namespace tessera::mpi {

using detail::CallInfo;
using detail::op_kind_name;
using detail::OpKind;
using detail::tensor_call;
using detail::to_string;

// One group's communicator. Shared by the group and its in-flight works, so that it outlives
// both; freed on destruction unless MPI has been finalised already.
struct Communicator {
  MPI_Comm comm = MPI_COMM_NULL;
  std::string group_name;
  int rank = 0;
  int size = 1;

  Communicator(MPI_Comm c, std::string name);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
};
using CommunicatorPtr = std::shared_ptr<const Communicator>;

// "all_reduce(sum) float32 [4] on group 'world' (rank 1 of 2)".
std::string describe(const CallInfo& call, const Communicator& comm);

// Polls `requests` to completion (backoff.h). No timeout: waits that may never end are the
// wrapper's (watched_work.h), which polls is_completed() under the collective timeout before it
// calls wait().
void wait_all(std::vector<MPI_Request>& requests, std::vector<MPI_Status>& statuses,
              const std::function<std::string()>& what);
// One non-blocking poll; true when all completed. Throws on MPI errors.
bool test_all(std::vector<MPI_Request>& requests, std::vector<MPI_Status>& statuses,
              const std::function<std::string()>& what);

class MpiWork final : public Work {
 public:
  using Completion = std::function<void(const std::vector<MPI_Status>&)>;

  MpiWork(CommunicatorPtr comm, CallInfo call);
  // Waits for pending requests: MPI may still write into buffers this work keeps alive. Ends the
  // job over an error only when wait() or is_completed() has not thrown it to a caller yet.
  ~MpiWork() override;

  // Setup, before the work is returned: the slot for the next request, buffers to keep alive,
  // and the steps run once after completion.
  MPI_Request* new_request();
  void keep_alive(Tensor t) { keep_alive_.push_back(std::move(t)); }
  // Steps given by several calls run in the order given.
  void then(Completion fn);

  void wait() override;
  bool is_completed() override;

  // True while the transfers are pending and another thread may call MPI (MPI granted at least
  // MPI_THREAD_SERIALIZED): then the progress thread's polls move them.
  bool needs_polling() override;
  // Tests the requests unless another thread is already waiting on this work.
  bool poll() override;

 private:
  // Completes the requests, unless the progress thread already did (its statuses are kept).
  void finish_requests();
  void complete();
  // Finishes the requests as wait() and is_completed() do: true once done; an error (found now
  // or by the progress thread) is kept, marked as reported, and thrown.
  bool finish_or_throw(bool block);
  std::string what() const;

  CommunicatorPtr comm_;
  CallInfo call_;
  std::vector<MPI_Request> requests_;
  std::vector<MPI_Status> statuses_;
  std::vector<Tensor> keep_alive_;
  Completion completion_;
  std::mutex mutex_;
  bool requests_done_ = false;
  // The requests' failure (its one request completed with an error, so MPI no longer touches
  // the buffers); thrown by every later wait() and is_completed().
  std::exception_ptr error_;
  bool error_reported_ = false;  // a caller got it: the destructor need not end the job
  bool done_ = false;
};

}  // namespace tessera::mpi
