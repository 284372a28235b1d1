#pragma once
// For libraries that make MPI calls of their own next to tessera's (parallel HDF5 in checkpoint/).
// tessera runs MPI at MPI_THREAD_SERIALIZED, and its progress thread may be inside MPI at any
// moment, so every such call must be made while holding an MpiCallGuard. Such a library also
// needs a communicator of its own, so that its traffic can never match a tessera collective.
#include <mpi.h>

#include <mutex>

namespace tessera {

// Holds the lock that serialises every MPI call of the process. Never hold it across a tessera
// collective (a Work's wait() takes it too): take it around each foreign call instead. A call
// that blocks in MPI while holding it (a collective file write) stalls this process's other
// communication until it returns, but cannot deadlock as long as every rank's blocking calls
// are the ones the others are also making.
class MpiCallGuard {
 public:
  MpiCallGuard();
  MpiCallGuard(const MpiCallGuard&) = delete;
  MpiCallGuard& operator=(const MpiCallGuard&) = delete;

 private:
  std::unique_lock<std::mutex> lock_;
};

// A duplicate of MPI_COMM_WORLD owned by the caller, who frees it (under an MpiCallGuard, before
// tessera::finalize()). Collective over every world rank; needs tessera::init().
MPI_Comm duplicate_world_communicator();

}  // namespace tessera
