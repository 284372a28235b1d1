// Step time of the decoder under FSDP on 2 ranks against the same model, ranks and global batch
// with parameters replicated (HSDP with a shard group of one: gradients all-reduced), in one run.
// Run under mpirun -np 2.
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

// Median seconds per step; each rank trains on its half of the global batch.
double time_fsdp(const DeviceMesh& mesh, int steps, int64_t rows, int64_t seq) {
  auto model = std::make_shared<Decoder>(bench_config());
  for (auto& block : model->layers)
    fully_shard(block, mesh);
  fully_shard(model, mesh);
  AdamW opt(model->parameters(), {});
  Generator gen(11 + uint64_t(world_rank()));
  Tensor u = rand({rows, seq + 1}, gen, DType::Float64);
  Tensor ids = empty({rows, seq + 1}, DType::Int64);
  for (int64_t i = 0; i < ids.numel(); ++i)
    ids.data<int64_t>()[i] = int64_t(u.data<double>()[i] * 512.0);
  Tensor inputs = kernels::narrow(ids, 1, 0, seq).contiguous();
  Tensor targets = kernels::narrow(ids, 1, 1, seq).contiguous();
  std::vector<double> t;
  for (int s = 0; s < steps + 2; ++s) {
    world_group()->barrier()->wait();
    const double t0 = now();
    backward(cross_entropy((*model)(inputs), targets));
    opt.step();
    opt.zero_grad();
    world_group()->barrier()->wait();
    if (s >= 2) t.push_back(now() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  TESSERA_CHECK(world_size() == 2, "bench/fsdp_step runs on 2 ranks (mpirun -np 2)");
  const int steps = argc > 1 ? std::atoi(argv[1]) : 10;
  const int64_t rows = 4, seq = 128;  // global batch 8 x 128
  DeviceMesh fsdp_mesh({2}, {"dp"});
  DeviceMesh replicated_mesh({2, 1}, {"replicate", "shard"});
  const double t_rep = time_fsdp(replicated_mesh, steps, rows, seq);
  const double t_fsdp = time_fsdp(fsdp_mesh, steps, rows, seq);
  if (world_rank() == 0) {
    std::printf(
        "{\"benchmark\": \"fsdp_step\", \"ranks\": 2, \"global_batch\": %lld, \"seq\": %lld, "
        "\"replicated_ms\": %.2f, \"fsdp_ms\": %.2f, \"fsdp_over_replicated\": %.3f, "
        "\"overlap\": \"not measured: no prefetch yet\"}\n",
        (long long)(2 * rows), (long long)seq, t_rep * 1e3, t_fsdp * 1e3, t_fsdp / t_rep);
  }
  return 0;
}
