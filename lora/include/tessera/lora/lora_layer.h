#pragma once
// LoraLayer: the adapter slots every layer LoRA wraps holds (LoraLinear, LoraEmbedding), and what
// LoraModel does with them: put an adapter in a slot, free it, merge it into the base weight.
//
// Every wrapped layer is, for LoRA, a linear map from `in` to `out` features with a weight W
// [out, in]: a Linear's weight, or an Embedding's table [num_embeddings, dim] read as the
// transposed W of the map from one-hot ids (in = num_embeddings, out = dim). Slot i holds A
// [max_rank, in] and B [out, max_rank] (PEFT's shapes for lora_A / lora_B and lora_embedding_A /
// lora_embedding_B alike), and the adapter adds scale * B A to W (its transpose to a table).
//
// The adapters' placements follow W's, mesh dim by mesh dim: W's out dim split (a
// column-parallel Linear, an Embedding split on dim 1) gives A replicated and B Shard(0); W's in
// dim split (a row-parallel Linear, a vocabulary-parallel Embedding) gives A Shard(1) and B
// replicated; a replicated (or plain) W gives both replicated (plain). FSDP later shards them
// over its mesh dim like any parameter.
#include <compare>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/autograd/ops.h"
#include "tessera/lora/config.h"
#include "tessera/nn/layers.h"

namespace tessera {

// Which adapters a forward applies: one for the whole batch (PEFT's set_adapter), or one per
// sample (a mixed batch). Shared by every LoRA layer of a model.
struct LoraRouting {
  int64_t active_slot = -1;  // -1: none (the base model alone)
  // A mixed batch: the slot of each sample of this rank's batch (-1: none), read to the host once
  // when set, so that each layer's forward builds its masks without reading device memory.
  std::optional<std::vector<int64_t>> sample_slots;

  // A mixed batch's routing and per-sample dropout, made on their device by the first layer that
  // needs them and reused by every layer with the same adapters (slot and dropout), rank and
  // device, which would each copy the same tensors to the device otherwise. Whoever changes
  // sample_slots empties it (LoraModel::set_batch_adapters does).
  struct MaskKey {
    std::string device;
    int64_t rows = 0, max_rank = 0;
    std::vector<std::pair<int64_t, double>> slots;  // (slot, dropout) in the masks' order
    auto operator<=>(const MaskKey&) const = default;
  };
  struct Masks {
    LowRankRouting routing;  // each slot's samples, in the key's slot order
    Tensor dropout;          // float [rows]: each sample's adapter's dropout
  };
  std::map<MaskKey, Masks> masks;
  // DoRA's stacked dropout product routes its adapters to the second half of a batch of 2n
  // samples: rows n..2n-1, made on the device once per (device, n) rather than per forward.
  std::map<std::pair<std::string, int64_t>, Tensor> second_halves;

  // The adapters of the LoraModel these layers belong to whose `bias` mode is not "none", each
  // with the base biases it trains now (none in inference mode): a later apply_lora on the same
  // model freezes the base model but leaves these training, and an adapter of another LoraModel
  // may not train the biases too (every adapter shares them). Set by apply_lora; it answers
  // nothing once that LoraModel is gone.
  struct BiasAdapter {
    std::string name, bias;
    std::vector<Parameter*> trained;
  };
  std::function<std::vector<BiasAdapter>()> bias_adapters;
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

class LoraLayer {
 public:
  virtual ~LoraLayer() = default;
  LoraLayer(const LoraLayer&) = delete;
  LoraLayer& operator=(const LoraLayer&) = delete;

  // Adapters side by side: A [k max_rank, in] and B [out, k max_rank]. One slot's scale stays
  // apart (the ops apply it to the activations); several carry theirs in their B.
  template <class T>
  struct Stacked {
    T a, b;
    double scale;
  };

