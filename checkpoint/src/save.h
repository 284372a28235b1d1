#pragma once
// The two halves of a save (internal to checkpoint/): preparing it, on the calling thread with
// the ranks agreeing on every entry; and writing and committing the file, which an asynchronous
// save runs on its writer thread.
#include <mpi.h>

#include <string>
#include <vector>

#include "plan.h"
#include "tessera/checkpoint/checkpoint.h"

namespace tessera::ckpt {

struct SaveJob {
  std::string path;
  SaveOptions options;
  std::vector<Entry> entries;
  // Per entry: the dense block this rank writes (owners only; undefined otherwise).
  std::vector<Tensor> blocks;
  int64_t world_size = 1;
};

// Describes and agrees on the entries, reduces Partial DTensors, and takes each owned block: a
// view when it is dense already, or a copy; with `stage`, always a copy (the snapshot an
// asynchronous save writes while training changes the tensors). Collective over `pg`.
SaveJob prepare_save(const StateDict& state, const std::string& path, const SaveOptions& options,
                     const ProcessGroupPtr& pg, bool stage);

// Writes the file under its temporary name, then renames it over job.path when every rank
// succeeded. Collective over `pg` and `file_comm` (the same ranks).
void write_checkpoint(const SaveJob& job, const ProcessGroupPtr& pg, MPI_Comm file_comm);

}  // namespace tessera::ckpt
