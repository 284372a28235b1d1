#pragma once
// LoraLinear: a Linear with low-rank adapters, y = x W^T + b + sum over adapters of
// scale * (dropout(x) A^T) B^T. It is a Linear (the tensor-parallel styles apply to it) that
// takes over the wrapped layer's weight and bias under their own names, so the base model's
// parameter names do not change; each adapter slot adds "lora_A.<slot>.weight" [max_rank, in]
// and "lora_B.<slot>.weight" [out, max_rank], and with LoraSlots::use_dora
// "lora_magnitude_vector.<slot>.weight" [out] (DoRA's magnitude, laid out as B's rows: Shard(0)
// under a column-parallel W, replicated under a row-parallel one).
//
// The adapters' placements follow the base weight W [out, in]: column-parallel W Shard(0) gives
// A replicated and B Shard(0); row-parallel W Shard(1) gives A Shard(1) and B replicated; a
// replicated (or plain) W gives both replicated (plain). FSDP later shards them over its mesh
// dim like any parameter.
//
// Each forward issues the collectives the layer issues without adapters, and no more (dropout's
// mask too: each slot's stream is the same on every rank by construction, so its draw skips the
// cross-rank check of DTensor's rand):
//  - column parallel: the base and adapter products are one DTensor op (linear_lowrank) whose
//    replicated inputs, x and A, have their gradients summed in the one all-reduce the layer's
//    backward makes anyway;
//  - row parallel: the partial base product and the partial adapter activations x A^T travel
//    together in the layer's one reduction, after which B applies to replicated activations (so
//    B's gradient needs no sum).
// Gradients of replicated adapter matrices come out summed over the ranks that share them by
// these DTensor rules, with nothing LoRA-specific in the backward.
//
// DoRA (a slot whose adapter has use_dora) scales the layer's product by m / ||W + scale B A||,
// the norm of each whole row: a row-parallel layer sums its rows' squares over the TP group, one
// all-reduce of [out] more per forward. With dropout in training it computes one more product
// of W, (x - dropout(x)) W^T, reduced apart from the layer's reduction: a row-parallel forward
// makes one more reduction of the output than without dropout, a column-parallel backward one
// more all-reduce of its input's gradient. See dora.cpp.
#include <compare>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/lora/config.h"
#include "tessera/nn/layers.h"

namespace tessera {

// Which adapters a forward applies: one for the whole batch (PEFT's set_adapter), or one per
// sample (a mixed batch). Shared by every LoraLinear of a model.
struct LoraRouting {
  int64_t active_slot = -1;  // -1: none (the base model alone)
  // A mixed batch: the slot of each sample of this rank's batch (-1: none), read to the host once
  // when set, so that each layer's forward builds its masks without reading device memory.
  std::optional<std::vector<int64_t>> sample_slots;

  // A mixed batch's per-sample masks, made on their device by the first layer that needs them
  // and reused by every layer with the same adapters (slot and dropout), rank and device, which
  // would each copy the same masks to the device otherwise. Whoever changes sample_slots
  // empties it (LoraModel::set_batch_adapters does).
  struct MaskKey {
    std::string device;
    int64_t rows = 0, max_rank = 0;
    std::vector<std::pair<int64_t, double>> slots;  // (slot, dropout) in the masks' order
    auto operator<=>(const MaskKey&) const = default;
  };
  struct Masks {
    Tensor h_scale;  // float [rows, slots * max_rank]: 1 where a sample uses that slot
    Tensor dropout;  // float [rows]: each sample's adapter's dropout
  };
  std::map<MaskKey, Masks> masks;
};

// One adapter matrix, a module of its own so that its name reads lora_A.<slot>.weight.
class LoraWeight : public Module {
 public:
  explicit LoraWeight(Parameter value);
  Parameter weight;
};

// The slots' matrices of one kind, named "0", "1", ...
class LoraWeights : public Module {
 public:
  explicit LoraWeights(const std::vector<std::shared_ptr<LoraWeight>>& items);

 private:
  std::vector<std::shared_ptr<LoraWeight>> items_;
};

class LoraLinear : public Linear {
 public:
  // Wraps `base` (plain or tensor-parallel) with `slots` preallocated adapter slots.
  LoraLinear(const Linear& base, const LoraSlots& slots, std::shared_ptr<LoraRouting> routing);

  Tensor forward(const Tensor& x) override;
  DTensor forward_dtensor(const DTensor& x) override;
  void after_tensor_parallel(const DeviceMesh& mesh) override;
  std::vector<std::pair<std::string, std::string>> tensor_parallel_inputs() const override;

