#pragma once
// NCCL played by MPI on host memory, for testing the NCCL backend where there is no GPU (with
// testing::StandInDevice, whose cuda:0 memory is host memory that only copies may touch). While
// an EmulatedNccl lives, groups made by nccl_backend() run on it instead of libnccl: the group's
// own code (bootstrap, the mapping of each operation onto NCCL calls, events, errors, aborts) is
// what a GPU runs; the library under it is not. Each operation is carried by non-blocking MPI
// calls over host copies of the device bytes, on an MPI communicator made from the unique id; a
// stream is the queue of those operations and an event is done when the operations queued
// before it are, so a collective that a rank never joins stays pending, as on a GPU.
// Reductions are computed on the host, 16-bit floats in float32 rounded back at each step.
#include <cstdint>
#include <memory>
#include <string>

#include "tessera/core/detail/emulated_kernels.h"

namespace tessera::detail {

class EmulatedNccl {
 public:
  // Collective over the world. `memory` (the stand-in device's) must outlive this object. One at
  // a time per process; groups made while it lives must be dropped before it dies.
  explicit EmulatedNccl(EmulatedMemory* memory);
  ~EmulatedNccl();
  EmulatedNccl(const EmulatedNccl&) = delete;
  EmulatedNccl& operator=(const EmulatedNccl&) = delete;

  // The next operation issued on any communicator is not carried out: its communicator reports
  // `error` in the background instead, as NCCL reports a failed transfer.
  void fail_next(const std::string& error);
  // While true, every rank reports the same GPU, as ranks sharing one do (NCCL refuses them).
  void pretend_one_gpu(bool shared);
  // Communicators aborted since construction.
  int64_t aborts() const;
  // Operations issued since construction (a group of calls counts once per call).
  int64_t calls() const;

  class Library;

 private:
  std::unique_ptr<Library> lib_;
};

}  // namespace tessera::detail
