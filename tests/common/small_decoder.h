#pragma once
// The small decoder of the FSDP and checkpoint parity tests: two blocks of width 32 with
// grouped-query attention (4 heads over 2 kv heads), sequences of kSmallSeq tokens, batches of
// kSmallBatch rows (even over 1, 2, 4 and 8 data-parallel ranks).
#include <cstdint>

#include "tessera/nn/transformer.h"

namespace tessera::testing {

constexpr int64_t kSmallBatch = 8;
constexpr int64_t kSmallSeq = 8;

inline DecoderConfig small_decoder_config(uint64_t seed = 7) {
  DecoderConfig cfg;
  cfg.vocab_size = 32;
  cfg.dim = 32;
  cfg.n_layers = 2;
  cfg.n_heads = 4;
  cfg.n_kv_heads = 2;
  cfg.ffn_dim = 64;
  cfg.max_seq_len = kSmallSeq;
  cfg.seed = seed;
  return cfg;
}

}  // namespace tessera::testing
