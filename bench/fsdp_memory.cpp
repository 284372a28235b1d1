// Per-rank peak memory of an FSDP training step (forward, backward, AdamW) against the bound
// (unsharded parameters + gradients + optimizer state) / N + the two largest groups unsharded
// (parameters and gradients) + 10%, measured with the allocator's peak counter. The model is a
// decoder whose parameters dominate memory (tiny batch). Run under mpirun -np N, N = 2, 4, 8.
#include <algorithm>
#include <cstdio>

#include "tessera/tessera.h"

using namespace tessera;

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  const int64_t n = world_size();
  DecoderConfig cfg;
  cfg.vocab_size = 1024;
  cfg.dim = 384;
  cfg.n_layers = 4;
  cfg.n_heads = 6;
  cfg.n_kv_heads = 6;
  cfg.ffn_dim = 1024;
  cfg.max_seq_len = 16;
  cfg.seed = 3;
  DeviceMesh mesh({n}, {"dp"});
  auto model = std::make_shared<Decoder>(cfg);
  int64_t total_params = 0;
  for (Parameter* p : model->parameters())
    total_params += shape_numel(p->global_shape());

  // Group sizes (elements) as fully_shard will form them: each block, then the rest (root).
  std::vector<int64_t> groups;
  int64_t in_blocks = 0;
  for (auto& block : model->layers) {
    int64_t g = 0;
    for (Parameter* p : block->parameters())
      g += shape_numel(p->global_shape());
    groups.push_back(g);
    in_blocks += g;
  }
  groups.push_back(total_params - in_blocks);
  for (auto& block : model->layers)
    fully_shard(block, mesh);
  fully_shard(model, mesh);

  AdamW opt(model->parameters(), {});
  Tensor ids = zeros({1, cfg.max_seq_len}, DType::Int64);
  world_group()->barrier()->wait();
  reset_peak_memory();
  for (int step = 0; step < 2; ++step) {  // the second step has optimizer state
    backward(cross_entropy((*model)(ids), ids));
    opt.step();
    opt.zero_grad();
  }
  const double peak = double(memory_stats().peak_bytes);
  std::sort(groups.rbegin(), groups.rend());
  const double bytes = 4.0;                                 // float32
  const double state = 4.0 * double(total_params) * bytes;  // params, grads, Adam m and v
  const double two_groups = 2.0 * bytes * double(groups[0] + groups[1]);  // params + grads
  const double bound = 1.10 * (state / double(n) + two_groups);
  Tensor worst = from_vector<double>({peak});
  world_group()->all_reduce(worst, ReduceOp::Max)->wait();
  if (world_rank() == 0) {
    std::printf(
        "{\"benchmark\": \"fsdp_memory\", \"ranks\": %lld, \"parameters\": %lld, "
        "\"unsharded_state_mib\": %.2f, \"largest_two_groups_mib\": %.2f, \"bound_mib\": %.2f, "
        "\"peak_mib\": %.2f, \"peak_over_bound\": %.3f, \"peak_over_unsharded_state\": %.3f}\n",
        (long long)n, (long long)total_params, state / (1 << 20), two_groups / (1 << 20),
        bound / (1 << 20), worst.item<double>() / (1 << 20), worst.item<double>() / bound,
        worst.item<double>() / state);
  }
  return 0;
}
