#pragma once
// fully_shard: PyTorch FSDP2 semantics. Each call makes one parameter group of a module: its
// parameters (those no child's fully_shard claimed) become DTensors sharded on dim 0 over the
// data-parallel mesh dim, stored as views of one flat per-rank buffer so that one all-gather
// unshards the whole group before its forward and one reduce-scatter returns its gradients.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/comm/process_group.h"
#include "tessera/nn/module.h"

namespace tessera {

namespace detail {
struct FSDPSchedule;
struct FSDPGroupBuilder;
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
};

struct FSDPOptions {
  bool reshard_after_forward = true;
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
  double all_gather_wait_seconds = 0;
  int64_t reduce_scatters = 0;
  double reduce_scatter_wait_seconds = 0;
};

class FSDPState : public std::enable_shared_from_this<FSDPState> {
 public:
  // All-gathers the group (no-op when already unsharded) and points each Parameter at its
  // gathered value. async_op only issues the all-gather, which then runs in the background;
  // the next unshard() or forward of the group finishes it.
  void unshard(bool async_op = false);
  // Points each Parameter back at its stored shard.
  void reshard();
  // Off: backward keeps summing the unsharded gradients across micro-batches; the next
  // synced backward reduce-scatters the sum.
  void set_requires_gradient_sync(bool sync);
  void set_reshard_after_forward(bool r);
  // Explicit prefetch targets (PyTorch's FSDPModule methods of these names): the groups whose
  // all-gather this group issues when its forward (backward) starts. Replaces the implicit
  // choice; an empty list turns prefetch off for this group.
  void set_modules_to_forward_prefetch(const std::vector<std::shared_ptr<FSDPState>>& groups);
  void set_modules_to_backward_prefetch(const std::vector<std::shared_ptr<FSDPState>>& groups);

  // A module whose parameters have several dtypes is sharded as one group per dtype (each
  // all-gathered in its own dtype); fully_shard returns the first, and the calls of this class
  // act on all of them. parameters() lists all.
  std::vector<Parameter*> parameters() const;
  std::vector<std::string> parameter_names() const;  // relative to the module
  const Tensor& flat_buffer() const { return flat_; }
  bool is_unsharded() const { return unsharded_; }
  // The outermost fully_shard'ed module: it stays unsharded from forward through backward.
  bool is_root() const { return is_root_; }
  const FSDPOptions& options() const { return opts_; }
  FSDPCommStats comm_stats() const;  // summed over the dtype groups
  void reset_comm_stats();

  // Called by fully_shard's module hooks and autograd hooks.
  Tensor pre_forward(const Tensor& x);
  Tensor post_forward(const Tensor& y);
  void pre_backward();
  void on_grad_ready();
  void on_input_grad();

  struct ParamInfo {
    Parameter* param = nullptr;
    std::string name;
    Shape unsharded_shape;  // the global shape, or for FSDP x TP the TP-local shape
    int64_t rows = 0;       // unsharded_shape[0]
    int64_t row_numel = 1;
    int64_t chunk_rows = 0;  // ceil(rows / shard size): every rank's padded piece
    int64_t offset = 0;      // of this parameter's padded piece in the per-rank flat buffer
    int64_t base = 0;        // of the unsharded parameter in the gathered buffer
    // FSDP x TP: the TP DTensor's mesh, placements and global shape.
    std::optional<DeviceMesh> tp_mesh;
    Placements tp_placements;
    Shape tp_global_shape;
    Tensor leaf;        // the gathered leaf forward and backward use
    Tensor accum_grad;  // unsynced gradient sum (unsharded)
  };

 private:
  friend std::shared_ptr<FSDPState> fully_shard(const ModulePtr&, const DeviceMesh&, FSDPOptions);
  friend struct detail::FSDPSchedule;
  friend struct detail::FSDPGroupBuilder;
  FSDPState() = default;
  // This group and its siblings (the other dtypes of the same fully_shard call).
  std::vector<FSDPState*> members();
  std::vector<const FSDPState*> members() const;

  // unshard() and reshard() act on every dtype group of the call; these on this one (what the
  // group's own hooks use).
  void unshard_self(bool async_op = false);
  void reshard_self();
  void set_unsharded_params();
  void drop_leaves();
  void free_leaves_after_backward();
  // Issues the all-gather of the stored shards (no-op when one is in flight).
  void start_gather();
  // Finishes it into fresh leaves, or into the existing ones whose storage reshard() released.
  void finish_gather(bool fresh);
  void drop_pending_gather();
  // Frees the gathered buffer's bytes while its leaves stay referenced (by the autograd graph).
  void release_unsharded();
  void prefetch(bool forward);
  bool needs_backward_gather() const;
  // Packs this backward's gradients and issues their reduce-scatter. advance_reduce moves it on
  // (reduce-scatter, then for HSDP the all-reduce across replicas, then the averaged shards into
  // the stored parameters' gradients), waiting for each step when `block`, else only testing
  // it; false when it is still in flight.
  void start_reduce();
  bool advance_reduce(bool block);
  void mark_grads_pending(bool pending);
  void begin_backward();

  // Both in flight between issue and use.
  struct PendingGather {
    WorkPtr work;
    Tensor send, target;
    bool reuse = false;  // target is the released buffer the saved leaves view
  };
  struct PendingReduce {
    WorkPtr work;
    Tensor send, reduced;
    bool across_replicas = false;  // HSDP: `work` is the all-reduce that follows
  };

  std::weak_ptr<Module> module_;
  // The data-parallel groups, each duplicated for FSDP's own use: all-gathers, reduce-scatters
  // and (HSDP) the all-reduce across replicas each keep their own order (see schedule.h), and no
  // collective of the application on the mesh can come between them.
  ProcessGroupPtr gather_pg_;
  ProcessGroupPtr reduce_pg_;
  ProcessGroupPtr replicate_pg_;  // HSDP only
  FSDPOptions opts_;
  std::vector<ParamInfo> params_;
  Tensor flat_;
  int64_t padded_size_ = 0;  // per rank
  // The gathered parameters, one after another (the leaves are views of it), and where each
  // rank's pieces go in it.
  Tensor gathered_;
  int64_t unsharded_numel_ = 0;
  std::vector<std::vector<GatherRun>> gather_runs_;
  bool unsharded_ = false;
  bool is_root_ = true;
  bool requires_gradient_sync_ = true;
  bool backward_pending_ = false;
  bool leaves_released_ = false;  // resharded after forward: the graph holds empty storage
  bool grads_ready_for_reduce_ = false;
  // Set by a forward whose input requires grad, until that input's gradient is computed: only
  // then has this group's backward finished using its (frozen ones included) gathered weights.
  bool input_grad_pending_ = false;
  int64_t grads_ready_ = 0;
  FSDPCommStats stats_;
  std::optional<PendingGather> pending_gather_;
  std::optional<PendingReduce> pending_reduce_;
  // Shared by every group under one root: forward order, prefetch, reduce-scatter order.
  std::shared_ptr<detail::FSDPSchedule> schedule_;
  std::optional<std::vector<std::weak_ptr<FSDPState>>> forward_prefetch_, backward_prefetch_;
  std::vector<std::shared_ptr<FSDPState>> siblings_;
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
