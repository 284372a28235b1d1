#pragma once
// fully_shard: PyTorch FSDP2 semantics. Each call makes one parameter group of a module: its
// parameters (those no child's fully_shard claimed) become DTensors sharded on dim 0 over the
// data-parallel mesh dim, stored as views of one flat per-rank buffer so that one all-gather
// unshards the whole group before its forward and one reduce-scatter returns its gradients.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/nn/module.h"

namespace tessera {

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

struct OffloadPolicy {
  // Accepted for API compatibility: without a GPU the parameters already live on the CPU.
  bool offload_to_cpu = false;
};

struct FSDPOptions {
  bool reshard_after_forward = true;
  MixedPrecisionPolicy mp_policy;
  OffloadPolicy offload_policy;
};

class FSDPState : public std::enable_shared_from_this<FSDPState> {
 public:
  // All-gathers the group (no-op when already unsharded) and points each Parameter at its
  // gathered value.
  void unshard();
  // Points each Parameter back at its stored shard.
  void reshard();
  // Off: backward keeps summing the unsharded gradients across micro-batches; the next
  // synced backward reduce-scatters the sum.
  void set_requires_gradient_sync(bool sync) { requires_gradient_sync_ = sync; }
  void set_reshard_after_forward(bool r) { opts_.reshard_after_forward = r; }

  std::vector<Parameter*> parameters() const;
  std::vector<std::string> parameter_names() const;  // relative to the module
  const Tensor& flat_buffer() const { return flat_; }
  bool is_unsharded() const { return unsharded_; }
  // The outermost fully_shard'ed module: it stays unsharded from forward through backward.
  bool is_root() const { return is_root_; }
  const FSDPOptions& options() const { return opts_; }

  // Called by fully_shard's module hooks and autograd hooks.
  Tensor pre_forward(const Tensor& x);
  Tensor post_forward(const Tensor& y);
  void pre_backward();
  void on_grad_ready();
  void finalize_backward();

  struct ParamInfo {
    Parameter* param = nullptr;
    std::string name;
    Shape unsharded_shape;  // the global shape, or for FSDP x TP the TP-local shape
    int64_t rows = 0;       // unsharded_shape[0]
    int64_t row_numel = 1;
    int64_t chunk_rows = 0;  // ceil(rows / shard size): every rank's padded piece
    int64_t offset = 0;      // of this parameter's padded piece in the per-rank flat buffer
    // FSDP x TP: the TP DTensor's mesh, placements and global shape.
    std::optional<DeviceMesh> tp_mesh;
    Placements tp_placements;
    Shape tp_global_shape;
    Tensor leaf;        // the gathered leaf forward and backward use
    Tensor accum_grad;  // unsynced gradient sum (unsharded)
  };

 private:
  friend std::shared_ptr<FSDPState> fully_shard(const ModulePtr&, const DeviceMesh&, FSDPOptions);
  FSDPState() = default;

  void set_unsharded_params();
  void post_backward();
  void drop_leaves();
  void free_leaves_after_backward();
  // All-gathers the shards into fresh leaves, or into the existing ones whose storage
  // reshard() released.
  void gather(bool fresh);
  void queue_finalize();

  std::weak_ptr<Module> module_;
  ProcessGroupPtr shard_pg_;
  ProcessGroupPtr replicate_pg_;  // HSDP only
  FSDPOptions opts_;
  std::vector<ParamInfo> params_;
  Tensor flat_;
  int64_t padded_size_ = 0;  // per rank
  bool unsharded_ = false;
  bool is_root_ = true;
  bool requires_gradient_sync_ = true;
  bool backward_pending_ = false;
  bool leaves_released_ = false;  // resharded after forward: the graph holds empty storage
  bool finalize_queued_ = false;
  int64_t grads_ready_ = 0;
};

// Shards `module`'s unclaimed parameters over `mesh`: 1-D is FSDP on that dim, 2-D is HSDP
// (dim 0 replicates, dim 1 shards). Parameters that are already tensor-parallel DTensors on
// another 1-D mesh (FSDP x TP) are sharded on the combined (dp, tp) mesh.
std::shared_ptr<FSDPState> fully_shard(const ModulePtr& module, const DeviceMesh& mesh,
                                       FSDPOptions opts = {});

}  // namespace tessera
