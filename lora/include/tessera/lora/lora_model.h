#pragma once
// apply_lora and the model-level adapter operations, with PEFT's names: add, delete and activate
// named adapters; route a mixed batch per sample; merge and unmerge; read and write an adapter
// as global tensors; save and load PEFT's adapter files.
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/checkpoint/state_dict.h"
#include "tessera/lora/lora_embedding.h"
#include "tessera/lora/lora_linear.h"
#include "tessera/lora/token_embedding.h"

namespace tessera {

class LoraModel;
struct SavedModule;  // a module of modules_to_save and its copies

// While alive, no adapter applies: the model is its base (PEFT's `with model.disable_adapter():`,
// the reference model of DPO, say). See LoraModel::disable_adapter.
class [[nodiscard]] DisabledAdapters {
 public:
  explicit DisabledAdapters(LoraModel& model);
  ~DisabledAdapters();
  DisabledAdapters(const DisabledAdapters&) = delete;
  DisabledAdapters& operator=(const DisabledAdapters&) = delete;

 private:
  LoraModel& model_;
  std::string active_;
  std::optional<std::vector<int64_t>> sample_slots_;
  std::map<std::string, int64_t> slots_;  // each adapter's slot, to see whether any changed
};

// PEFT's add_weighted_adapter keyword arguments beyond the combination type (unset: PEFT's None).
struct WeightedAdapterOptions {
  // The "*svd" types: the combined adapter's rank; unset, the largest r among the adapters.
  std::optional<int64_t> svd_rank = std::nullopt;
  // The "*svd" types: a quantile in [0, 1]; B and A are clamped to [-h, h], h that quantile of
  // their values together.
  std::optional<double> svd_clamp = std::nullopt;
  // "ties", "magnitude_prune", the dare types and their "_svd" forms (required there): the
  // fraction of each tensor's values kept, those of largest magnitude (dare: at random, the kept
  // ones divided by it); >= 1 keeps all.
  std::optional<double> density = std::nullopt;
  // The ties types: the sign elected per element, that of the values' sum ("total") or
  // the more frequent sign ("frequency").
  std::string majority_sign_method = "total";
  // The dare types' random pruning: each layer's draws come from (seed, the new adapter's name,
  // the layer's path) alone, the same under any mesh (PEFT draws from torch's global generator).
  uint64_t seed = 0;
};

class LoraModel {
 public:
  const ModulePtr& model() const { return model_; }
  // The wrapped layers (LoraLinear, LoraEmbedding), by path, in the model's order.
  const std::vector<std::pair<std::string, std::shared_ptr<LoraLayer>>>& layers() const {
    return layers_;
  }
  // The tables whose token rows adapters train (trainable_token_indices), by path.
  const std::vector<std::pair<std::string, std::shared_ptr<TokenEmbedding>>>& token_tables() const {
    return tokens_;
  }

