// Strong scaling of the decoder training step (forward, backward, AdamW) under FSDP, TP and
// FSDP x TP at the world size it runs at, against the same model and global batch on one rank
// timed in the same run (rank 0 alone, the other ranks waiting; before and after the layouts,
// the mean of the two the baseline). Prints JSON on rank 0: per
// parallelism the median step time and speedup = one-rank time / N-rank time (N at most, 1 is
// no gain), and efficiency = speedup / N.
//
//   mpirun -np N scaling [STEPS]      (N = 1, 2, 4, 8; STEPS timed steps per layout, default 6)
//
// Layouts: FSDP over all N ranks (blocks and root sharded, batch rows split N ways); TP over all
// N ranks (decoder_tp_plan, whole batch on every rank; needs N to divide the 4 kv heads); FSDP x
// TP on an (N / 2, 2) mesh (TP inside pairs, FSDP across them, rows split N / 2 ways; N >= 4).
// A layout the world size does not allow is listed with the reason. With more ranks than cores
// the ranks share cores and the figures say how oversubscription hurts, not how the code scales.
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "cli.h"
#include "decoder_step.h"

using namespace tessera;

namespace {

constexpr int64_t kGlobalBatch = 8;  // rows: even over 1, 2, 4 and 8 data-parallel ranks
constexpr int64_t kSeq = 128;

struct Layout {
  std::string name;
  std::string skipped;  // why the world size does not allow it ("" when it runs)
  double step_s = 0;
};

// This rank's rows of the global batch when the batch is split `parts` ways.
bench::TokenBatch rows_of(const bench::TokenBatch& b, int64_t part, int64_t parts) {
  const int64_t n = b.inputs.size(0) / parts;
  return {kernels::narrow(b.inputs, 0, part * n, n).contiguous(),
          kernels::narrow(b.targets, 0, part * n, n).contiguous()};
}

void shard_blocks_and_root(const std::shared_ptr<Decoder>& model, const DeviceMesh& mesh) {
  for (auto& block : model->layers)
    fully_shard(block, mesh);
  fully_shard(model, mesh);
}

Layout fsdp(const bench::TokenBatch& tokens, int steps) {
  const int n = world_size();
  DeviceMesh mesh({n}, {"dp"});
  auto model = std::make_shared<Decoder>(bench::decoder_config());
  shard_blocks_and_root(model, mesh);
  return {"FSDP", "",
          bench::median_step_seconds(*model, rows_of(tokens, world_rank(), n), 2, steps,
                                     world_group())};
}

Layout tp(const bench::TokenBatch& tokens, int steps) {
  const int n = world_size();
  const DecoderConfig cfg = bench::decoder_config();
  if (cfg.n_kv_heads % n != 0)
    return {"TP", std::to_string(cfg.n_kv_heads) + " kv heads do not split over " +
                      std::to_string(n) + " ranks"};
  DeviceMesh mesh({n}, {"tp"});
  auto model = std::make_shared<Decoder>(cfg);
  parallelize_module(model, mesh, decoder_tp_plan(cfg, mesh));
  return {"TP", "", bench::median_step_seconds(*model, tokens, 2, steps, world_group())};
}

Layout fsdp_tp(const bench::TokenBatch& tokens, int steps) {
  const int n = world_size();
  if (n < 4 || n % 2 != 0) return {"FSDP x TP", "needs an even world of 4 or more ranks"};
  DeviceMesh mesh({n / 2, 2}, {"dp", "tp"});
  const DecoderConfig cfg = bench::decoder_config();
  auto model = std::make_shared<Decoder>(cfg);
  parallelize_module(model, mesh["tp"], decoder_tp_plan(cfg, mesh["tp"]));
  shard_blocks_and_root(model, mesh["dp"]);
  const bench::TokenBatch mine = rows_of(tokens, mesh.local_rank(0), n / 2);
  return {"FSDP x TP", "", bench::median_step_seconds(*model, mine, 2, steps, world_group())};
}

}  // namespace

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  TESSERA_CHECK(argc <= 2, "usage: scaling [STEPS]");
  const int steps = argc > 1 ? int(cli::parse_int("scaling: STEPS", argv[1], 1, 100000)) : 6;
  const int n = world_size();
  TESSERA_CHECK(kGlobalBatch % n == 0, "bench/scaling: the global batch of ", kGlobalBatch,
                " rows does not split over ", n, " ranks (run on 1, 2, 4 or 8)");
  const DecoderConfig cfg = bench::decoder_config();
  const bench::TokenBatch tokens = bench::random_tokens(kGlobalBatch, kSeq, cfg.vocab_size, 11);

  // The baseline is timed before and after the layouts, and their mean taken: a drift of the
  // machine's load during the run then moves both sides of each ratio.
  const double before_s = bench::one_rank_step_seconds(cfg, tokens, steps);
  std::vector<Layout> layouts;
  for (const auto& run :
       std::vector<std::function<Layout(const bench::TokenBatch&, int)>>{fsdp, tp, fsdp_tp})
    layouts.push_back(run(tokens, steps));
  const double after_s = bench::one_rank_step_seconds(cfg, tokens, steps);
  const double one_rank_s = 0.5 * (before_s + after_s);

  if (world_rank() != 0) return 0;
  std::printf("{\n  \"benchmark\": \"scaling\",\n  \"world_size\": %d,\n", n);
  std::printf(
      "  \"model\": {\"dim\": %lld, \"layers\": %lld, \"heads\": %lld, \"kv_heads\": %lld, "
      "\"ffn\": %lld, \"vocab\": %lld},\n",
      (long long)cfg.dim, (long long)cfg.n_layers, (long long)cfg.n_heads,
      (long long)cfg.n_kv_heads, (long long)cfg.ffn_dim, (long long)cfg.vocab_size);
  std::printf("  \"global_batch\": %lld, \"seq\": %lld, \"steps\": %d,\n", (long long)kGlobalBatch,
              (long long)kSeq, steps);
  std::printf(
      "  \"one_rank_ms\": %.2f,\n  \"one_rank_ms_before\": %.2f,\n  \"one_rank_ms_after\": "
      "%.2f,\n  \"layouts\": [\n",
      one_rank_s * 1e3, before_s * 1e3, after_s * 1e3);
  for (size_t i = 0; i < layouts.size(); ++i) {
    const Layout& l = layouts[i];
    const char* sep = i + 1 < layouts.size() ? "," : "";
    if (!l.skipped.empty()) {
      std::printf("    {\"layout\": \"%s\", \"skipped\": \"%s\"}%s\n", l.name.c_str(),
                  l.skipped.c_str(), sep);
      continue;
    }
    const double speedup = one_rank_s / l.step_s;
    std::printf(
        "    {\"layout\": \"%s\", \"step_ms\": %.2f, \"speedup\": %.3f, "
        "\"efficiency\": %.3f}%s\n",
        l.name.c_str(), l.step_s * 1e3, speedup, speedup / n, sep);
  }
  std::printf("  ]\n}\n");
  return 0;
}
