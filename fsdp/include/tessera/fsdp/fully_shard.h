#pragma once
// fully_shard: PyTorch FSDP2 semantics. Each call makes one parameter group of a module: its
// parameters (those no child's fully_shard claimed) become DTensors sharded on dim 0 over the
// data-parallel mesh dim, stored as views of one flat per-rank buffer so that one all-gather
// unshards the whole group before its forward and one reduce-scatter returns its gradients.
#include <concepts>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/comm/process_group.h"
#include "tessera/nn/module.h"

namespace tessera {

namespace detail {
class FSDPGroup;
}  // namespace detail

struct MixedPrecisionPolicy {
  // Dtype of the gathered parameters that forward and backward compute with; the stored
  // shards stay in their own dtype (master weights).
  std::optional<DType> param_dtype;
  // Dtype gradients are reduce-scattered in (default: param_dtype); stored grads keep the
  // stored parameter's dtype.
  std::optional<DType> reduce_dtype;
  // The module's floating output is cast to this.
  std::optional<DType> output_dtype;
  // Whether the module's floating input is cast to param_dtype (PyTorch's default, true).
  bool cast_forward_inputs = true;
};

// PyTorch's `reshard_after_forward: bool | int`. An int N is the world size to reshard to after
// forward: the shard group's ranks split into consecutive sub-groups of N, each rank keeps its
// 1/N of the gathered parameters (rather than 1/shard size), and the backward all-gathers over
// its sub-group only, at the cost of that memory between forward and backward. fully_shard and
// set_reshard_after_forward check N against the shard group size S: it must divide S; 1 acts
// as false and S as true (as in PyTorch); N <= 0 or one that does not divide S is refused.
class ReshardAfterForward {
 public:
  ReshardAfterForward(bool reshard) : reshard_(reshard) {}  // NOLINT: converts, as in PyTorch
  template <std::integral T>
  requires(!std::same_as<T, bool>)
      ReshardAfterForward(T world_size)  // NOLINT: converts, as in PyTorch
      : reshard_(true), world_size_(int64_t(world_size)) {}

  // Whether the gathered parameters are freed after forward, fully or down to a sub-group's.
  explicit operator bool() const { return reshard_; }
  // The int form: the world size to reshard to (nullopt for true and false).
  std::optional<int64_t> world_size() const { return world_size_; }
  std::string str() const;
  friend bool operator==(const ReshardAfterForward&, const ReshardAfterForward&) = default;

 private:
  bool reshard_ = true;
  std::optional<int64_t> world_size_;
};

struct FSDPOptions {
  // After forward, free the gathered parameters (they are gathered again for backward); off,
  // they stay gathered until after backward, or, after a forward under no_grad, until reshard()
  // (an evaluation or generation loop then gathers once). An int N keeps 1/N of them on each
  // rank instead, and the backward gathers within a sub-group of N ranks (ReshardAfterForward;
  // a forward under no_grad frees them all). The root's parameters stay gathered from a forward
  // with grad to its backward, since backward needs them at once, unless
  // set_reshard_after_forward names the root itself. options() reports the value as fully_shard
  // resolved it (an int 1 as false, the shard group size as true).
  ReshardAfterForward reshard_after_forward = true;
  // Issue the next group's all-gather while this group computes: in forward the group after it
  // in the previous step's forward order, in backward the group before it in this step's.
  // set_modules_to_forward_prefetch / _backward_prefetch choose the groups instead.
  bool forward_prefetch = true;
  bool backward_prefetch = true;
  MixedPrecisionPolicy mp_policy;
};

// Where a group's communication kept its computing thread waiting: the time inside wait() for
// its all-gathers and reduce-scatters. A prefetched all-gather that finished in the background
// costs (almost) nothing here; without prefetch every all-gather is waited for in full.
struct FSDPCommStats {
  int64_t all_gathers = 0;
  // all_gathers by the number of ranks they ran over: the shard group's size, or for the
  // backward's after reshard_after_forward = N, N.
  std::map<int64_t, int64_t> all_gathers_by_group_size;
  double all_gather_wait_seconds = 0;
  int64_t reduce_scatters = 0;
  double reduce_scatter_wait_seconds = 0;
};

// What FSDPState::unshard(async_op = true) returns (PyTorch's UnshardHandle): wait() finishes the
// all-gather it issued and points the parameters at the gathered values. A no-op once the
// group's forward or unshard() has used that all-gather (or reshard() dropped it), and for a
// group that was already unsharded.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  void wait();

 private:
  friend class FSDPState;
  // Each dtype group and the id of the all-gather issued for it (PendingGather::id).
  std::vector<std::pair<std::weak_ptr<detail::FSDPGroup>, uint64_t>> gathers_;
};

