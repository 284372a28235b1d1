#pragma once
// TokenEmbedding: PEFT's trainable tokens (LoraConfig::trainable_token_indices; PEFT's
// TrainableTokensWrapper around a TrainableTokensLayer). An adapter trains the rows of a few
// token ids of an Embedding's table (new special tokens, say) instead of the whole table:
//   y = W'[ids],  W' = W with row indices[j] replaced by delta[j],
// which is PEFT's forward (W.index_copy(0, indices, delta), then the lookup), computed without
// copying W: the lookup of W, then the replaced ids' rows taken from delta.
//
// Each adapter slot holds "token_adapter.trainable_tokens_delta.<slot>" [max_tokens, dim], in
// W's dtype: the new rows themselves (PEFT's name; not a difference from W), starting as W's rows
// of those ids. An adapter with fewer ids uses the first rows; the others stay zero and are
// never read. The ids are the adapter's config's: the adapter table holds them, the model's
// state dict only the rows.
//
// Placements follow the table's, mesh dim by mesh dim: a vocabulary-parallel table (Shard(0))
// gives delta replicated, a table split on dim 1 gives delta Shard(1), a replicated one
// replicated; fully_shard then shards delta like any parameter. A vocabulary-parallel lookup
// stays one reduction: the new rows join the partial output, kept on one rank of each group,
// before the reduction the plain table makes.
//
// Merged, delta's rows are written into W (each rank its own window) and the forward reads W
// alone; the replaced rows are kept in memory to unmerge (PEFT keeps them too), so a checkpoint
// taken while merged cannot be restored.
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/lora/lora_layer.h"

namespace tessera {

class TokenAdapter;  // the child "token_adapter", holding the slots' rows

class TokenEmbedding : public Embedding {
 public:
  // Wraps `base` (plain or tensor-parallel) with `slots` slots of `max_tokens` rows each.
  TokenEmbedding(const Embedding& base, int64_t slots, int64_t max_tokens,
                 std::shared_ptr<LoraRouting> routing);

  Tensor forward(const Tensor& ids) override;
  DTensor forward_dtensor(const DTensor& ids) override;
  // Under a Decoder's tie_embeddings: the projection onto the table with the active adapter's
  // rows in place (PEFT's tied adapter on the output layer), so that those ids' logits read the
  // trained rows too and the rows get both gradients; in a mixed batch each sample's logits
  // read its own adapter's rows.
  Tensor output_projection(const Tensor& h) override;
  void after_tensor_parallel(const DeviceMesh& mesh) override;
  std::vector<std::pair<std::string, std::string>> tensor_parallel_inputs() const override;
  // A plain Embedding holding the same table (LoraModel::unload).
  ModulePtr unwrapped() const { return Embedding::unwrapped(*this); }

  int64_t num_slots() const { return int64_t(slots_.size()); }
  int64_t max_tokens() const { return max_tokens_; }
  // Slot i's token ids, in the adapter's order (empty: a free slot), and whether it is merged.
  const std::vector<int64_t>& token_indices(int64_t i) const;
  bool merged(int64_t i) const;
  Parameter& trainable_tokens_delta(int64_t i);

  // Puts `indices` in slot i, its rows starting as the table's current rows of those ids
  // (collective over the table's mesh when it is distributed). Refused, naming `path`, for a
  // merged slot, no ids, more ids than max_tokens, an id listed twice or out of range.
  void init_slot(int64_t i, const std::vector<int64_t>& indices, const std::string& path);
  // Frees slot i (its rows zeroed), unmerged.
  void clear_slot(int64_t i);
  // Writes slot i's rows into the table, keeping the rows they replace (unmerge: writes those
  // back). Collective over the table's and delta's meshes.
  void merge_slot(int64_t i, bool unmerge);
  // Whether slot i's rows are finite in the table's dtype (safe_merge), the same on every rank.
  bool merge_is_finite(int64_t i) const;
  // A checkpoint's slot i: its ids and merged flag, the values coming from the state dict.
  void restore_slot(int64_t i, const std::vector<int64_t>& indices, bool merged);

 private:
  struct Slot {
    std::vector<int64_t> indices;
    std::unordered_map<int64_t, int64_t> row_of;  // id -> its row of delta
    bool merged = false;
    Tensor replaced;  // merged: the table's rows it replaced, global [n, dim]
    // For the tied projection, made when first needed: each vocabulary row's row of delta (0
    // where none), int64 [num_embeddings], and whether it is replaced, bool [num_embeddings, 1].
    Tensor vocab_rows, vocab_replaced;
  };
  // Whether slot s holds rows that this forward reads (an adapter's, not merged).
  bool applies(int64_t s) const;
  // Slot s with its vocab_rows and vocab_replaced made (on `device`).
  const Slot& vocab_map(int64_t s, Device device);
  // Which row of the stacked deltas each id reads, for this forward's adapters.
  struct Lookup {
    std::vector<int64_t> slots;     // stacked in this order
    Tensor pos;                     // int64, the ids' shape (0 where the id is not replaced)
    Tensor replace;                 // bool, the ids' shape + [1]
    std::vector<int64_t> replaced;  // the same on the host, 0 or 1 per id
  };
  // False when the routing applies no slot of this table (the same on every rank, whatever its
  // ids); else the rows each id of `ids` (this rank's piece) reads.
  bool lookup(const Tensor& ids, Lookup& out) const;
  // The table's global rows of `indices` (collective over its mesh when distributed).
  Tensor table_rows(const std::vector<int64_t>& indices) const;
  // Writes global rows `rows` [n, dim] into the table at `indices`, each rank its window.
  void write_table_rows(const std::vector<int64_t>& indices, const Tensor& rows);
  void check_slot(int64_t i, const char* op) const;

  int64_t max_tokens_;
  std::shared_ptr<LoraRouting> routing_;
  std::shared_ptr<TokenAdapter> adapter_;
  std::vector<Slot> slots_;
};

}  // namespace tessera
