#pragma once
// What every backend's group gets without writing it (internal to comm/), as c10d's
// ProcessGroupWrapper adds checks to any backend: argument checks on every rank before any data
// moves, the numbering of the group's collectives, the debug cross-rank signature check
// (TESSERA_DEBUG_COLLECTIVES), the count of operations, and the timeout watchdog with the
// departure protocol on every wait. The backend's group (`inner`) then only moves data; it may
// assume the checks made here (list sizes, roots, dtypes, shapes) and adds its own limits.
#include <memory>
#include <string>

#include "debug_check.h"
#include "tessera/comm/process_group.h"
#include "watched_work.h"

namespace tessera::detail {

class CheckedProcessGroup final : public ProcessGroup {
 public:
  // Wraps `inner` with `debug`: a CPU group over the same ranks in the same order, used by
  // nothing else (the signature exchanges travel there, so they can never match a data
  // collective). Collective over the group: the members agree on its id.
  static std::shared_ptr<CheckedProcessGroup> wrap(ProcessGroupPtr inner, ProcessGroupPtr debug);
  // The backend's group it checks: for a group built on this one's operations (host staging)
  // and checked itself, which would otherwise check, count and number every operation twice.
  const ProcessGroupPtr& inner() const { return inner_; }

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
  std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name) override;

 private:
  CheckedProcessGroup(ProcessGroupPtr inner, ProcessGroupPtr debug, GroupInfoPtr info);

  // Every operation first: counts it (comm_op_counts).
  void enter(const char* op) const;
  // Every collective once its arguments are checked: takes its position on the group, runs the
  // debug check when enabled, and returns the call to name it by.
  CallInfo start_collective(Signature sig) const;
  // Starts the backend's operation (start()) behind the watchdog.
  template <class Start>
  WorkPtr issue(CallInfo call, Start&& start) const;
  // Errors name the group: "all_reduce on group 'tp' (rank 1 of 4): ...".
  std::string where(const char* op) const;
  void check_tensor(const Tensor& t, const char* op, const char* what) const;
  void check_root(int root, const char* op, const char* what) const;
  void check_list(const std::vector<Tensor>& list, DType dtype, const char* op,
                  const char* what) const;
  void check_reduce(ReduceOp reduce, DType dtype, const char* op) const;

  ProcessGroupPtr inner_;
  ProcessGroupPtr debug_;
  GroupInfoPtr info_;
};

// A CPU group over every world rank for a CheckedProcessGroup's debug exchanges: MPI's, on a
// communicator of its own, not checked itself. Collective over the world (runtime.cpp).
ProcessGroupPtr debug_world_group();

}  // namespace tessera::detail
