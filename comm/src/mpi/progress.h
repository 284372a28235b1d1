#pragma once
// The progress thread behind tessera::progress_in_background (internal to comm/).
namespace tessera::mpi {

// Stops and joins the progress thread, if it runs. finalize() calls it before MPI_Finalize, so
// that no thread is inside MPI when MPI ends.
void stop_progress();

}  // namespace tessera::mpi
