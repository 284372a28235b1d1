// Tokens/s of one training step (forward, backward, AdamW) of the decoder at TP = 2 on 2 ranks
// against TP = 1 on one rank, same model and global batch, measured in the same run. Run under
// `mpirun -np 2`; rank 0 alone times the unsharded run while rank 1 waits.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "tessera/tessera.h"

using namespace tessera;

namespace {

double now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

DecoderConfig bench_config() {
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

// Median seconds per step over `steps` timed steps after `warmup` untimed ones.
double time_steps(Decoder& model, int warmup, int steps, int64_t batch, int64_t seq,
                  const ProcessGroupPtr& sync) {
  AdamW opt(model.parameters(), {});
  Generator gen(11);
  Tensor ids = empty({batch, seq + 1}, DType::Int64);
  Tensor u = rand({batch, seq + 1}, gen, DType::Float64);
  for (int64_t i = 0; i < ids.numel(); ++i)
    ids.data<int64_t>()[i] = int64_t(u.data<double>()[i] * double(model.config().vocab_size));
  Tensor inputs = kernels::narrow(ids, 1, 0, seq).contiguous();
  Tensor targets = kernels::narrow(ids, 1, 1, seq).contiguous();
  std::vector<double> t;
  for (int s = 0; s < warmup + steps; ++s) {
    if (sync) sync->barrier()->wait();
    double t0 = now();
    Tensor loss = cross_entropy(model(inputs), targets);
    backward(loss);
    opt.step();
    opt.zero_grad();
    if (sync) sync->barrier()->wait();
    if (s >= warmup) t.push_back(now() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  TESSERA_CHECK(world_size() == 2, "bench/train_step runs on 2 ranks (mpirun -np 2)");
  const int steps = argc > 1 ? std::atoi(argv[1]) : 10;
  const int64_t batch = 8, seq = 128;
  const DecoderConfig cfg = bench_config();
  double t1 = 0;
  if (world_rank() == 0) {
    auto model = std::make_shared<Decoder>(cfg);
    t1 = time_steps(*model, 2, steps, batch, seq, nullptr);
  }
  world_group()->barrier()->wait();
  DeviceMesh mesh({2}, {"tp"});
  auto model = std::make_shared<Decoder>(cfg);
  parallelize_module(model, mesh, decoder_tp_plan(cfg, mesh));
  double t2 = time_steps(*model, 2, steps, batch, seq, mesh.group(0));
  if (world_rank() == 0) {
    const double tokens = double(batch * seq);
    std::printf(
        "{\"benchmark\": \"train_step\", \"model\": {\"dim\": %lld, \"layers\": %lld, \"heads\": "
        "%lld, \"kv_heads\": %lld, \"ffn\": %lld, \"vocab\": %lld}, \"global_batch\": %lld, "
        "\"seq\": %lld, \"tp1_ms\": %.2f, \"tp2_ms\": %.2f, \"tp1_tokens_per_s\": %.0f, "
        "\"tp2_tokens_per_s\": %.0f, \"tp2_over_tp1\": %.3f}\n",
        (long long)cfg.dim, (long long)cfg.n_layers, (long long)cfg.n_heads,
        (long long)cfg.n_kv_heads, (long long)cfg.ffn_dim, (long long)cfg.vocab_size,
        (long long)batch, (long long)seq, t1 * 1e3, t2 * 1e3, tokens / t1, tokens / t2, t1 / t2);
  }
  return 0;
}
