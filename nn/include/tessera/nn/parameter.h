#pragma once
// A module parameter: a plain leaf tensor, or a DTensor whose local piece is the leaf (after
// parallelize_module or fully_shard). Everything that walks parameters (optimizers, state dicts,
// gradient clipping) handles both through this one type.
#include "tessera/core/random.h"
#include "tessera/dtensor/dtensor.h"

namespace tessera {

class Parameter {
 public:
  Parameter() = default;
  explicit Parameter(Tensor t, bool requires_grad = true);
  explicit Parameter(DTensor d, bool requires_grad = true);

  // Draws a fresh value: fills the parameter's window of a logical draw from `gen` (every rank
  // advances `gen` by the global numel), so any sharding holds the same values. a = 0 as
  // torch.nn.init.kaiming_uniform_; Linear passes sqrt(5).
  void kaiming_uniform_(Generator& gen, double a = 0.0);
  void uniform_(double low, double high, Generator& gen);
  void normal_(double mean, double std, Generator& gen);
  void fill_(double value);
  // Moves a plain parameter to `device` (values, requires_grad; a gradient is dropped), keeping
  // this Parameter object, so optimizers made afterwards see the moved leaf. A DTensor parameter
  // is refused: its mesh's device type decides where its shard lives, so move the module before
  // parallelize_module or fully_shard, as in PyTorch.
  void to(Device device);

  bool defined() const { return local_.defined(); }
  bool is_dtensor() const { return dtensor_.defined(); }
  // What forward computes with: the stored leaf (the tensor itself, or the DTensor's local
  // piece), or, while FSDP has the parameter's group unsharded, the gathered value.
  const Tensor& local() const { return unsharded_local_.defined() ? unsharded_local_ : local_; }
  const DTensor& dtensor() const;
  // What a module's plain-tensor forward computes with: local(), refused with an error naming
  // `module` and `name` when it is the local piece of a sharded DTensor, which is not the weight
  // (using it would compute a slice of the layer silently).
  const Tensor& whole_local(const std::string& module, const char* name) const;
  // What a module's DTensor forward computes with: dtensor(), or a plain tensor taken as
  // replicated on `mesh` (its gradient then summed over the mesh dims the output is split on).
  // Undefined for an undefined parameter (a Linear without bias).
  DTensor on_mesh(const DeviceMesh& mesh) const;
  // The stored leaf: what optimizers update and where the (sharded) gradient lives.
  const Tensor& stored() const { return local_; }
  const DTensor& stored_dtensor() const;

  // FSDP: while a group is unsharded, forward uses `local` (and, for FSDP x TP, `dtensor`: the
  // value on the remaining mesh dims) instead of the stored shard.
  void set_unsharded(Tensor local, DTensor dtensor = {});
  void clear_unsharded();
  bool is_unsharded() const { return unsharded_local_.defined(); }
  const Shape& global_shape() const;
  DType dtype() const { return local_.dtype(); }
  bool requires_grad() const { return local_.requires_grad(); }
  void set_requires_grad(bool r);

  // The global value (gathers a DTensor; no autograd).
  Tensor full() const;
  // Copies a global value into this parameter (each rank its window).
  void copy_from_full(const Tensor& full);
  // The local gradient (undefined when none), and it as a DTensor in grad placements.
  Tensor grad() const { return local_.grad(); }
  DTensor grad_dtensor() const;
  // Drops the gradient (PyTorch's set_to_none=True), or zeroes it in place, detached from any
  // graph, leaving a missing one missing (set_to_none=False).
  void zero_grad(bool set_to_none = true);
  // FSDP sets this from the start of a backward until the parameter's reduce-scattered gradient
  // is written; optimizers and clip_grad_norm_ refuse to read the gradient meanwhile.
  void set_grad_pending(bool pending) { grad_pending_ = pending; }
  bool grad_pending() const { return grad_pending_; }

  std::string str() const;

 private:
  Tensor local_;
  DTensor dtensor_;
  Shape shape_;
  Tensor unsharded_local_;
  DTensor unsharded_dtensor_;
  bool grad_pending_ = false;
};

}  // namespace tessera
