#pragma once
// The two halves of a save (internal to checkpoint/): preparing it, on the calling thread with
// the ranks agreeing on every entry; and writing and committing the file, which an asynchronous
// save runs on its writer thread.
#include <mpi.h>

#include <string>
#include <vector>

#include "h5/h5.h"
#include "plan.h"
#include "tessera/checkpoint/checkpoint.h"
#include "watchdog.h"

namespace tessera::ckpt {

struct SaveJob {
  std::string path;
  SaveOptions options;
  std::vector<Entry> entries;
  // Per entry: the dense block this rank writes (owners only; undefined otherwise).
  std::vector<Tensor> blocks;
  // Per entry: its first word in the checksum table, and its number of words there.
  std::vector<int64_t> first, words;
  // The checksum words (laid out as the table) of the windows this rank holds and another rank
  // writes, as they were at the call: finish_save compares them with the writer's.
  std::vector<uint64_t> replica_sums;
  int64_t world_size = 1;
};

// Describes and agrees on the entries, reduces Partial DTensors, takes each owned block (a view
// when it is dense already, or a copy; with `stage`, always a copy: the snapshot an asynchronous
// save writes while training changes the tensors) and adds up the checksums of the replicas this
// rank holds and does not write. Collective over `pg`.
SaveJob prepare_save(const StateDict& state, const std::string& path, const SaveOptions& options,
                     const ProcessGroupPtr& pg, bool stage);

// The temporary file of a save: created with every dataset and attribute, then filled.
struct SaveFile {
  std::string tmp;
  h5::Id file;
  std::vector<h5::Id> datasets;  // per entry (tensors only)
  std::vector<uint64_t> sums;    // this rank's words: of the blocks it writes, and its replicas'
  // Closes what is open (collective: every rank does it after the same agreed failure) and
  // deletes the file (rank 0).
  void abandon(const ProcessGroupPtr& pg);
};

// Creates the file under its temporary name beside job.path. Collective, under `steps`.
void create_save_file(const SaveJob& job, SaveFile& f, Steps& steps, MPI_Comm comm);
// Adds this rank's checksums and writes its blocks. With `steps`, a collective transfer in one
// agreed step per dataset; without, independent transfers and no communication at all (what an
// asynchronous save's writer thread does, so that it never holds tessera's MPI lock while
// waiting for another rank).
void write_blocks(const SaveJob& job, SaveFile& f, Steps* steps);
// Adds up the ranks' checksums into the table, writes it and the closing attributes, closes the
// file and renames it over job.path once every rank succeeded. Collective. Replicas whose sums
// differ from their writer's are an error on every rank naming the keys and the ranks, and
// nothing is committed.
void finish_save(const SaveJob& job, SaveFile& f, const ProcessGroupPtr& pg, Steps& steps);

}  // namespace tessera::ckpt
