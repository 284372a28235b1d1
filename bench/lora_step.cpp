// LoRA fine-tuning step against the same frozen model without adapters, and the optimizer state
// it needs against full fine-tuning, measured in the same run. One process; prints JSON.
//
//   lora_step [--rounds N] [--steps N] [--r N] [--dim N]
//
// The bench decoder at width --dim (default 512; 4 blocks, ffn 11/4 dim, 8 x 128 tokens). The
// adapters' share of the work is about 1.5 r (1/in + 1/out) of a projection's frozen forward and
// backward, so the overhead depends on the width: at 256 and r = 16 it is 19% of the attention
// projections' work by arithmetic alone, at 512 it is 9%. Contenders, interleaved in every round:
//   frozen  every parameter frozen; the first block's input is made a leaf that requires grad,
//           so backward runs through every layer as it must under LoRA (activation gradients,
//           no weight gradients) — the cost LoRA adds to is this
//   lora    the same with adapters of rank r (default 16, alpha 2r) on all seven projections of
//           every block, trained by AdamW
//   lora_table  lora with an adapter on the token embeddings too (LoraEmbedding); backward then
//           reaches the embeddings instead of stopping at the first block's input
//   lora_mixed  lora with four such adapters (the model's slots hold four) and a mixed batch
//           that gives each adapter two of the eight samples, all four trained
//   lora_tokens  lora with the rows of 16 token ids of the embeddings trained too
//           (trainable_token_indices, a TokenEmbedding), reached by backward as lora_table's
//   full    every parameter trained by AdamW (for the optimizer state; its time is reported too)
// Ratios: median step time of lora over frozen (paired per round; target <= 1.15), of lora_table
// over lora (what the table's adapter adds), of lora_mixed over lora (what routing each sample
// to its own adapter adds, with four adapters' optimizer steps), of lora_tokens over lora (what
// the trainable rows add), and AdamW's state bytes of lora over full. Before timing, one step of
// each contender checks that every parameter it trains gets a gradient.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "cli.h"
#include "decoder_step.h"

using namespace tessera;

