#pragma once
// What the decoder step benchmarks share: the model size, a random token batch, and the timed
// training step (forward, backward, AdamW).
#include <algorithm>
#include <chrono>
#include <vector>

#include "stats.h"
#include "tessera/tessera.h"

namespace tessera::bench {

inline double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

inline DecoderConfig decoder_config() {
  DecoderConfig cfg;
  cfg.vocab_size = 512;
  cfg.dim = 256;
  cfg.n_layers = 4;
  cfg.n_heads = 8;
  cfg.n_kv_heads = 4;
  cfg.ffn_dim = 704;
  cfg.max_seq_len = 128;
  cfg.seed = 7;
  return cfg;
}

struct TokenBatch {
  Tensor inputs, targets;  // int64 [rows, seq]
};

inline TokenBatch random_tokens(int64_t rows, int64_t seq, int64_t vocab, uint64_t seed) {
  Generator gen(seed);
  Tensor u = rand({rows, seq + 1}, gen, DType::Float64);
  Tensor ids = empty({rows, seq + 1}, DType::Int64);
  for (int64_t i = 0; i < ids.numel(); ++i)
    ids.data<int64_t>()[i] = int64_t(u.data<double>()[i] * double(vocab));
  return {kernels::narrow(ids, 1, 0, seq).contiguous(),
          kernels::narrow(ids, 1, 1, seq).contiguous()};
}

// Median seconds of `steps` timed training steps after `warmup` untimed ones; with `sync`, every
// step starts and ends at a barrier of that group so the slowest rank sets the time.
inline double median_step_seconds(Decoder& model, const TokenBatch& batch, int warmup, int steps,
                                  const ProcessGroupPtr& sync) {
  AdamW opt(model.parameters(), {});
  std::vector<double> t;
  for (int s = 0; s < warmup + steps; ++s) {
    if (sync) sync->barrier()->wait();
    const double t0 = now_seconds();
    backward(cross_entropy(model(batch.inputs), batch.targets));
    opt.step();
    opt.zero_grad();
    if (sync) sync->barrier()->wait();
    if (s >= warmup) t.push_back(now_seconds() - t0);
  }
  return median(t);
}

// The baseline of the scaling benchmarks: the unsharded model's median step on rank 0 alone,
// the other ranks waiting at a barrier (0 on them).
inline double one_rank_step_seconds(const DecoderConfig& cfg, const TokenBatch& batch, int steps) {
  double t = 0;
  if (world_rank() == 0) {
    auto model = std::make_shared<Decoder>(cfg);
    t = median_step_seconds(*model, batch, 2, steps, nullptr);
  }
  world_group()->barrier()->wait();
  return t;
}

}  // namespace tessera::bench
