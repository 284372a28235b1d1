#pragma once
// Joining the job. Under mpirun (or srun) the process joins the MPI world; started alone it is a
// world of one rank. Uncaught exceptions after init print their message and abort every rank.
#include <functional>

#include "tessera/comm/process_group.h"

namespace tessera {

// Idempotent. Reads TESSERA_COLLECTIVE_TIMEOUT (seconds) and TESSERA_DEBUG_COLLECTIVES (1/0).
// Starts MPI (MPI_THREAD_SERIALIZED: any thread may communicate, tessera serialises the calls)
// unless the application already did, in which case the application also finalizes it.
void init(int* argc = nullptr, char*** argv = nullptr);
// Idempotent, and run at exit when the program did not call it. MPI cannot start again after.
// When tessera started MPI, this is collective: it tells the other ranks how many collectives
// this rank started on each group (so that one waiting for a collective this rank never started
// aborts the job at once, naming this rank) and waits until every rank has finalized.
void finalize();
bool is_initialized();  // between init() and finalize()

// These need init(); they throw before it and after finalize().
int world_rank();
int world_size();
ProcessGroupPtr world_group();

// RAII form of init/finalize for main().
class Runtime {
 public:
  Runtime(int& argc, char**& argv) { init(&argc, &argv); }
  Runtime() { init(); }
  ~Runtime() { finalize(); }
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
};

// Prints `what` with the rank and aborts every rank of the job (MPI_Abort); never returns.
[[noreturn]] void abort_job(const std::string& what);

// Collective timeout in seconds (default 300), settable for tests.
double collective_timeout_seconds();
void set_collective_timeout_seconds(double seconds);
// When on, every collective first checks that all ranks of the group call the same op with the
// same shapes and dtypes.
bool debug_collectives();
void set_debug_collectives(bool on);

namespace detail {
// Runs `hook` when finalize() starts (called, by ~Runtime, or at exit), while communication
// still works, the hooks registered last first: a layer above comm finishes its collective work
// there (a checkpoint save still in flight). A hook that throws aborts the job with its message:
// nobody is left to catch it.
void at_finalize(std::function<void()> hook);
}  // namespace detail

}  // namespace tessera
