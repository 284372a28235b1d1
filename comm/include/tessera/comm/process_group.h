#pragma once
// A group of ranks that run collectives together (c10d's Backend): one virtual method per
// collective, each asynchronous, returning a Work to wait on. Blocking use is `->wait()`.
// Every rank of the group must call the same collectives in the same order. Tensors may have any
// strides; the caller's tensors must stay alive and untouched until the Work completes.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera {

enum class ReduceOp : uint8_t { Sum, Avg, Max, Min, Product };
class ProcessGroup;

// A run of `length` elements at element offset `src` of the sender's input that lands at element
// offset `dst` of every rank's output (all_gather_runs).
struct GatherRun {
  int64_t src = 0;
  int64_t dst = 0;
  int64_t length = 0;
};
const char* reduce_op_name(ReduceOp op);
// Throws an error naming `group` unless `runs` fit `out` and `in` as all_gather_runs requires
// (the checks every backend's all_gather_runs makes before any data moves).
void check_gather_runs(const ProcessGroup& group, const Tensor& out, const Tensor& in,
                       const std::vector<std::vector<GatherRun>>& runs);

// How many operations of each kind ("all_reduce", "reduce_scatter_tensor", "send", "split", ...)
// this process has issued on any group since the last reset: what tests and benchmarks count
// communication with (a layer's collectives per forward, say). Thread-safe.
std::map<std::string, int64_t> comm_op_counts();
void reset_comm_op_counts();

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation finished; aborts the job after the collective timeout (counted
  // from the start of the wait) with a message naming op, group, shapes and rank. Dropping an
  // unfinished Work waits for it, since the backend may still be writing into its buffers. (The
  // timeout is the checked group's, which polls is_completed(); a backend's own wait() need not
  // have one.)
  virtual void wait() = 0;
  virtual bool is_completed() = 0;

  // What progress_in_background() asks of a backend. A backend whose transfers move only while
  // some thread of the process polls them (MPI moves a non-blocking operation only inside an
  // MPI call) says true while polling would still help; one whose transfers run by themselves
  // (on a device stream) keeps the default false, and is never handed to the progress thread.
  virtual bool needs_polling() { return false; }
  // One non-blocking poll from the progress thread; true once polling can stop (transfers done,
  // or failed: wait() then reports the error). It must not run what wait() runs after the
  // transfers (copying staged results, dividing for Avg): that stays on the caller's thread.
  virtual bool poll() { return true; }
  // What the timeout watchdog calls before it ends the job over this work: a backend whose
  // transfers run on a device stops them there (NCCL aborts its communicator), so that no kernel
  // is left waiting for a peer that will never come. Returns what it did, for the watchdog's
  // message ("" when there was nothing to stop: MPI's transfers end with the job).
  virtual std::string abort() { return ""; }
};
using WorkPtr = std::shared_ptr<Work>;

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  int rank() const { return rank_; }  // rank inside this group
  int size() const { return size_; }
  // World ranks of the members, in group-rank order.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  const std::string& name() const { return name_; }

  // In place on `t`. Avg divides the sum by size() (integers: truncating division). 16-bit floats
  // combine in float32 and round back at each combining step, so they travel as 16 bits; with
  // more than two ranks a sum may differ by rounding from one float32 accumulation (reduce in
  // float32 when that matters). Bool: sum and max are "or", product and min "and"; avg is an
  // error. The reducing collectives below follow the same rules.
  virtual WorkPtr all_reduce(Tensor& t, ReduceOp op) = 0;
  // `out` is size() copies of `in`'s shape concatenated on dim 0 (out.size(0) = size() *
  // in.size(0)); every rank passes the same shape.
  virtual WorkPtr all_gather_into_tensor(Tensor& out, const Tensor& in) = 0;
  // outputs[r] receives rank r's `in`; shapes may differ across ranks (outputs pre-sized).
  virtual WorkPtr all_gather(std::vector<Tensor>& outputs, const Tensor& in) = 0;
  // All-gather of scattered pieces: runs[r] says which elements of rank r's `in` go where in
  // every rank's `out` (both contiguous, one dtype, not sharing storage; runs given alike on
  // every rank, no two writing one element of `out`; elements no run writes keep their values).
  // FSDP gathers a group straight into its parameters with it: each rank's shard
  // holds a padded piece of every parameter, and each piece has its own place in the unsharded
  // parameters. This default, which any backend can run, packs each rank's runs into one piece
  // padded to the longest, all-gathers the pieces (all_gather_into_tensor) and copies the runs
  // into `out` when the work completes: one extra copy of the gathered bytes. A backend may
  // move the runs straight to their places instead (the MPI group: one MPI_Ialltoallw).
  virtual WorkPtr all_gather_runs(Tensor& out, const Tensor& in,
                                  const std::vector<std::vector<GatherRun>>& runs);
  // `in` is size() blocks of `out`'s shape on dim 0; rank r gets the reduction of block r.
  virtual WorkPtr reduce_scatter_tensor(Tensor& out, const Tensor& in, ReduceOp op) = 0;
  // inputs[r] (shapes may differ per r, same on every rank) reduced into rank r's `out`.
  virtual WorkPtr reduce_scatter(Tensor& out, const std::vector<Tensor>& inputs, ReduceOp op) = 0;
  // inputs[r] goes to rank r; outputs[r] receives from rank r (pre-sized, any sizes).
  virtual WorkPtr all_to_all(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs) = 0;
  virtual WorkPtr broadcast(Tensor& t, int root) = 0;
  // Root passes inputs[r] for each rank r (sizes may differ); others pass an empty vector.
  virtual WorkPtr scatter(Tensor& out, const std::vector<Tensor>& inputs, int root) = 0;
  virtual WorkPtr send(const Tensor& t, int dst, int tag = 0) = 0;
  virtual WorkPtr recv(Tensor& t, int src, int tag = 0) = 0;
  virtual WorkPtr barrier() = 0;

  // Collective over this group: members passing the same color form a new group, ordered by
  // key then by rank here (MPI_Comm_split). A negative color joins no group and gets nullptr.
  virtual std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name) = 0;

 protected:
  ProcessGroup(int rank, int size, std::vector<int> world_ranks, std::string name)
      : rank_(rank), size_(size), world_ranks_(std::move(world_ranks)), name_(std::move(name)) {}

 private:
  int rank_;
  int size_;
  std::vector<int> world_ranks_;
  std::string name_;
};
using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

}  // namespace tessera
