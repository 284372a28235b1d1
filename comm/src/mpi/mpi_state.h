#pragma once
// Process-wide MPI state shared by the runtime and the MPI process groups (internal to comm/).
#include <mpi.h>

#include <mutex>
#include <string>

namespace tessera::mpi {

// True between tessera::init() and finalize(): the only window in which MPI may be called.
bool active();
// Every MPI call of this layer holds this lock. MPI_THREAD_SERIALIZED lets any thread call MPI
// but only one at a time, so the lock is what makes groups and works usable from several threads.
std::unique_lock<std::mutex> lock();
// Checks that this thread may call MPI now: initialised, not finalised, and on the initialising
// thread when MPI granted less than MPI_THREAD_SERIALIZED. `op` names the caller in the error.
void require_usable(const char* op);
// True when any thread may call MPI (under lock()): MPI granted at least MPI_THREAD_SERIALIZED.
bool threads_may_communicate();
// Throws a tessera::Error naming `call`, `context` and MPI's own text when rc != MPI_SUCCESS.
void check(int rc, const char* call, const std::string& context);
std::string error_string(int rc);

}  // namespace tessera::mpi
