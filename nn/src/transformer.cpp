// The LLaMA-style decoder around Attention (attention.cpp): config checks, the SwiGLU MLP, the
// pre-norm residual block and the full model.
#include "tessera/nn/transformer.h"

#include <string>

#include "tessera/autograd/ops.h"

namespace tessera {

void DecoderConfig::validate() const {
  auto positive = [](int64_t v, const char* field) {
    TESSERA_CHECK(v > 0, "DecoderConfig: ", field, " must be positive, got ", v);
  };
  positive(vocab_size, "vocab_size");
  positive(dim, "dim");
  positive(n_layers, "n_layers");
  positive(n_heads, "n_heads");
  positive(n_kv_heads, "n_kv_heads");
  positive(ffn_dim, "ffn_dim");
  positive(max_seq_len, "max_seq_len");
  TESSERA_CHECK(dim % n_heads == 0, "DecoderConfig: dim (", dim, ") must be divisible by n_heads (",
                n_heads, ")");
  TESSERA_CHECK(n_kv_heads <= n_heads && n_heads % n_kv_heads == 0, "DecoderConfig: n_heads (",
                n_heads, ") must be a multiple of n_kv_heads (", n_kv_heads,
                ") for grouped-query attention");
  TESSERA_CHECK(head_dim() % 2 == 0, "DecoderConfig: head_dim = dim / n_heads = ", dim, " / ",
                n_heads, " = ", head_dim(), " must be even for rotary embeddings");
  TESSERA_CHECK(norm_eps > 0, "DecoderConfig: norm_eps must be positive, got ", norm_eps);
  TESSERA_CHECK(rope_theta > 0, "DecoderConfig: rope_theta must be positive, got ", rope_theta);
}

FeedForward::FeedForward(const DecoderConfig& cfg, Generator& gen) : Module("FeedForward") {
  w1 = std::make_shared<Linear>(cfg.dim, cfg.ffn_dim, false, gen);
  w2 = std::make_shared<Linear>(cfg.ffn_dim, cfg.dim, false, gen);
  w3 = std::make_shared<Linear>(cfg.dim, cfg.ffn_dim, false, gen);
  register_module("w1", w1);
  register_module("w2", w2);
  register_module("w3", w3);
}

Tensor FeedForward::forward(const Tensor& x) {
  return (*w2)(mul(silu((*w1)(x)), (*w3)(x)));
}

DecoderBlock::DecoderBlock(const DecoderConfig& cfg, Generator& gen) : Module("DecoderBlock") {
  // Registered in execution order; only the Linears draw from `gen`, attention's first.
  attention_norm = std::make_shared<RMSNorm>(cfg.dim, cfg.norm_eps);
  attention = std::make_shared<Attention>(cfg, gen);
  ffn_norm = std::make_shared<RMSNorm>(cfg.dim, cfg.norm_eps);
  feed_forward = std::make_shared<FeedForward>(cfg, gen);
  register_module("attention_norm", attention_norm);
  register_module("attention", attention);
  register_module("ffn_norm", ffn_norm);
  register_module("feed_forward", feed_forward);
}

Tensor DecoderBlock::forward(const Tensor& x) {
  Tensor h = add(x, (*attention)((*attention_norm)(x)));
  return add(h, (*feed_forward)((*ffn_norm)(h)));
}

namespace {

// PyTorch's ModuleList for Decoder::layers: names the blocks "0", "1", ... so that their paths
// read "layers.3.attention.wq". Its slots are the elements of Decoder::layers, so replacing
// "layers.3" (FSDP, LoRA) replaces the block the decoder runs.
class BlockList final : public Module {
 public:
  explicit BlockList(std::shared_ptr<std::vector<std::shared_ptr<DecoderBlock>>> blocks)
      : Module("ModuleList"), blocks_(std::move(blocks)) {
    for (size_t i = 0; i < blocks_->size(); ++i)
      register_module(std::to_string(i), (*blocks_)[i]);
  }

 private:
  // Co-owned with the decoder: the slots above refer to its elements.
  std::shared_ptr<std::vector<std::shared_ptr<DecoderBlock>>> blocks_;
};

}  // namespace

Decoder::Decoder(const DecoderConfig& cfg) : Module("Decoder"), layers(*blocks), cfg_(cfg) {
  cfg_.validate();
  Generator gen(cfg_.seed);
  tok_embeddings = std::make_shared<Embedding>(cfg_.vocab_size, cfg_.dim, gen);
  register_module("tok_embeddings", tok_embeddings);

  // BlockList's slots point into `layers` (which it co-owns), which therefore never reallocates
  // after this.
  layers.reserve(size_t(cfg_.n_layers));
  for (int64_t i = 0; i < cfg_.n_layers; ++i)
    layers.push_back(std::make_shared<DecoderBlock>(cfg_, gen));
  // Fixed: forward runs `layers`, so another list put in its place would be listed, saved and
  // optimized while forward ran these blocks.
  register_fixed_module("layers", std::make_shared<BlockList>(blocks),
                        "replace the blocks themselves (\"layers.0\", ...)");

  norm = std::make_shared<RMSNorm>(cfg_.dim, cfg_.norm_eps);
  register_module("norm", norm);
  if (!cfg_.tie_embeddings) {
    output = std::make_shared<Linear>(cfg_.dim, cfg_.vocab_size, false, gen);
    register_module("output", output);
  }
}

Tensor Decoder::forward(const Tensor& ids) {
  TESSERA_CHECK(ids.defined() && ids.dtype() == DType::Int64 && ids.dim() == 2,
                "Decoder: token ids must be int64 [B, T], got ",
                ids.defined() ? ids.str() : std::string("undefined"));
  TESSERA_CHECK(ids.size(1) <= cfg_.max_seq_len, "Decoder: sequence length ", ids.size(1),
                " of ids ", shape_str(ids.shape()), " exceeds max_seq_len ", cfg_.max_seq_len);
  Tensor h = (*tok_embeddings)(ids);
  for (const auto& layer : layers)
    h = (*layer)(h);
  h = (*norm)(h);
  if (output) return (*output)(h);

  // Tied: the output projection is the embedding table read as [vocab, dim], so it needs the
  // whole table, as the lookup does: one the tensor-parallel plan left replicated, or one that
  // fully_shard gathered for this forward (then a plain tensor with no DTensor to ask).
  const Parameter& table = tok_embeddings->weight;
  const bool whole = table.is_unsharded()
                         ? table.local().shape() == table.global_shape()
                         : !table.is_dtensor() || table.dtensor().spec().is_replicated();
  TESSERA_CHECK(whole, "Decoder: tie_embeddings needs a replicated tok_embeddings.weight, got ",
                table.str(),
                "; leave tied embeddings replicated when parallelizing, and fully_shard them "
                "with the decoder, not with tok_embeddings alone");
  return tok_embeddings->output_projection(h);
}

}  // namespace tessera
