#pragma once
// What every checkpoint operation of the process shares (internal to checkpoint/): its own
// communicators, and the one asynchronous save that may be in flight.
#include <mpi.h>

#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/comm/process_group.h"

namespace tessera::ckpt {
struct SaveJob;
struct SaveFile;
}  // namespace tessera::ckpt

namespace tessera::ckpt {

struct Context {
  ProcessGroupPtr group;               // the main thread's collectives (agreement, descriptions)
  ProcessGroupPtr async_group;         // the background writer's
  MPI_Comm file_comm = MPI_COMM_NULL;  // parallel HDF5's
};
// Created by the first checkpoint operation, which is collective like every later one.
const Context& context();

// Every collective checkpoint operation starts here: finishes an asynchronous save in flight
// (collective), and throws its error if it failed and nobody waited for it.
void wait_for_pending_save();
// The inspection functions (one process, no communication) start here: waits for the writer
// thread of a save in flight, which uses HDF5, without finishing the save.
void wait_for_pending_writer();
// Makes `s` the save in flight (the caller finished the previous one).
void set_pending_save(std::shared_ptr<AsyncSave::State> s);

}  // namespace tessera::ckpt

namespace tessera {

// An asynchronous save (async_save.cpp): the writer thread adds up checksums and writes this
// rank's blocks with independent transfers, communicating with no one; everything collective
// (creating the file, the checksum table, closing, renaming) runs on the calling thread, at the
// call and at finish().
struct AsyncSave::State {
  std::string path;
  std::shared_ptr<ckpt::SaveJob> job;
  std::shared_ptr<ckpt::SaveFile> file;
  std::thread thread;
  std::string writer_error;  // this rank's writer's failure
  std::mutex mutex;
  bool joined = false, finished = false;
  std::exception_ptr error;  // the save's failure, the same on every rank
  bool error_reported = false;
  // Waits for this rank's writer thread. Local.
  void join_writer();
  // Agrees on the writers' outcome, then writes the checksum table, closes and renames the file
  // (or deletes it). Collective; once.
  void finish();
  ~State();
};

}  // namespace tessera