  // --- adapters ---
  std::vector<std::string> adapters() const;  // in slot order
  const LoraConfig& config(const std::string& adapter) const;
  // Into a free slot, initialised from (config.seed, name, path) alone. Every module its targets
  // match must be one apply_lora wrapped (an error names the others). Works after fully_shard (the
  // slots were preallocated). Collective when the layers are sharded by FSDP, and for a DoRA
  // adapter (its magnitude is the global row norms), which needs LoraSlots::use_dora. Its config's
  // `bias` mode makes those base biases trainable, unless config.inference_mode, which freezes its
  // matrices too; as in PEFT, refused when the model has another adapter and either one's bias
  // is not "none" (the biases are shared). Its modules_to_save must be modules apply_lora made
  // copies for; each copy starts as its module's current values. Its trainable_token_indices
  // must name tables apply_lora wrapped; their rows start as the tables' current rows (collective
  // over a distributed table's mesh).
  void add_adapter(const std::string& name, const LoraConfig& config);
  // PEFT's add_weighted_adapter: a new adapter `adapter_name` whose update in every layer is a
  // weighted combination of those of `adapters` (each layer holding any of them), added into a
  // free slot and frozen, as PEFT's (set_requires_grad trains it). Weights may have any sign.
  // Its config is the first adapter's with r and lora_alpha the new rank (scale 1, as PEFT's),
  // no rslora, rank or alpha pattern, the default init (its values are written, not drawn), and
  // as targets the paths of the layers it covers. With s_i an adapter's scale:
  // - "cat": A the adapters' A_i w_i s_i stacked, B their B_i side by side, rank the sum of
  //   their r: the update is exactly sum_i w_i s_i B_i A_i.
  // - "linear", "ties", "magnitude_prune", "dare_linear", "dare_ties" (equal ranks): A and B
  //   each merged on their own, A_i weighted by sign(w_i s_i) sqrt(|w_i s_i|) and B_i by
  //   sqrt(|w_i s_i|) (PEFT's: not the sum of the updates), by task arithmetic (the weighted
  //   sum), TIES (pruned by magnitude to options.density, signs elected, the agreeing values
  //   averaged), magnitude pruning then the weighted sum, or DARE (pruned at random, the kept
  //   values divided by the density; draws from options.seed) then the sum or TIES' election.
  // - the same five with "_svd" ("svd" for "linear"): the updates s_i B_i A_i merged those ways
  //   with weights w_i, then B = U S and A = V^T of its SVD truncated to options.svd_rank (else
  //   the largest r): the best approximation of that rank, clamped by svd_clamp. The SVD runs
  //   on rank 0, which sends its result to the others.
  // One adapter is always "linear", as in PEFT. Refused, before anything changes, naming what:
  // an existing adapter_name (PEFT returns without a word), an unknown adapter, weights that
  // do not pair with the adapters, a type that is none, a density missing or negative where
  // the type prunes (0 for dare, which would divide by it), an unknown
  // majority_sign_method, an svd_rank < 1 or svd_clamp outside [0, 1], DoRA adapters, adapters
  // with trainable tokens (PEFT combines only the LoRA matrices), a rank past max_rank, unequal
  // ranks in a layer for the types that need them. Collective (it reads and writes the
  // adapters' global values).
  void add_weighted_adapter(const std::vector<std::string>& adapters,
                            const std::vector<double>& weights, const std::string& adapter_name,
                            const std::string& combination_type,
                            const WeightedAdapterOptions& options = {});
  // Frees its slot (zeroes its matrices, which train again for the next adapter in it) and
  // freezes the biases its `bias` mode trained (keeping their values), unmerging the adapter
  // first if it is merged; refused
  // while the mixed batch routes samples to it. When it was the active adapter, the first
  // remaining one by name becomes active, as in PEFT (a warning on stderr says which), or none
  // when none remains. The optimizer keeps the slot's state: reset it with
  // Optimizer::reset_state(adapter_parameters(name)) before reusing the slot.
  void delete_adapter(const std::string& name);
  // The adapter every sample uses ("" for none: the base model alone). PEFT's set_adapter: a
  // merged adapter other than `name` is unmerged first (collective then).
  void set_adapter(const std::string& name);
  const std::string& active_adapter() const { return active_; }
  // PEFT's disable_adapter: the base model alone while the returned guard lives
  // (active_adapter() reads "" meanwhile). As in PEFT, a merged adapter is unmerged (collective
  // then) and stays so. When the guard goes, the active adapter and a mixed batch set aside come
  // back, unless by then an adapter is active, a mixed batch is set, or the adapters' names or
  // slots differ from when it was made: then the model stays as the calls since left it.
  DisabledAdapters disable_adapter() { return DisabledAdapters(*this); }
  // The id of an adapter in a mixed batch (its slot).
  int64_t adapter_id(const std::string& name) const;
  // A mixed batch: `ids` int64 [rows of this rank's batch], each sample's adapter id (-1: none),
  // used by every forward until cleared with an undefined tensor. Only adapters that appear get
  // gradients. Refused while an adapter is merged (it would apply to every sample), and for ids
  // of DoRA adapters (as PEFT refuses DoRA with adapter_names). A module of modules_to_save
  // gives each sample its adapter's copy (or the original), running once per distinct choice on
  // the samples that made it.
  void set_batch_adapters(const Tensor& ids);
  // PEFT's adapter_names: each sample's adapter by name, "__base__" (PEFT's name) for the base
  // model. Every name is checked first (an unknown one is refused naming the adapters there);
  // otherwise as set_batch_adapters(ids).
  void set_batch_adapters(const std::vector<std::string>& adapter_names);
  // PEFT's set_requires_grad: the adapters named train (or, with false, stay frozen: their
  // configs' inference_mode is set), with the biases of their `bias` modes. Every name is
  // checked before anything changes.
  void set_requires_grad(const std::vector<std::string>& names, bool requires_grad = true);
  // An adapter's A and B in every layer it targets, then the biases its `bias` mode trains and
  // its copies of modules_to_save (what its optimizer updates).
  std::vector<Parameter*> adapter_parameters(const std::string& name);
  // Every slot's matrices, used or free, then the biases an adapter's `bias` mode trains (an
  // optimizer made before such an adapter is added does not hold them), then every slot's
  // copies of modules_to_save.
  std::vector<Parameter*> parameters();
  // PEFT's get_nb_trainable_parameters: (trainable, all) element counts over the model's
  // parameters, global (a sharded parameter counts its whole shape, on every rank alike, without
  // communicating), each shared parameter once; trainable: requires_grad. Adapter slots count
  // at their allocated shape, [max_rank, in] and [out, max_rank], used or free: what an
  // optimizer over parameters() holds state for. print_trainable_parameters writes PEFT's line,
  // "trainable params: 1,234 || all params: 5,678 || trainable%: 21.7318", from the calling rank.
  std::pair<int64_t, int64_t> get_nb_trainable_parameters() const;
  void print_trainable_parameters(std::ostream& out = std::cout) const;

