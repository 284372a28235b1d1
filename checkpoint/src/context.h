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

struct Context {
  ProcessGroupPtr group;               // the main thread's collectives (agreement, descriptions)
  ProcessGroupPtr async_group;         // the background writer's
  MPI_Comm file_comm = MPI_COMM_NULL;  // parallel HDF5's
};
// Created by the first checkpoint operation, which is collective like every later one.
const Context& context();

// Every checkpoint operation starts here: waits for an asynchronous save in flight, and
// rethrows its error if it failed and nobody waited for it.
void wait_for_pending_save();
// Makes `s` the save in flight (the caller waited for the previous one).
void set_pending_save(std::shared_ptr<AsyncSave::State> s);

}  // namespace tessera::ckpt

namespace tessera {

struct AsyncSave::State {
  std::string path;
  std::thread thread;
  std::mutex mutex;
  bool joined = false;
  std::exception_ptr error;
  bool error_reported = false;
  // Joins the writer once; true when it had failed.
  bool join();
  ~State() { join(); }
};

}  // namespace tessera