  struct Slot {
    std::string adapter;  // empty: free
    int64_t r = 0;
    double scale = 0;
    double dropout = 0;
    bool merged = false;  // folded into the weight: the forward skips it
    bool use_dora = false;
  };
  int64_t num_slots() const { return int64_t(slots_.size()); }
  int64_t max_rank() const { return max_rank_; }
  const Slot& slot(int64_t i) const;
  Parameter& lora_A(int64_t i);
  Parameter& lora_B(int64_t i);
  // DoRA's magnitude of slot i [out]; only with LoraSlots::use_dora (has_magnitude()).
  bool has_magnitude() const { return !m_.empty(); }
  Parameter& lora_magnitude_vector(int64_t i);
  // Whether unmerge_slot(i) can run: a DoRA slot merged by restore_slot (a checkpoint) lacks the
  // weight norms its merge divided by, which the checkpoint does not hold.
  bool can_unmerge(int64_t i) const;

  // Puts an adapter in slot i with its initial values, drawn from (config.seed, adapter,
  // path) alone; refused for a merged slot. Not collective for plain and tensor-parallel layers,
  // except for DoRA, whose magnitude is the global row norms of W + scale B A (collective over
  // the weight's mesh).
  void init_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                 const std::string& path);
  // Frees slot i (its matrices set to zero: a free slot changes nothing).
  void clear_slot(int64_t i);
  // W += scale B A (unmerge: -=) where W lives: each rank updates exactly its own window of W,
  // from the adapter matrices' global values (A and B are small; W is never gathered). DoRA, as
  // PEFT: W' = (m / ||W + scale B A||) (W + scale B A), the norms global (summed over the ranks
  // that split a row) and kept for the unmerge, W = W' / (m / norms) - scale B A.
  // Collective over the adapter matrices' meshes. A merged slot applies to every sample, so a
  // forward refuses one that is not the routing's active slot, and any during a mixed batch.
  void merge_slot(int64_t i, bool unmerge);
  // Whether merging slot i would leave this rank's window of W finite (no NaN or infinity, in
  // W's dtype), changing nothing. Collective as merge_slot is.
  bool merge_is_finite(int64_t i);
  // A checkpoint's slot i (LoraModel::load_state_dict): its adapter ("" frees it), merged flag
  // and dropout stream position, without touching the matrices or the weight, whose values come
  // from the model's state dict. Only for that: the slot's values must be the checkpoint's (a
  // slot freed here keeps its values, a merged one is not merged here).
  void restore_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                    const std::string& path, bool merged, uint64_t dropout_offset);
  // How far slot i's dropout stream has advanced (saved with the adapter table).
  uint64_t dropout_offset(int64_t i) const;

 private:
  struct Batch;
  struct Merged {
    Tensor window;  // this rank's window of W, in W's dtype
    Tensor norms;   // DoRA: the global row norms of W + scale B A over the window's rows
  };
  void check_slot(int64_t i, const char* op) const;
  // This rank's window of W with slot i merged (unmerge: taken out). Collective for DoRA.
  Merged merged_window(int64_t i, bool unmerge, const char* op);
  // This rank's window of W (or of `onto`, a tensor of its shape) + sign scale B A, in `ct`,
  // from the global A and B of slot i (collective over the adapters' meshes).
  Tensor adapted_window(int64_t i, double sign, DType ct, const Tensor& onto = {}) const;
  // --- DoRA (dora.cpp) ---
  // The global row norms [out] of the matrix whose window this rank holds as `window` (W's
  // window of it): the rows' sums of squares summed over the ranks that split the columns.
  Tensor global_row_norms(const Tensor& window) const;
  void init_magnitude(int64_t i);
  // DoRA's merged window (unmerge: the window back), and the norms that merge divides by.
  Merged dora_merged_window(int64_t i, bool unmerge, DType ct);
  Tensor forward_dora(const Tensor& x, const Tensor& w, const Tensor& b0, const Tensor& a,
                      const Tensor& b, int64_t slot, const Tensor& xl);
  DTensor forward_dtensor_dora(const DTensor& x, const DTensor& w, const DTensor& bd,
                               const DTensor& a, const DTensor& b, int64_t slot, const DTensor& xl);
  // The adapters' product with the layer's one collective: linear_lowrank (column parallel or
  // replicated), or the row-parallel reduction of [x W^T || x A^T] before B.
  DTensor lowrank_dtensor(const DTensor& x, const DTensor& w, const DTensor& bd, const DTensor& a,
                          const DTensor& b, double scale, const DTensor& xl,
                          const Tensor& h_scale) const;
  // Slot i's description and dropout stream (from its start), for `adapter` under `config`.
  void set_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                const std::string& path, bool merged);
  void check_merged(bool mixed) const;
  Batch batch(int64_t rows, Device device) const;
  static Tensor activation_mask(const Batch& bt, int64_t ndim);
  std::vector<std::shared_ptr<LoraWeight>> a_, b_, m_;
  std::shared_ptr<LoraWeights> a_list_, b_list_, m_list_;
  // Per slot: the DoRA norms its merge divided by, this rank's rows (undefined when unmerged).
  std::vector<Tensor> dora_norms_;
  std::vector<Slot> slots_;
  int64_t max_rank_;
  std::shared_ptr<LoraRouting> routing_;
  // One dropout stream per slot; a mixed batch draws from its first adapter's.
  std::vector<Generator> dropout_gens_;
};

}  // namespace tessera