  // --- merge ---
  // W += scale B A in every layer (unmerge: -=), each rank updating its own window of W; the
  // forward then skips the adapter. Collective over the adapters' meshes. Only the active
  // adapter merges, and not while a mixed batch is set: merged, it applies to every sample.
  // safe_merge (PEFT's) first computes every layer's merged window and refuses, naming the
  // layers, when any would hold a NaN or an infinity, before any weight changes; it then
  // computes them again to write them, and agrees over every world rank (each sees its window).
  void merge_adapter(const std::string& name, bool safe_merge = false);
  void unmerge_adapter(const std::string& name);
  // PEFT's merge_and_unload: merges the active adapter (if any and not merged yet), then puts a
  // plain Linear back in place of every wrapped layer, holding the same weight and bias
  // Parameters (tensor-parallel ones stay so), and returns the model, whose state dict then has
  // the base model's keys only. unload() does the same without merging, unmerging first what is
  // merged: the base model as it was. For modules_to_save, merge_and_unload writes the active
  // adapter's copies into the modules (PEFT puts the copy in the module's place) and unload
  // leaves the originals; either way the copies leave the model. This LoraModel holds no layer
  // or adapter afterwards. Refused under fully_shard (the FSDP groups hold the adapter slots): call
  // it before fully_shard, or keep the merged LoRA layers. The base parameters stay frozen.
  // Parameter pointers taken before (an optimizer's) name the old layers' slots, which this
  // object keeps alive: make optimizers afterwards.
  ModulePtr merge_and_unload(bool safe_merge = false);
  ModulePtr unload();

  // --- values ---
  // Global tensors, "<module path>.lora_A.weight" [r, in] and ".lora_B.weight" [out, r], and for
  // DoRA ".lora_magnitude_vector" [out] (PEFT's key), per module of its modules_to_save its
  // copies, "<module path>.<name>" (PEFT's key, "output.weight"), and per table of its trainable
  // tokens "<table path>.token_adapter.trainable_tokens_delta" [ids, dim] (PEFT's key), gathered
  // (collective when distributed).
  std::map<std::string, Tensor> read_adapter(const std::string& name);
  // The same keys and global shapes, each rank copying its window; every key is checked first
  // (missing, unexpected, wrong shapes — a local shard's shape named as such), nothing is written
  // on an error. Refused for a merged adapter (unmerging would then subtract the new values).
  // Collective when distributed: the ranks agree on the checks, so a map that is wrong on one
  // rank is refused on every rank, naming it. Every rank must pass the same values.
  void write_adapter(const std::string& name, const std::map<std::string, Tensor>& tensors);

