#pragma once
// Distributed checkpoints: one HDF5 file per checkpoint, written and read in parallel (MPI-IO),
// with PyTorch DCP's semantics (save a state dict, load in place into another) and none of its
// weaknesses:
// - every tensor is one dataset at its GLOBAL shape under its key, so
//   h5py.File(path)["model/layers.0.attention.wq.weight"][...] is the full weight;
// - each rank writes only the blocks it owns (a block held by several ranks is written once, by
//   owners chosen so that ranks write similar amounts) and reads only the windows it holds, so a
//   checkpoint saved on any mesh loads into any other mesh and placements;
// - every tile of every dataset has a checksum in the file, verified on every read;
// - a save is atomic: written under a temporary name beside `path`, renamed over `path` only when
//   every rank succeeded.
// See docs/checkpoint.md for the file layout.
#include <memory>
#include <string>
#include <vector>

#include "tessera/checkpoint/state_dict.h"

namespace tessera {

struct SaveOptions {
  // Flush the file to stable storage before it replaces `path`, so that a crash of the machine
  // (not only of the job) also leaves either the previous or the new checkpoint. One decision
  // for all ranks: the file is flushed when any rank asks for it.
  bool fsync = true;
};

struct LoadOptions {
  // Keys of the state dict that the file lacks are an error; with false they are returned as
  // missing_keys and their values left as they were.
  bool strict = true;
  // Verify the checksum of every element read (added up while each piece read is in cache; no
  // extra I/O). One decision for all ranks (the verification is collective): every rank
  // verifies when any rank asks for it.
  bool verify = true;
  // Without it, a piece of the state dict that is dense and of the file's dtype is read straight
  // into its tensor, so a checksum failure (found after the reading) leaves such tensors holding
  // the file's values, damaged ones included. With it, everything is read into staging buffers
  // and copied into the state dict only once verified: a failed load changes nothing, for a copy
  // of the local state and one more pass over it. Wrong keys, shapes, dtypes and versions are
  // found before any data is read, in both modes.
  bool transactional = false;
  // Read by mapping the file into memory (POSIX mmap) and copying each window out of it, adding
  // its checksum in the same pass; windows that are not runs of the file (column shards) are
  // strided copies. With false (on any rank: one decision for all) each rank reads its windows
  // through HDF5 and MPI-IO, independently. The file must not be truncated while it is loaded: a
  // mapped page past its end raises SIGBUS.
  bool memory_map = true;
};

// Writes `state` to `path`. Collective over every world rank: each passes the same keys, with
// DTensors of the same global shapes, dtypes and placements, plain tensors of the same shape
// (taken as replicated: written once) and the same scalars and strings. Partial DTensors are
// reduced first. Keys are '/'-separated, with no empty part; "_tessera" is reserved. Scalars and
// strings become attributes of the group their key names ("extras/step": attribute "step" of
// group "extras"). A failure on any rank is an error on every rank, and `path` is untouched.
void save(const StateDict& state, const std::string& path, const SaveOptions& options = {});

// Fills `state` from `path` in place: each DTensor's local piece receives its window (whatever
// the mesh and placements it was saved with), each Tensor the global value, each scalar or
// string the file's value. The file's other entries are ignored. Collective over every world
// rank, with the same keys on each. Wrong shapes, dtypes that cannot convert (floating to
// floating is allowed), damaged files and unknown formats are errors naming the file and the key;
// scalars change only when every rank read and verified everything, tensors as
// LoadOptions::transactional says. Each rank reads the one file it opened: a checkpoint renamed
// over `path` during the load (a save committing) is not seen, or, renamed over it while the
// ranks were opening it, is an error on every rank.
IncompatibleKeys load(StateDict& state, const std::string& path, const LoadOptions& options = {});

// save() in the background: returns once this rank's pieces are copied into a staging snapshot,
// so training may change the tensors while the file is written (by a thread of its own, with
// communicators of its own). Any save, load or inspection started meanwhile waits for it first.
// Like std::future from std::async, the handle waits for its save when destroyed or assigned
// over; an error nobody waited for is thrown by the next checkpoint operation. A save still
// pending when the runtime finalizes is finished first; if it fails then, the job ends with its
// error.
class [[nodiscard]] AsyncSave {
 public:
  AsyncSave() = default;
  AsyncSave(AsyncSave&&) noexcept = default;
  AsyncSave& operator=(AsyncSave&& other) noexcept;
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;
  ~AsyncSave();
  // Blocks until the checkpoint is committed; rethrows the save's error (on every rank).
  void wait();
  bool valid() const { return state_ != nullptr; }
  struct State;

 private:
  friend AsyncSave async_save(const StateDict&, const std::string&, const SaveOptions&);
  explicit AsyncSave(std::shared_ptr<State> s) : state_(std::move(s)) {}
  std::shared_ptr<State> state_;
};
AsyncSave async_save(const StateDict& state, const std::string& path,
                     const SaveOptions& options = {});

// --- Inspection: one process, no communication (the CLI tessera-ckpt uses these) ---

struct CheckpointEntry {
  std::string key;
  Shape shape;
  DType dtype = DType::Float32;
  int64_t bytes = 0;
  std::string saved_mesh;        // "DeviceMesh(dp=2, tp=2)", or "" for a plain tensor
  std::string saved_placements;  // "[S(0), R]"
};

struct CheckpointInfo {
  std::string path;
  int64_t format_version = 0;
  int64_t world_size = 0;  // of the job that saved it
  std::vector<CheckpointEntry> tensors;
  StateDict scalars;  // the scalar and string entries, by key
};

// Reads the metadata of a committed checkpoint (an error for a temporary or damaged one).
CheckpointInfo read_checkpoint_info(const std::string& path);
// Reads every tensor in full and checks every checksum, and that the tensors' checksums cover
// the whole table (a tensor removed from the file leaves a gap); returns one line per problem
// found (empty: the checkpoint is intact).
std::vector<std::string> verify_checkpoint(const std::string& path);
// The global value of one tensor entry, checksums verified.
Tensor read_checkpoint_tensor(const std::string& path, const std::string& key);

// The version of the file layout this library writes and reads.
constexpr int64_t kCheckpointFormatVersion = 1;

}  // namespace tessera
