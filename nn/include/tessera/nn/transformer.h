#pragma once
// A LLaMA-style decoder: token embedding, blocks of (RMSNorm, grouped-query causal attention
// with rotary embeddings, RMSNorm, SwiGLU MLP) with residuals, final RMSNorm, output projection.
// Projections are separate (wq, wk, wv, wo, w1, w2, w3), never fused, so every parameter's
// global tensor is already in the logical order under any tensor-parallel degree.
#include "tessera/nn/layers.h"

namespace tessera {

struct DecoderConfig {
  int64_t vocab_size = 256;
  int64_t dim = 64;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 4;  // < n_heads: grouped-query attention
  int64_t ffn_dim = 176;
  int64_t max_seq_len = 128;
  bool tie_embeddings = false;  // output projection shares the embedding weight
  double norm_eps = 1e-6;
  double rope_theta = 10000.0;
  uint64_t seed = 0;
  int64_t head_dim() const { return dim / n_heads; }
  void validate() const;  // errors name the offending field
};

// x [B, T, dim] -> [B, T, dim]. Under tensor parallelism wq/wk/wv are column-parallel and wo
// row-parallel; the local head counts follow from the local weight shapes.
class Attention : public Module {
 public:
  Attention(const DecoderConfig& cfg, Generator& gen);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<Linear> wq, wk, wv, wo;

 private:
  void check_head_split() const;
  int64_t n_heads_, n_kv_heads_, head_dim_;
  // Derived tables [max_seq_len, head_dim / 2], deliberately not buffers: not in state_dict.
  Tensor rope_cos_, rope_sin_;
};

// SwiGLU: w2(silu(w1 x) * w3 x).
class FeedForward : public Module {
 public:
  FeedForward(const DecoderConfig& cfg, Generator& gen);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<Linear> w1, w2, w3;
};

class DecoderBlock : public Module {
 public:
  DecoderBlock(const DecoderConfig& cfg, Generator& gen);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<RMSNorm> attention_norm, ffn_norm;
  std::shared_ptr<Attention> attention;
  std::shared_ptr<FeedForward> feed_forward;
};

namespace detail {
// The decoder's blocks, shared with its "layers" list, whose slots are the elements: the list held
// alone (get_submodule("layers")) keeps them, and stays valid, after the decoder is gone. A base of
// Decoder, so that it exists before Decoder::layers refers to it.
struct DecoderBlocks {
  std::shared_ptr<std::vector<std::shared_ptr<DecoderBlock>>> blocks =
      std::make_shared<std::vector<std::shared_ptr<DecoderBlock>>>();
};
}  // namespace detail

// Token ids int64 [B, T] -> logits [B, T, vocab].
class Decoder : private detail::DecoderBlocks, public Module {
 public:
  explicit Decoder(const DecoderConfig& cfg);
  Tensor forward(const Tensor& ids) override;
  const DecoderConfig& config() const { return cfg_; }

  std::shared_ptr<Embedding> tok_embeddings;
  // Registered as the child "layers" with children "0", "1", ...; fixed after construction: a
  // block is replaced through its path ("layers.3"), the list itself cannot be.
  std::vector<std::shared_ptr<DecoderBlock>>& layers;
  std::shared_ptr<RMSNorm> norm;
  std::shared_ptr<Linear> output;  // null when tie_embeddings

 private:
  DecoderConfig cfg_;
};

}  // namespace tessera
