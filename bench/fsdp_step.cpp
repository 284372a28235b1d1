// Step time of the decoder under FSDP on 2 ranks against the same model, ranks and global batch
// with parameters replicated (HSDP with a shard group of one: gradients all-reduced), in one run.
// Run under mpirun -np 2.
#include <cstdio>
#include <cstdlib>

#include "decoder_step.h"

using namespace tessera;

namespace {

// Each rank trains on its half of the global batch.
double time_fsdp(const DeviceMesh& mesh, int steps, const bench::TokenBatch& tokens) {
  auto model = std::make_shared<Decoder>(bench::decoder_config());
  for (auto& block : model->layers)
    fully_shard(block, mesh);
  fully_shard(model, mesh);
  return bench::median_step_seconds(*model, tokens, 2, steps, world_group());
}

}  // namespace

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  TESSERA_CHECK(world_size() == 2, "bench/fsdp_step runs on 2 ranks (mpirun -np 2)");
  const int steps = argc > 1 ? std::atoi(argv[1]) : 10;
  const int64_t rows = 4, seq = 128;  // global batch 8 x 128
  const bench::TokenBatch tokens = bench::random_tokens(
      rows, seq, bench::decoder_config().vocab_size, 11 + uint64_t(world_rank()));
  DeviceMesh fsdp_mesh({2}, {"dp"});
  DeviceMesh replicated_mesh({2, 1}, {"replicate", "shard"});
  const double t_rep = time_fsdp(replicated_mesh, steps, tokens);
  const double t_fsdp = time_fsdp(fsdp_mesh, steps, tokens);
  if (world_rank() == 0) {
    std::printf(
        "{\"benchmark\": \"fsdp_step\", \"ranks\": 2, \"global_batch\": %lld, \"seq\": %lld, "
        "\"replicated_ms\": %.2f, \"fsdp_ms\": %.2f, \"fsdp_over_replicated\": %.3f, "
        "\"overlap\": \"not measured: no prefetch yet\"}\n",
        (long long)(2 * rows), (long long)seq, t_rep * 1e3, t_fsdp * 1e3, t_fsdp / t_rep);
  }
  return 0;
}
