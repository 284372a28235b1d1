#pragma once
// The small decoder that the FSDP schedule tests train, and each rank's rows of a step's batch.
#include <utility>

#include "tessera/tessera.h"

namespace tessera::fsdp_test {

inline DecoderConfig tiny_config() {
  DecoderConfig cfg;
  cfg.vocab_size = 32;
  cfg.dim = 32;
  cfg.n_layers = 3;
  cfg.n_heads = 4;
  cfg.n_kv_heads = 2;
  cfg.ffn_dim = 48;
  cfg.max_seq_len = 8;
  cfg.seed = 5;
  return cfg;
}

// This rank's rows of step `step`'s batch.
inline std::pair<Tensor, Tensor> tokens(int step) {
  Generator gen(uint64_t(1000 + 31 * step + world_rank()));
  Tensor u = rand({2, 9}, gen, DType::Float64);
  Tensor ids = empty({2, 9}, DType::Int64);
  for (int64_t i = 0; i < ids.numel(); ++i)
    ids.data<int64_t>()[i] = int64_t(u.data<double>()[i] * 32);
  return {kernels::narrow(ids, 1, 0, 8).contiguous(), kernels::narrow(ids, 1, 1, 8).contiguous()};
}

}  // namespace tessera::fsdp_test
