// Tokens/s of one training step (forward, backward, AdamW) of the decoder at TP = 2 on 2 ranks
// (without and with sequence parallelism) against TP = 1 on one rank, same model and global
// batch, measured in the same run (TP = 1 before and after the TP runs, their mean). Run under
// `mpirun -np 2`; rank 0 alone times the unsharded run while rank 1 waits.
#include <cstdio>
#include <cstdlib>

#include "cli.h"
#include "decoder_step.h"

using namespace tessera;

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  TESSERA_CHECK(world_size() == 2, "bench/train_step runs on 2 ranks (mpirun -np 2)");
  TESSERA_CHECK(argc <= 2, "usage: train_step [STEPS]");
  const int steps = argc > 1 ? int(cli::parse_int("train_step: STEPS", argv[1], 1, 100000)) : 10;
  const int64_t batch = 8, seq = 128;
  const DecoderConfig cfg = bench::decoder_config();
  const bench::TokenBatch tokens = bench::random_tokens(batch, seq, cfg.vocab_size, 11);
  // The baseline before and after the TP runs, their mean taken: a drift of the machine's load
  // during the run moves both sides of the ratios.
  const double t1_before = bench::one_rank_step_seconds(cfg, tokens, steps);
  DeviceMesh mesh({2}, {"tp"});
  auto tp_step = [&](bool sequence_parallel) {
    auto model = std::make_shared<Decoder>(cfg);
    DecoderTPOptions opts;
    opts.sequence_parallel = sequence_parallel;
    parallelize_module(model, mesh, decoder_tp_plan(cfg, mesh, opts));
    return bench::median_step_seconds(*model, tokens, 2, steps, mesh.group(0));
  };
  const double t2 = tp_step(false), t2_sp = tp_step(true);
  const double t1_after = bench::one_rank_step_seconds(cfg, tokens, steps);
  const double t1 = 0.5 * (t1_before + t1_after);
  if (world_rank() == 0) {
    const double n = double(batch * seq);
    std::printf(
        "{\"benchmark\": \"train_step\", \"model\": {\"dim\": %lld, \"layers\": %lld, \"heads\": "
        "%lld, \"kv_heads\": %lld, \"ffn\": %lld, \"vocab\": %lld}, \"global_batch\": %lld, "
        "\"seq\": %lld, \"tp1_ms\": %.2f, \"tp1_ms_before\": %.2f, \"tp1_ms_after\": %.2f, "
        "\"tp2_ms\": %.2f, \"tp1_tokens_per_s\": %.0f, "
        "\"tp2_tokens_per_s\": %.0f, \"tp2_over_tp1\": %.3f, \"tp2_sequence_parallel_ms\": %.2f, "
        "\"tp2_sequence_parallel_over_tp1\": %.3f}\n",
        (long long)cfg.dim, (long long)cfg.n_layers, (long long)cfg.n_heads,
        (long long)cfg.n_kv_heads, (long long)cfg.ffn_dim, (long long)cfg.vocab_size,
        (long long)batch, (long long)seq, t1 * 1e3, t1_before * 1e3, t1_after * 1e3, t2 * 1e3,
        n / t1, n / t2, t1 / t2, t2_sp * 1e3, t1 / t2_sp);
  }
  return 0;
}