  // --- PEFT files (peft.cpp) ---
  // dir/adapter_model.safetensors (keys "base_model.model.<path>.lora_A.weight" [r, in] and
  // ".lora_B.weight" [out, r], float32 global tensors, DoRA's ".lora_magnitude_vector" [out];
  // with a `bias` mode, its biases too, in their dtype, under PEFT's names:
  // "<path>.base_layer.bias" in a wrapped layer, the parameter's name elsewhere; its copies of
  // modules_to_save as "<path>.<name>", in their dtype; its trainable tokens' rows as
  // "<path>.token_adapter.trainable_tokens_delta", in the table's dtype) and
  // dir/adapter_config.json, by rank 0. An adapter of token rows alone (no target modules) is
  // written as PEFT's TrainableTokens files: peft_type "TRAINABLE_TOKENS", its rows as
  // "<path>.trainable_tokens_delta"; load_adapter reads both kinds. Collective.
  void save_adapter(const std::string& dir, const std::string& name);
  // Adds adapter `name` from PEFT files, onto whatever mesh this model has. As PEFT's, it loads
  // for inference unless is_trainable: its config's inference_mode is then set, so its matrices
  // (and the biases of its `bias` mode) stay frozen. With a `bias` mode, the file's biases are
  // written into the base model (every adapter then sees them, as in PEFT); every key is checked
  // before anything changes. Collective.
  void load_adapter(const std::string& dir, const std::string& name, bool is_trainable = false);

  // --- checkpoints (table.cpp) ---
  // The adapter table, to save next to the model's state dict: one key, "adapters", a JSON
  // string with the slots (max_adapters, max_rank), the active adapter, and each adapter's name,
  // slot, config, whether it is merged, the layers it covers and where each layer's dropout
  // stream stands. The model's state dict holds the values (slot matrices, and base weights with
  // whatever is merged into them) by slot; the table says what they are. Loaded into a model
  // whose adapters sit in other slots, or are not merged where the saved ones were, those values
  // would apply wrongly. The dropout positions are this rank's: equal on every rank when the
  // ranks' batches have equal shapes and, for mixed batches, the same first adapter (save
  // refuses strings that differ between ranks).
  StateDict state_dict() const;
  // Makes this model's adapter table the saved one: adapters removed, or added into their saved
  // slots with their configs, merged flags and dropout stream positions, and the saved adapter
  // made active; a mixed batch is cleared. Touches no value: load the model's state dict too
  // (before or after), which holds the slot matrices and the base weights. Everything is checked
  // before anything changes: a dict without the table, slots other than this model's, an adapter
  // whose config targets other layers in this model than it covered when saved. Collective over
  // every world rank when there is more than one: the outcome is agreed, and every rank must
  // pass the same table.
  void load_state_dict(const StateDict& state);

