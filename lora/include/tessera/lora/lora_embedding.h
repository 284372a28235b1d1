#pragma once
// LoraEmbedding: an Embedding with low-rank adapters, PEFT's lora.Embedding:
//   y = W[ids] + sum over adapters of scale * A^T[ids] B^T,
// W the table [num_embeddings, dim], A "lora_embedding_A" [r, num_embeddings] and B
// "lora_embedding_B" [dim, r] (PEFT's names and shapes: for LoRA the table is the transposed
// weight of a map from one-hot ids, so A and B are a Linear's, see lora_layer.h). It takes over
// the wrapped table under its own name; each slot adds "lora_embedding_A.<slot>.weight" [max_rank,
// num_embeddings] and "lora_embedding_B.<slot>.weight" [dim, max_rank].
//
// As in PEFT, lora_dropout does not apply to an Embedding's adapters, every initialisation but
// LoraInit::Random starts A at zero and B normal (mean 0, std 1), and DoRA is PEFT's
// DoraEmbeddingVariant: y = g (W[ids] + scale A^T[ids] B^T), g = m / ||W^T + scale B A|| per output
// feature (a column of the table), m [dim] laid out as B's rows; a vocabulary-parallel table's
// forward then makes one all-reduce of [dim] more (the norms' squares over the vocabulary).
//
// Placements follow the table's: a vocabulary-parallel table (Shard(0), RowwiseParallel) gives A
// Shard(1) and B replicated, and the partial lookups of the table and of A^T travel together in
// the layer's one reduction, after which B applies to replicated activations (the layer issues
// the collectives the plain one does, in the forward and the backward); a table split on dim 1
// (ColwiseParallel) gives A replicated and B Shard(0): no collective in the forward, and one
// all-reduce of the activations' gradient [..., r] in the backward, which the plain table does
// not make (A's gradient is the sum over B's rows, which the ranks split).
//
// A Decoder under tie_embeddings projects its output through the table (output_projection):
// with ensure_weight_tying the adapters apply there too, as PEFT's tied lm_head adapter
// (lora_A = B^T, lora_B = A^T): logits = h W^T + scale (dropout(h) B) A, so that they are the
// logits of the merged table, and A and B get the gradients of both uses.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/lora/lora_layer.h"

namespace tessera {

class LoraEmbedding : public Embedding, public LoraLayer {
 public:
  // Wraps `base` (plain or tensor-parallel) with `slots` preallocated adapter slots.
  LoraEmbedding(const Embedding& base, const LoraSlots& slots,
                std::shared_ptr<LoraRouting> routing);

  Tensor forward(const Tensor& ids) override;
  DTensor forward_dtensor(const DTensor& ids) override;
  Tensor output_projection(const Tensor& h) override;
  void after_tensor_parallel(const DeviceMesh& mesh) override { distribute_adapters(mesh); }
  std::vector<std::pair<std::string, std::string>> tensor_parallel_inputs() const override {
    return describe_adapters();
  }

  using LoraLayer::module;
  Module& module() override { return *this; }
  ModulePtr unwrapped() const override { return Embedding::unwrapped(*this); }
  Parameter& base_weight() override { return weight; }
  std::string adapter_key(bool a) const override {
    return a ? "lora_embedding_A" : "lora_embedding_B";
  }

  void init_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                 const std::string& path) override;
};

}  // namespace tessera
