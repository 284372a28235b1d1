#include "work.h"

#include <exception>

#include "../backoff.h"
#include "mpi_state.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"

namespace tessera::mpi {

Communicator::Communicator(MPI_Comm c, std::string name) : comm(c), group_name(std::move(name)) {
  auto guard = lock();
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
}

Communicator::~Communicator() {
  if (comm == MPI_COMM_NULL || !active()) return;
  auto guard = lock();
  MPI_Comm_free(&comm);
}

std::string describe(const CallInfo& call, const Communicator& comm) {
  return to_string(call) + " on group '" + comm.group_name + "' (rank " +
         std::to_string(comm.rank) + " of " + std::to_string(comm.size) + ")";
}

namespace {

bool is_truncation(int rc) {
  int cls = rc;
  MPI_Error_class(rc, &cls);
  return cls == MPI_ERR_TRUNCATE;
}

// MPI's texts for the failed requests; `truncated` tells whether one was a truncation.
std::string status_errors(const std::vector<MPI_Status>& statuses, bool& truncated) {
  std::string s;
  for (const MPI_Status& st : statuses) {
    if (st.MPI_ERROR == MPI_SUCCESS || st.MPI_ERROR == MPI_ERR_PENDING) continue;
    if (!s.empty()) s += "; ";
    s += error_string(st.MPI_ERROR);
    truncated = truncated || is_truncation(st.MPI_ERROR);
  }
  return s;
}

[[noreturn]] void fail(const std::string& what, const std::string& mpi_text, bool truncated) {
  // MPI only notices data longer than the receiving side expects; without the debug check this
  // is how ranks that pass different shapes or dtypes to one collective usually surface.
  TESSERA_CHECK(!truncated, what, " failed: ", mpi_text,
                ": another rank of the group sent more data than this rank's tensors hold, so "
                "the ranks called this collective with different shapes or dtypes (or called "
                "different collectives); TESSERA_DEBUG_COLLECTIVES=1 compares every rank's call "
                "before any data moves");
  TESSERA_FAIL(what, " failed: ", mpi_text);
}

}  // namespace

bool test_all(std::vector<MPI_Request>& requests, std::vector<MPI_Status>& statuses,
              const std::function<std::string()>& what) {
  statuses.resize(requests.size());
  int flag = 0;
  int rc;
  {
    auto guard = lock();
    rc = MPI_Testall(int(requests.size()), requests.data(), &flag, statuses.data());
  }
  if (rc == MPI_SUCCESS) return flag != 0;
  bool truncated = false;
  if (rc == MPI_ERR_IN_STATUS) {
    const std::string text = status_errors(statuses, truncated);
    fail(what(), text, truncated);
  }
  fail(what(), "MPI_Testall: " + error_string(rc), is_truncation(rc));
}

void wait_all(std::vector<MPI_Request>& requests, std::vector<MPI_Status>& statuses,
              const std::function<std::string()>& what) {
  for (detail::Backoff backoff; !test_all(requests, statuses, what);)
    backoff.pause();
}

MpiWork::MpiWork(CommunicatorPtr comm, CallInfo call)
    : comm_(std::move(comm)), call_(std::move(call)) {
  requests_.reserve(1);
}

MpiWork::~MpiWork() {
  std::lock_guard<std::mutex> guard(mutex_);
  // A failure thrown to a caller was handled there; ending the job over it again would punish
  // the caller for catching it.
  if (done_ || error_reported_ || !active()) return;
  // Freeing the buffers now would let MPI write into released memory; and a caller that drops
  // the work without waiting still gets its staged outputs copied back.
  try {
    if (error_) std::rethrow_exception(error_);
    finish_requests();
    complete();
  } catch (const std::exception& e) {
    // A destructor cannot report the failure to anyone.
    abort_job(std::string("a Work destroyed before completion failed: ") + e.what());
  }
}

MPI_Request* MpiWork::new_request() {
  requests_.push_back(MPI_REQUEST_NULL);
  return &requests_.back();
}

void MpiWork::then(Completion fn) {
  if (!completion_) {
    completion_ = std::move(fn);
    return;
  }
  completion_ = [first = std::move(completion_),
                 second = std::move(fn)](const std::vector<MPI_Status>& statuses) {
    first(statuses);
    second(statuses);
  };
}

std::string MpiWork::what() const {
  return describe(call_, *comm_);
}

// A completion step that throws (a receive that got fewer elements than its tensor holds)
// leaves its error behind: later wait()s and is_completed()s throw it again instead of
// reporting a completion whose outputs were never written.
void MpiWork::complete() {
  done_ = true;
  Completion fn = std::move(completion_);
  completion_ = nullptr;
  try {
    if (fn) fn(statuses_);
  } catch (...) {
    error_ = std::current_exception();
    error_reported_ = true;
    keep_alive_.clear();
    throw;
  }
  keep_alive_.clear();
}

void MpiWork::finish_requests() {
  if (requests_done_) return;
  wait_all(requests_, statuses_, [this] { return what(); });
  requests_done_ = true;
}

bool MpiWork::finish_or_throw(bool block) {
  if (!error_ && !requests_done_) {
    try {
      if (block) {
        finish_requests();
      } else {
        requests_done_ = test_all(requests_, statuses_, [this] { return what(); });
      }
    } catch (...) {
      error_ = std::current_exception();
    }
  }
  if (error_) {
    error_reported_ = true;
    std::rethrow_exception(error_);
  }
  return requests_done_;
}

void MpiWork::wait() {
  std::lock_guard<std::mutex> guard(mutex_);
  if (done_ && error_) std::rethrow_exception(error_);
  if (done_) return;
  require_usable(op_kind_name(call_.op));
  finish_or_throw(true);
  complete();
}

bool MpiWork::is_completed() {
  std::lock_guard<std::mutex> guard(mutex_);
  if (done_ && error_) std::rethrow_exception(error_);
  if (done_) return true;
  require_usable(op_kind_name(call_.op));
  if (!finish_or_throw(false)) return false;
  complete();
  return true;
}

bool MpiWork::poll() {
  std::unique_lock<std::mutex> guard(mutex_, std::try_to_lock);
  // A waiter holds the lock and polls the requests itself; look again next round.
  if (!guard.owns_lock()) return false;
  if (done_ || requests_done_ || error_) return true;
  if (!active()) return true;
  try {
    requests_done_ = test_all(requests_, statuses_, [this] { return what(); });
  } catch (...) {
    error_ = std::current_exception();
    return true;
  }
  return requests_done_;
}

bool MpiWork::needs_polling() {
  if (!active() || !threads_may_communicate()) return false;
  std::lock_guard<std::mutex> guard(mutex_);
  return !(done_ || requests_done_ || error_);
}

}  // namespace tessera::mpi