 private:
  friend std::shared_ptr<LoraModel> apply_lora(const ModulePtr&, const LoraConfig&,
                                               const std::string&, const LoraSlots&);
  struct Adapter {
    int64_t slot = -1;
    LoraConfig config;
    std::vector<size_t> layers;  // indices into layers_
    std::vector<size_t> saved;   // indices into saved_: its modules_to_save
    // Its trainable tokens: indices into tokens_, each with its token ids.
    std::vector<std::pair<size_t, std::vector<int64_t>>> tokens;
  };
  const Adapter& find(const std::string& name, const char* op) const;
  std::map<std::string, int64_t> adapter_slots() const;  // name -> slot
  bool merged(const Adapter& a) const;
  void check_merge_is_finite(const std::string& name, const Adapter& a);
  std::vector<std::string> merged_adapters() const;
  std::vector<size_t> targets(const LoraConfig& config) const;
  // The base biases `config.bias` trains for an adapter over `layers`, each once, by PEFT key
  // (without "base_model.model."): "<path>.base_layer.bias" for a wrapped layer's bias, the
  // parameter's name for any other.
  std::vector<std::pair<std::string, Parameter*>> bias_parameters(
      const LoraConfig& config, const std::vector<size_t>& layers) const;
  void check_bias_adapters(const std::string& name, const LoraConfig& config) const;
  // This model's adapters whose bias mode is not "none" (LoraRouting::bias_adapters).
  std::vector<LoraRouting::BiasAdapter> bias_adapters() const;
  // bias_parameters of `a`, or none in inference mode: the biases it trains.
  std::vector<std::pair<std::string, Parameter*>> trained_biases(const Adapter& a) const;
  // What trains while `a` holds its slot (holds) or after it leaves it.
  void set_trainable(const Adapter& a, bool holds);
  // Moves the bias values out of a PEFT file's `values`, checked against this model's biases.
  std::vector<std::pair<Parameter*, Tensor>> take_bias_values(
      const std::string& dir, const std::string& name, const LoraConfig& cfg,
      std::map<std::string, Tensor>& values) const;
  void check_unwrappable(const char* op) const;
  ModulePtr unwrap();
  struct SavedAdapter;
  std::vector<SavedAdapter> parse_table(const std::string& text, std::string& active) const;
  // --- modules_to_save (modules_to_save.cpp) ---
  // The modules of saved_ that config.modules_to_save names, in the model's order; an error
  // names an entry that matches nothing, or a module apply_lora made no copies for.
  std::vector<size_t> saved_targets(const LoraConfig& config) const;
  // Which slot's copy each saved module computes with (its adapters'), and which copies train:
  // those of adapters not in inference mode. Run whenever adapters_ changes.
  void update_saved();
  // The copies of `a`'s modules_to_save, by key "<path>.<name>" (PEFT's, once prefixed).
  std::vector<std::pair<std::string, Parameter*>> saved_parameters(const Adapter& a) const;
  // Whether `p` belongs to a saved module or its copies (left out of bias "all").
  bool in_saved_module(const Parameter* p) const;
  // --- trainable tokens (trainable_tokens.cpp) ---
  // The tables config.trainable_token_indices names among tokens_, each with its ids, in the
  // model's order; an error names a key that matches nothing, a table apply_lora did not wrap,
  // or a table two keys name.
  std::vector<std::pair<size_t, std::vector<int64_t>>> token_targets(
      const LoraConfig& config) const;
  // The rows of `a`'s trainable tokens, by key "<path>.token_adapter.trainable_tokens_delta".
  std::vector<std::pair<std::string, Parameter*>> token_parameters(const Adapter& a) const;

  friend class DisabledAdapters;
  ModulePtr model_;
  std::vector<std::pair<std::string, std::shared_ptr<LoraLayer>>> layers_;
  std::vector<std::shared_ptr<LoraLayer>> retired_;  // unloaded, for pointers into them
  std::shared_ptr<LoraRouting> routing_;
  std::map<std::string, Adapter> adapters_;
  std::string active_;
  LoraSlots slots_;
  std::vector<std::shared_ptr<SavedModule>> saved_;  // modules_to_save, model order
  std::vector<std::pair<std::string, std::shared_ptr<TokenEmbedding>>> tokens_;  // model order
  std::vector<std::shared_ptr<TokenEmbedding>> retired_tokens_;                  // unloaded
};

// Wraps every Linear and Embedding of `model` that config.target_modules names (plain or
// tensor-parallel, before fully_shard) in a LoraLinear or LoraEmbedding, gives every module
// config.modules_to_save names its per-slot copies, wraps every Embedding
// config.trainable_token_indices names in a TokenEmbedding, freezes every other parameter of the
// model (but the adapters of an earlier apply_lora, and the biases config.bias trains), adds
// adapter `adapter_name` and makes it active. Applying it before parallelize_module or after gives
// the same model. A target matching nothing, or something other than a Linear or an Embedding, is
// an error naming it. With no targets (token rows alone, PEFT's TrainableTokensConfig) no layer
// is wrapped, and later adapters can target no layer.
std::shared_ptr<LoraModel> apply_lora(const ModulePtr& model, const LoraConfig& config,
                                      const std::string& adapter_name = "default",
                                      const LoraSlots& slots = {});

}  // namespace tessera