// The handle fully_shard returns (PyTorch's FSDPModule methods). The groups it acts on live as
// long as the module's hooks, which own them, so dropping the handle changes nothing.
class FSDPState {
 public:
  // All-gathers the group (no-op when already unsharded) and points each Parameter at its
  // gathered value. async_op only issues the all-gather, which then runs in the background;
  // the next unshard() or forward of the group finishes it and uses it (as PyTorch's forward
  // uses the gather behind an UnshardHandle), whatever ran in between: issue it after the
  // optimizer step, or reshard() drops it. The handle's wait() finishes it by hand.
  UnshardHandle unshard(bool async_op = false);
  // Points each Parameter back at its stored shard, and frees what reshard_after_forward = N
  // kept since forward (the next forward or backward gathers over the whole shard group).
  void reshard();
  // Off: backward keeps summing the unsharded gradients across micro-batches (in the reduce
  // dtype); the next synced backward reduce-scatters the sum. `recurse` (PyTorch's default) sets
  // it on every fully_shard'ed module inside this one too.
  void set_requires_gradient_sync(bool sync, bool recurse = true);
  // HSDP: off, backward still reduce-scatters within each replica but skips the all-reduce
  // across replicas; the shard sums wait, in the reduce dtype (memory of one shard, not of the
  // unsharded gradients), and join the next backward that all-reduces, whose result is added to
  // the stored gradients as usual. So k micro-batches cost k reduce-scatters and one all-reduce.
  // Nothing for plain FSDP. A backward that throws drops the waiting sums.
  void set_requires_all_reduce(bool all_reduce, bool recurse = true);
  // PyTorch's FSDPModule methods: `recurse` sets it on every fully_shard'ed module inside too.
  // An int is checked against each group's shard group size first (a refused call changes
  // nothing); it creates the sub-groups' communicators, so every rank must call it alike.
  void set_reshard_after_forward(ReshardAfterForward r, bool recurse = true);
  // Off: a group stays gathered after its backward (its unsharded gradients are still freed),
  // so that the next micro-batch's forward gathers nothing (it checks, with one small
  // all-reduce, whether the shards were written since: after an optimizer step it gathers
  // again), and then reshards as reshard_after_forward says; reshard() frees the weights too.
  void set_reshard_after_backward(bool r, bool recurse = true);
  // Gradients are summed over the data-parallel ranks and divided by `factor` instead of their
  // number (a loss summed over the global batch's tokens, say, divides by 1). Not recursive, as
  // in PyTorch.
  void set_gradient_divide_factor(double factor);
  // Explicit prefetch targets (PyTorch's FSDPModule methods of these names): the groups whose
  // all-gather this group issues when its forward (backward) starts. Replaces the implicit
  // choice; an empty list turns prefetch off for this group. A forward prefetch belongs to this
  // group's root's step, also when it targets a group under another root: one whose forward has
  // not used it when that step's backward ends (or its root's next forward starts) drops it.
  // Backward gathers go out in the root's one backward order (every rank alike), so a backward
  // target under another root, or one whose backward this step does not expect, is skipped.
  void set_modules_to_forward_prefetch(const std::vector<std::shared_ptr<FSDPState>>& groups);
  void set_modules_to_backward_prefetch(const std::vector<std::shared_ptr<FSDPState>>& groups);

  // A module whose parameters have several dtypes is sharded as one group per dtype (each
  // all-gathered in its own dtype); the calls of this class act on all of them, and
  // parameters() lists all.
  std::vector<Parameter*> parameters() const;
  std::vector<std::string> parameter_names() const;  // relative to the module
  // The per-rank buffer that the stored shards of the parameters of `dtype` view; without a
  // dtype, that of the only group (an error naming the dtypes when there are several).
  const Tensor& flat_buffer() const;
  const Tensor& flat_buffer(DType dtype) const;
  // Whether every dtype group is unsharded (in backward each reshards when its own gradients
  // are reduced, so one may already be while another is not).
  bool is_unsharded() const;
  // The outermost fully_shard'ed module: it stays unsharded from forward through backward.
  bool is_root() const;
  const FSDPOptions& options() const;
  FSDPCommStats comm_stats() const;  // summed over the dtype groups
  void reset_comm_stats();

  // Made by fully_shard, from the call's groups (internal to fsdp/; at least one).
  explicit FSDPState(std::vector<std::shared_ptr<detail::FSDPGroup>> groups);
  ~FSDPState();
  FSDPState(const FSDPState&) = delete;
  FSDPState& operator=(const FSDPState&) = delete;

 private:
  std::vector<std::shared_ptr<detail::FSDPGroup>> groups_;
};

// Shards `module`'s unclaimed parameters over `mesh`: 1-D is FSDP on that dim, 2-D is HSDP
// (dim 0 replicates, dim 1 shards). Parameters that are already tensor-parallel DTensors on
// another 1-D mesh (FSDP x TP) are sharded on the combined (dp, tp) mesh.
std::shared_ptr<FSDPState> fully_shard(const ModulePtr& module, const DeviceMesh& mesh,
                                       FSDPOptions opts = {});

// Whether a fully_shard group holds `p` (in PyTorch, whether it belongs to an FSDPModule): such a
// parameter must not be moved to another module, which the group would not follow.
bool is_fully_sharded(const Parameter& p);

}  // namespace tessera