  // --- what the wrapped layer is ---
  // The layer as a module (this object), and a plain one of the wrapped type holding the same
  // base parameters (LoraModel::unload puts it back).
  virtual Module& module() = 0;
  const Module& module() const { return const_cast<LoraLayer*>(this)->module(); }
  ModulePtr module_ptr() { return module().shared_from_this(); }
  // What the layer's LoraModel shares with its layers (the active slot, its bias adapters).
  const std::shared_ptr<LoraRouting>& routing() const { return routing_; }
  virtual ModulePtr unwrapped() const = 0;
  virtual Parameter& base_weight() = 0;
  virtual Parameter* base_bias() { return nullptr; }  // none for an Embedding
  // Keys of A and B after "<path>." in read_adapter and PEFT's files: "lora_A.weight" and
  // "lora_B.weight" for a Linear, "lora_embedding_A" and "lora_embedding_B" for an Embedding.
  virtual std::string adapter_key(bool a) const = 0;
  int64_t lora_in() const { return in_; }
  int64_t lora_out() const { return out_; }

  // --- slots ---
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
  // Slot i's parameters: A, B and, with magnitude slots and `magnitude`, m.
  std::vector<Parameter*> slot_parameters(int64_t i, bool magnitude = true);
  // Whether unmerge_slot(i) can run: a DoRA slot merged by restore_slot (a checkpoint) lacks the
  // weight norms its merge divided by, which the checkpoint does not hold.
  bool can_unmerge(int64_t i) const;

  // Puts an adapter in slot i with its initial values, drawn from (config.seed, adapter, path)
  // alone; refused for a merged slot. Not collective for plain and tensor-parallel layers,
  // except for DoRA, whose magnitude is the global norm of each output feature of W + scale B A
  // (collective over the weight's mesh).
  virtual void init_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                         const std::string& path) = 0;
  // Frees slot i (its matrices set to zero: a free slot changes nothing).
  void clear_slot(int64_t i);
  // W += scale B A (unmerge: -=) where W lives (a table: its transpose): each rank updates
  // exactly its own window of W, from the adapter matrices' global values (A and B are small; W
  // is never gathered). DoRA, as PEFT: W' = (m / ||W + scale B A||) (W + scale B A) per output
  // feature, the norms global (summed over the ranks that split a feature) and kept for the
  // unmerge, W = W' / (m / norms) - scale B A.
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

 protected:
  // `kind` names the layer type in errors. A and B are laid out for `weight` (W, or W's
  // transpose when `transposed`: an Embedding's table); the layer registers a_list_ and b_list_
  // as `names` (the slots then read `<names.first>.<slot>.weight`, ...).
  LoraLayer(std::string kind, const Parameter& weight, bool transposed, int64_t in, int64_t out,
            const LoraSlots& slots, std::shared_ptr<LoraRouting> routing,
            const std::pair<std::string, std::string>& names);

  // What one forward applies: the slots, and for a mixed batch each slot's samples; dropout per
  // sample row.
  struct Batch {
    std::vector<int64_t> slots;
    LowRankRouting routing;  // mixed batches only
    Tensor dropout;          // per row (mixed) or one value
    bool any_dropout = false;
  };
  Batch batch(int64_t rows, Device device) const;
  // batch() for a forward on `x`, whose dim 0 holds the samples when it has at least
  // rows_from_ndim dims (one sample otherwise); refused for a mixed batch when that dim is split
  // over the mesh.
  Batch batch_of(const DTensor& x, int64_t rows_from_ndim) const;
  // The adapters' input: `x` in their dtype `at` with the batch's dropout applied (its first
  // slot's stream), or undefined without dropout (the adapters then read x itself).
  Tensor dropped_input(const Tensor& x, const Batch& bt, DType at);
  // The batch's slots side by side (Stacked, above).
  Stacked<Tensor> stacked_local(const Batch& bt) const;  // plain (or whole) parameters
  Stacked<DTensor> stacked_on(const DeviceMesh& mesh, const Batch& bt) const;

