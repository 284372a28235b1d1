#include "tessera/comm/mpi_interop.h"

#include "mpi_state.h"

namespace tessera {

MpiCallGuard::MpiCallGuard() : lock_(mpi::lock()) {}

MPI_Comm duplicate_world_communicator() {
  mpi::require_usable("duplicate_world_communicator");
  MPI_Comm dup = MPI_COMM_NULL;
  auto guard = mpi::lock();
  mpi::check(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "MPI_Comm_dup", "duplicate_world_communicator");
  return dup;
}

}  // namespace tessera
