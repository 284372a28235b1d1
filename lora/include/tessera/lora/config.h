#pragma once
// LoraConfig: PEFT's LoraConfig fields with PEFT's meaning.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessera {

// PEFT's init_lora_weights: true (kaiming-uniform A with a = sqrt(5), B zero: the adapter starts
// as the identity), "gaussian" (A ~ N(0, 1/r), B zero), false (B drawn too, as nn.Linear would:
// the adapter changes the output from the start; for tests), "orthogonal" (PEFT's: Q from the QR
// of an [r, r] normal draw, A = (G [in, r/2] Q's even rows)^T / 10 and B = H^T [out, r/2] Q's odd
// rows / 10 with G and H normal draws, so that B A = 0, the identity again, with both non-zero;
// r must be even).
enum class LoraInit { Kaiming, Gaussian, Random, Orthogonal };

struct LoraConfig {
  int64_t r = 8;
  double lora_alpha = 8;
  double lora_dropout = 0.0;
  // PEFT's list form: an entry names every module whose path equals it or ends in "." + entry
  // ("wq": every wq; "attention.wq": every block's). Entries may also be patterns, fnmatch per
  // path component ("layers.[0-3].attention.w*"; '*' never reaches across a '.'), matched
  // against the path's last components. Each must match Linear modules only. {"all-linear"}
  // (kAllLinear, alone) is PEFT's "all-linear": every Linear of the model but its output layer
  // (a Decoder's `output`, its lm_head; any other model has none). Empty, with
  // target_modules_regex empty too: no LoRA layer at all, the adapter training only the token rows
  // trainable_token_indices names. That is PEFT's TrainableTokensConfig method (PEFT loads no LoRA
  // adapter without targets), whose files save_adapter then writes and load_adapter reads; it
  // has no modules_to_save, bias, use_dora, exclude_modules, layers_to_transform, rank_pattern
  // or alpha_pattern (refused with it).
  std::vector<std::string> target_modules;
  // PEFT's string form of target_modules: a regular expression (ECMAScript, which PEFT's common
  // ones read alike in) that a module's whole path from the model's root must match
  // ("layers\\.[01]\\.attention\\.w[qv]"), in place of the list (set one of the two).
  // layers_to_transform does not apply with it (PEFT refuses the pair too).
  std::string target_modules_regex;
  // PEFT's exclude_modules, list form: entries matched as target_modules' are, and a module one
  // matches is left out even where target_modules (or "all-linear") names it.
  std::vector<std::string> exclude_modules;
  // PEFT's string form of exclude_modules: a module whose whole path matches it is left out (in
  // place of the list: set one of the two).
  std::string exclude_modules_regex;
  // PEFT's modules_to_save: modules (entries matched as target_modules' are) that train in full
  // beside the adapter, each as a copy of its parameters that the adapter owns: while the
  // adapter is active the module computes with its copy, made from the module's values when
  // the adapter is added; the original stays frozen, and other adapters and the base model see
  // it. A module named here has parameters of its own and no submodules (a Linear, an
  // Embedding, a norm), and is no LoRA target. apply_lora makes the copies (LoraSlots::
  // max_adapters of them), so a later adapter may name only modules the first one named.
  std::vector<std::string> modules_to_save;
  // PEFT's trainable_token_indices: per Embedding, the token ids whose rows of its table train
  // with the adapter, the rest of the table staying frozen (new special tokens, without
  // modules_to_save's copy of the whole table). A key names modules as a target_modules entry
  // does; the key "" is PEFT's list form, the model's input embedding (a Decoder's
  // tok_embeddings, else the model's only Embedding). The rows start as the table's and are
  // PEFT's trainable_tokens_delta (see token_embedding.h). apply_lora wraps the tables, so a
  // later adapter may name only tables the first one named, with at most
  // LoraSlots::max_trainable_tokens ids each. A table named here is no LoRA target.
  std::vector<std::pair<std::string, std::vector<int64_t>>> trainable_token_indices;
  // PEFT's rank_pattern and alpha_pattern: a module whose path matches a key takes its value as r
  // (lora_alpha) instead of the global one; its scale comes from its own r and alpha. Keys are
  // regular expressions (ECMAScript, which PEFT's common keys read alike in) matched as PEFT's
  // get_pattern_key does: the whole path, or a "."-separated tail of it, matches the key; the
  // first key that matches, in this order (a file's order), wins.
  std::vector<std::pair<std::string, int64_t>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;
  // PEFT's layers_to_transform and layers_pattern: when layers_to_transform is set, a module a
  // target entry matches by suffix or pattern (not one whose whole path an entry is) is adapted
  // only inside the layers it lists. A module's layer is the number after the last component of
  // its path that layers_pattern's regular expressions match ("layers" in "layers.3.attention.wq"),
  // or, without layers_pattern, after the last component followed by a number and more path.
  std::vector<int64_t> layers_to_transform;
  std::vector<std::string> layers_pattern;
  // alpha / sqrt(r) instead of alpha / r.
  bool use_rslora = false;
  LoraInit init_lora_weights = LoraInit::Kaiming;
  // PEFT's: which of the base model's biases train with the adapter. "none": none; "all": every
  // parameter whose name contains "bias"; "lora_only": the biases of the layers the adapter
  // targets. They are the base model's, shared by every adapter, so only a model's single
  // adapter may have bias other than "none" (as in PEFT), and save_adapter writes them with the
  // adapter.
  std::string bias = "none";
  // PEFT's: the adapter's matrices, and the biases of its `bias` mode, stay frozen (serving, or
  // a fixed reference model). load_adapter(dir, name, is_trainable = false) sets it.
  bool inference_mode = false;
  // PEFT's DoRA: a trainable magnitude m [out] per wrapped layer, initialised to the row norms of
  // W + scale B A, and the output y = base(x) + (m / ||W + scale B A|| - 1) (x W^T) +
  // (m / ||W + scale B A||) scale (x A^T) B^T, the norm taken per output row over the input dim
  // and detached from the graph (the DoRA paper, section 4.3). The model's LoraSlots must hold
  // magnitude vectors (LoraSlots::use_dora; apply_lora sets it for a DoRA adapter).
  bool use_dora = false;
  // PEFT's ensure_weight_tying: a table that is also the output projection (a Decoder under
  // tie_embeddings) may be a target, and its adapter applies to both uses: the lookup and the
  // projection (PEFT's tied lm_head adapter: lora_A = B^T, lora_B = A^T, with lora_dropout on
  // the projection's input), so that merged and unmerged give the same logits. Without it such
  // a table is refused as a target. Not with DoRA.
  bool ensure_weight_tying = false;
  // An adapter's initial values depend on this seed, the adapter's name and the module's path
  // only: the same under any mesh or parallelism.
  uint64_t seed = 0;

