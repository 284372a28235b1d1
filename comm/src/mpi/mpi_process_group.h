#pragma once
// The MPI backend's group of CPU tensors: every collective is one non-blocking MPI call on a
// communicator private to the group, returning an MpiWork. It only moves data: the checks every
// backend shares (arguments, the debug signature check, numbering, the timeout) are made by the
// CheckedProcessGroup that wraps it; this group adds MPI's own limits (CPU tensors, counts that
// fit an int, tags up to MPI_TAG_UB).
#include <mpi.h>

#include <memory>
#include <string>

#include "tessera/comm/process_group.h"
#include "work.h"

namespace tessera::mpi {

class MpiProcessGroup final : public ProcessGroup {
 public:
  // Takes ownership of `comm`, which must be private to the new group (a dup or split result);
  // collective over `comm`.
  static std::shared_ptr<MpiProcessGroup> create(MPI_Comm comm, std::string name);

  WorkPtr all_reduce(Tensor& t, ReduceOp op) override;
  WorkPtr all_gather_into_tensor(Tensor& out, const Tensor& in) override;
  WorkPtr all_gather(std::vector<Tensor>& outputs, const Tensor& in) override;
  WorkPtr all_gather_runs(Tensor& out, const Tensor& in,
                          const std::vector<std::vector<GatherRun>>& runs) override;
  WorkPtr reduce_scatter_tensor(Tensor& out, const Tensor& in, ReduceOp op) override;
  WorkPtr reduce_scatter(Tensor& out, const std::vector<Tensor>& inputs, ReduceOp op) override;
  WorkPtr all_to_all(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs) override;
  WorkPtr broadcast(Tensor& t, int root) override;
  WorkPtr scatter(Tensor& out, const std::vector<Tensor>& inputs, int root) override;
  WorkPtr send(const Tensor& t, int dst, int tag) override;
  WorkPtr recv(Tensor& t, int src, int tag) override;
  WorkPtr barrier() override;
  // MPI_Comm_split, which blocks with no timeout: the wrapper first waits in a barrier.
  std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name) override;

 private:
  MpiProcessGroup(CommunicatorPtr comm, std::vector<int> world_ranks, int tag_ub);

  // One MPI_Ialltoallw: inputs[r] to rank r and rank r's piece into outputs[r], each where it
  // lies (strided views included, described by datatypes); this rank's own piece is copied by
  // us once the others have arrived. Inputs and outputs are copied or staged only where memory
  // they share would make the result depend on MPI's order. Pieces of one pair need only agree
  // on their element counts. Backs all_to_all and both all-gathers.
  std::shared_ptr<MpiWork> start_exchange(const char* op, CallInfo call,
                                          const std::vector<Tensor>& inputs,
                                          const std::vector<Tensor>& outputs) const;
  // Common entry of every operation: MPI usable.
  void enter(const char* op) const;
  std::shared_ptr<MpiWork> make_work(CallInfo call) const;
  // Errors name the group: "all_reduce on group 'tp' (rank 1 of 4): ...".
  std::string where(const char* op) const;
  // MPI moves host memory only.
  void check_cpu(const Tensor& t, const char* op, const char* what) const;
  void check_cpu(const std::vector<Tensor>& list, const char* op, const char* what) const;
  void check_tag(int tag, const char* op) const;

  CommunicatorPtr comm_;
  int tag_ub_ = 32767;  // MPI guarantees at least this
};

}  // namespace tessera::mpi