  struct Merged {
    Tensor window;  // this rank's window of W, in W's dtype
    Tensor norms;   // DoRA: the global norms of W + scale B A over the window's output features
  };
  // This rank's window of W (or of `onto`, a tensor of its shape) + sign scale B A, in `ct`,
  // from the global A and B of slot i (collective over the adapters' meshes).
  Tensor adapted_window(int64_t i, double sign, DType ct, const Tensor& onto = {}) const;
  // --- DoRA (dora.cpp), for layers with magnitude slots ---
  // DoRA's merged window (unmerge: the window back) and the norms the merge divides by.
  Merged dora_merged_window(int64_t i, bool unmerge, DType ct);
  // The global norms [out] of the output features of the matrix whose window this rank holds as
  // `window` (in W's layout): their sums of squares summed over the ranks that split the in dim.
  Tensor global_out_norms(const Tensor& window) const;
  // m of slot i from its initial A and B (zero for a LoRA adapter in a slot with magnitudes).
  void init_magnitude(int64_t i);
  // W + scale B A in W's layout (a table: + scale (B A)^T), detached, in float32 or W's wider
  // dtype, from pieces that make one window.
  Tensor adapted_local(const Tensor& w, const Tensor& a, const Tensor& b, double scale) const;
  // The forward's detached norms [out] of W + scale B A: from whole tensors, or on the mesh from
  // each rank's window (one all-reduce of [out] where W's in dim is split), laid out as
  // `placements` (the magnitude's).
  Tensor out_norms(const Tensor& w, const Tensor& a, const Tensor& b, double scale) const;
  DTensor out_norms(const DTensor& w, const DTensor& a, const DTensor& b, double scale,
                    const Placements& placements) const;
  // The adapters' placements for a weight laid out as `w` (A's, B's).
  std::pair<Placements, Placements> adapter_placements(const DTensor& w) const;
  // Cuts each slot's matrices from this rank's copy once W is distributed on `mesh`, and
  // describes them for parallelize_module's agreement (the layers' overrides call these).
  void distribute_adapters(const DeviceMesh& mesh);
  std::vector<std::pair<std::string, std::string>> describe_adapters() const;
  // Makes DoRA's magnitude slots [out] (m_list_), laid out as B's rows; the layer registers them
  // as "lora_magnitude_vector".
  void make_magnitudes();
  // Slot i's description and dropout stream (from its start), for `adapter` under `config`.
  void set_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                const std::string& path, bool merged);
  // The checks every init_slot makes before writing (a merged slot, r above max_rank, DoRA
  // without magnitude slots).
  void check_init(int64_t i, const std::string& adapter, const LoraConfig& config,
                  const std::string& path) const;
  void check_slot(int64_t i, const char* op) const;

  std::string kind_;
  const Parameter* weight_;  // the owner's base weight (the member W lives in)
  bool transposed_;
  std::pair<std::string, std::string> names_;  // of the A and B modules
  int64_t in_, out_;
  std::vector<std::shared_ptr<LoraWeight>> a_, b_, m_;
  std::shared_ptr<LoraWeights> a_list_, b_list_, m_list_;
  std::vector<Slot> slots_;
  int64_t max_rank_;
  std::shared_ptr<LoraRouting> routing_;
  // One dropout stream per slot; a mixed batch draws from its first adapter's.
  std::vector<Generator> dropout_gens_;
  // Per slot: the DoRA norms its merge divided by, this rank's output features (undefined when
  // unmerged).
  std::vector<Tensor> dora_norms_;

 private:
  Merged merged_window(int64_t i, bool unmerge, const char* op);
  void check_merged(bool mixed) const;
};

// The generator seed of one adapter of one module: its values depend on these alone.
uint64_t lora_slot_seed(uint64_t seed, const std::string& adapter, const std::string& path);

}  // namespace tessera