namespace {

struct Contender {
  std::shared_ptr<Decoder> model;
  std::shared_ptr<LoraModel> lora;
  std::vector<Parameter*> trained;
  std::unique_ptr<AdamW> opt;
};

DecoderConfig config(int dim) {
  DecoderConfig cfg = bench::decoder_config();
  cfg.dim = dim;
  cfg.ffn_dim = (dim * 11 / 4 + 63) / 64 * 64;
  return cfg;
}

Contender make(const std::string& kind, int r, int dim) {
  Contender c;
  c.model = std::make_shared<Decoder>(config(dim));
  std::vector<Parameter*> trained;
  if (kind == "full") {
    trained = c.model->parameters();
  } else {
    for (Parameter* p : c.model->parameters())
      p->set_requires_grad(false);
    if (kind != "frozen") {
      LoraConfig cfg;
      cfg.r = r;
      cfg.lora_alpha = 2.0 * r;
      cfg.target_modules = {"wq", "wk", "wv", "wo", "w1", "w2", "w3"};
      if (kind == "lora_table") cfg.target_modules.push_back("tok_embeddings");
      if (kind == "lora_tokens") {
        std::vector<int64_t> ids;
        for (int64_t id = 0; id < 16; ++id)
          ids.push_back(id * 7);
        cfg.trainable_token_indices = {{"", ids}};
      }
      const bool mixed = kind == "lora_mixed";
      c.lora = apply_lora(c.model, cfg, "default",
                          {.max_adapters = mixed ? 4 : 1, .max_rank = mixed ? r : 0});
      if (mixed) {
        for (int i = 1; i < 4; ++i) {
          cfg.seed = uint64_t(100 + i);
          c.lora->add_adapter("adapter" + std::to_string(i), cfg);
        }
        c.lora->set_batch_adapters(from_vector<int64_t>({0, 1, 2, 3, 0, 1, 2, 3}));
      }
      trained = c.lora->parameters();
    }
    // Backward must run through every layer, as under LoRA, even with nothing to train. Not
    // where the embeddings train (their adapter, their rows): that input's gradient reaches them.
    if (kind != "lora_table" && kind != "lora_tokens")
      c.model->layers.front()->register_forward_pre_hook([](Module&, const Tensor& x) {
        Tensor leaf = x.detach();
        leaf.set_requires_grad(true);
        return leaf;
      });
  }
  c.trained = trained;
  if (!trained.empty()) c.opt = std::make_unique<AdamW>(trained, AdamWOptions{});
  return c;
}

// One step's backward must reach every parameter a contender trains: one that gets no gradient
// is skipped by AdamW, and the contender would time less work than it names.
void check_every_trained_parameter_gets_a_gradient(Contender& c, const std::string& kind,
                                                   const bench::TokenBatch& batch) {
  backward(cross_entropy((*c.model)(batch.inputs), batch.targets));
  for (Parameter* p : c.trained)
    TESSERA_CHECK(p->grad().defined(), "lora_step: contender '", kind, "' trains ", p->str(),
                  ", which got no gradient");
  if (c.opt) c.opt->zero_grad();
}

double step(Contender& c, const bench::TokenBatch& batch) {
  const double t0 = bench::now_seconds();
  backward(cross_entropy((*c.model)(batch.inputs), batch.targets));
  if (c.opt) {
    c.opt->step();
    c.opt->zero_grad();
  }
  return bench::now_seconds() - t0;
}

int64_t state_bytes(AdamW& opt) {
  int64_t n = 0;
  for (size_t i = 0; i < opt.params().size(); ++i)
    for (const std::string& name : opt.state_names(i)) {
      Tensor t = opt.state_tensor(i, name, false);
      if (t.defined()) n += int64_t(t.nbytes());
    }
  return n;
}

using bench::Spread;
using bench::spread;

}  // namespace

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  int rounds = 5, steps = 6, r = 16, dim = 512;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    TESSERA_CHECK(i + 1 < argc && (f == "--rounds" || f == "--steps" || f == "--r" || f == "--dim"),
                  "lora_step: unknown or incomplete flag '", f,
                  "'; usage: lora_step [--rounds N] [--steps N] [--r N] [--dim N]");
    const int v = int(cli::parse_int("lora_step: " + f, argv[++i], 1, 4096));
    (f == "--rounds" ? rounds : f == "--steps" ? steps : f == "--r" ? r : dim) = v;
  }
  TESSERA_CHECK(dim % 8 == 0, "lora_step: --dim must be a multiple of 8 (8 heads)");
  const DecoderConfig cfg = config(dim);
  const bench::TokenBatch batch = bench::random_tokens(8, 128, cfg.vocab_size, 11);
  const std::vector<const char*> kinds = {"frozen",     "lora",        "lora_table",
                                          "lora_mixed", "lora_tokens", "full"};
  std::map<std::string, Contender> c;
  for (const char* kind : kinds) {
    c[kind] = make(kind, r, dim);
    check_every_trained_parameter_gets_a_gradient(c[kind], kind, batch);
  }
  std::map<std::string, std::vector<double>> medians;
  std::vector<double> overhead, table, mixed, tokens;
  for (int round = 0; round < rounds; ++round) {
    std::map<std::string, double> m;
    for (const char* kind : kinds) {
      std::vector<double> t;
      step(c[kind], batch);  // warm-up
      for (int s = 0; s < steps; ++s)
        t.push_back(step(c[kind], batch));
      m[kind] = spread(t).median;
      medians[kind].push_back(m[kind]);
    }
    overhead.push_back(m["lora"] / m["frozen"]);
    table.push_back(m["lora_table"] / m["lora"]);
    mixed.push_back(m["lora_mixed"] / m["lora"]);
    tokens.push_back(m["lora_tokens"] / m["lora"]);
  }
  const int64_t lora_state = state_bytes(*c["lora"].opt), full_state = state_bytes(*c["full"].opt);
  const Spread o = spread(overhead), t = spread(table), x = spread(mixed), k = spread(tokens);
  std::printf(
      "{\n  \"benchmark\": \"lora_step\",\n  \"rank\": %d,\n  \"dim\": %d,\n  \"rounds\": %d,\n", r,
      dim, rounds);
  std::printf(
      "  \"step_seconds_median\": {\"frozen\": %.4f, \"lora\": %.4f, \"lora_table\": %.4f, "
      "\"lora_mixed\": %.4f, \"lora_tokens\": %.4f, \"full\": %.4f},\n",
      spread(medians["frozen"]).median, spread(medians["lora"]).median,
      spread(medians["lora_table"]).median, spread(medians["lora_mixed"]).median,
      spread(medians["lora_tokens"]).median, spread(medians["full"]).median);
  std::printf("  \"lora_vs_frozen_step\": {\"median\": %.3f, \"min\": %.3f, \"max\": %.3f},\n",
              o.median, o.min, o.max);
  std::printf("  \"lora_table_vs_lora_step\": {\"median\": %.3f, \"min\": %.3f, \"max\": %.3f},\n",
              t.median, t.min, t.max);
  std::printf("  \"lora_mixed_vs_lora_step\": {\"median\": %.3f, \"min\": %.3f, \"max\": %.3f},\n",
              x.median, x.min, x.max);
  std::printf("  \"lora_tokens_vs_lora_step\": {\"median\": %.3f, \"min\": %.3f, \"max\": %.3f},\n",
              k.median, k.min, k.max);
  std::printf("  \"optimizer_state_bytes\": {\"lora\": %lld, \"full\": %lld},\n",
              (long long)lora_state, (long long)full_state);
  std::printf("  \"lora_vs_full_optimizer_state\": %.4f\n}\n",
              double(lora_state) / double(full_state));
  return 0;
}
