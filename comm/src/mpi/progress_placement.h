#pragma once
// Internal to comm/: the progress thread's CPUs, chosen at init (detail/progress_cpus.h).
namespace tessera::mpi {

// Collective over MPI_COMM_WORLD, run by tessera::init: every rank shares its affinity with the
// ranks on its node; with `automatic` (TESSERA_PROGRESS_CPUS=auto) this rank's progress thread
// will run on its share of the CPUs no rank is bound to.
void place_progress_thread(bool automatic);

}  // namespace tessera::mpi