  double scaling() const;  // lora_alpha / r, or / sqrt(r) with use_rslora
  // The r and lora_alpha of the module at `path` (rank_pattern, alpha_pattern, else the global).
  int64_t rank_for(const std::string& path) const;
  double alpha_for(const std::string& path) const;
  // This config with the r and lora_alpha of the module at `path`: what its layer holds.
  LoraConfig for_module(const std::string& path) const;
  bool all_linear() const;  // target_modules is {"all-linear"}
  // Whether target_modules or target_modules_regex names LoRA targets (false: token rows
  // alone).
  bool has_targets() const;
  // The target entries: target_modules', or target_modules_regex alone.
  std::vector<std::string> target_entries() const;
  // Whether target_modules_regex (exclude_modules_regex) matches the whole of `path`.
  bool regex_targets(const std::string& path) const;
  bool regex_excludes(const std::string& path) const;
  // The layer index of the module at `path` under layers_pattern (the rule above), or -1.
  int64_t layer_index(const std::string& path) const;
  // Whether layers_to_transform keeps the module at `path`, which a target entry matched.
  bool in_transformed_layers(const std::string& path) const;
  // An error naming the field for r <= 0, alpha <= 0, dropout outside [0, 1), no targets and no
  // trainable_token_indices (an adapter that trains nothing), no targets with a field only LoRA
  // layers use (above), both
  // forms of the targets or of the excludes, a target or exclude regex that does not compile, a
  // bias other than "none", "all" and "lora_only", an odd r with the orthogonal init, "all-linear"
  // beside other targets, "all-linear" or a target regex with layers_to_transform, an empty
  // exclude_modules entry, a pattern key that is not a regular expression or whose value is not a
  // valid r (alpha), a negative layer, layers_pattern without layers_to_transform or not a regular
  // expression, an empty modules_to_save entry or "all-linear" there, a trainable_token_indices
  // key listed twice, with no ids, a negative id or one listed twice.
  void validate() const;
};

// "all-linear" never reaches a layer another LoraModel holds. A layer an earlier apply_lora
// wrapped holds that LoraModel's slots: a second apply_lora refuses it when an entry names it
// (its adapters go in with that model's add_adapter), and with "all-linear" passes over it, so
// that it adapts every other Linear but the output layer (PEFT's second injection would add to
// the adapted layers too: here the first LoraModel's add_adapter does). A LoraModel's add_adapter
// with "all-linear" likewise covers its own layers and leaves out any other LoraModel's.
inline constexpr const char* kAllLinear = "all-linear";

// Whether target_modules entry `entry` names the module at `path` (the rule above).
bool lora_target_matches(const std::string& entry, const std::string& path);

// Preallocated adapter slots, fixed when LoRA is applied: adapters can then be added and removed
// later (after fully_shard too) without wrapping the model again. Every slot holds A [max_rank,
// in] and B [out, max_rank]; an adapter of rank r < max_rank uses the first r and keeps the rest
// zero (they then get zero gradients and stay zero).
struct LoraSlots {
  int64_t max_adapters = 1;
  int64_t max_rank = 0;  // 0: the largest r the first adapter uses (rank_pattern included)
  // Every slot also holds a DoRA magnitude vector "lora_magnitude_vector.<slot>.weight" [out], so
  // that DoRA adapters can be added later; apply_lora sets it when its adapter uses DoRA.
  bool use_dora = false;
  // Rows per slot of each table trainable_token_indices names; 0: the most ids the first adapter
  // lists for one table.
  int64_t max_trainable_tokens = 0;
};

}  // namespace tessera
