// PEFT's ensure_weight_tying: LoRA on the table of a Decoder under tie_embeddings applies to the
// lookup and to the tied output projection. Logits and gradients against the tied decoder whose
// table is the merged one, under every layout; mixed batches; dropout; files, the adapter table
// and what is refused. Part of the test_lora binary.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

DecoderConfig tied_decoder() {
  DecoderConfig c = lora_decoder_config();
  c.tie_embeddings = true;
  return c;
}

// LoRA on the tied table (and on wq and wv), both matrices drawn so that the adapter changes the
// logits from the start.
LoraConfig tied_lora(uint64_t seed = 3,
                     std::vector<std::string> targets = {"tok_embeddings", "wq", "wv"}) {
  LoraConfig c = lora_test_config(LoraInit::Random);
  c.target_modules = std::move(targets);
  c.ensure_weight_tying = true;
  c.seed = seed;
  return c;
}

Tensor ids_of(int step) {
  return affine_batch(step, 4, 8, lora_decoder_config().vocab_size).ids;
}

LoraLayer& table_layer(LoraModel& lora) {
  for (auto& [path, layer] : lora.layers())
    if (path == "tok_embeddings") return *layer;
  ADD_FAILURE() << "no LoRA layer at tok_embeddings";
  return *lora.layers().front().second;
}

}  // namespace

// The logits are those of the tied decoder whose table is W + scale (B A)^T (PEFT's tied lm_head
// adapter), and A and B get both uses' gradients: with G that table's gradient, dA = s B^T G^T
// and dB = s G^T A^T. Under every layout, merged and unmerged.
TEST(LoraTied, TheProjectionReadsTheAdapterUnderEveryLayout) {
  const Tensor ids = ids_of(4);
  for (const LoraLayout& l : lora_layouts()) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(tied_decoder(), tied_lora(3, {"tok_embeddings"}));
    // Both drawn from N(0, 1), the update s B A would dwarf the table, and the logits would be
    // small differences of large terms, equal only to 1e-4 between the two computations.
    std::map<std::string, Tensor> small = run.lora->read_adapter("default");
    for (auto& [key, t] : small)
      t = mul(t, 0.1);
    run.lora->write_adapter("default", small);
    LoraLayer& layer = table_layer(*run.lora);
    const int64_t r = 4;
    const Tensor a = kernels::narrow(layer.lora_A(0).full(), 0, 0, r).clone();
    const Tensor b = kernels::narrow(layer.lora_B(0).full(), 1, 0, r).clone();
    const double s = layer.slot(0).scale;
    auto ref = std::make_shared<Decoder>(tied_decoder());
    ref->tok_embeddings->weight.copy_from_full(
        add(ref->tok_embeddings->weight.full(), mul(transpose(matmul(b, a), 0, 1), s)));
    ref->tok_embeddings->weight.set_requires_grad(true);
    const Tensor want = (*ref)(ids);
    backward(sum(mul(want, want)));
    const Tensor g = ref->tok_embeddings->weight.grad();
    const Tensor got = run.logits(ids);
    expect_close(got, want, 1e-5, "logits");
    backward(sum(mul(got, got)));
    expect_close(kernels::narrow(full_grad(layer.lora_A(0)), 0, 0, r),
                 mul(matmul(transpose(b, 0, 1), transpose(g, 0, 1)), s), 1e-4, "A's gradient");
    expect_close(kernels::narrow(full_grad(layer.lora_B(0)), 1, 0, r),
                 mul(matmul(transpose(g, 0, 1), transpose(a, 0, 1)), s), 1e-4, "B's gradient");
    expect_merge_keeps_logits(run, ids, want, l.name);
  }
}

// Three AdamW steps under every layout give one process's losses and adapters; in a mixed batch
// each sample's logits are its adapter's alone.
TEST(LoraTied, EveryLayoutTrainsAsOneProcessAndMixesBatches) {
  LoraRun ref{"plain", std::make_shared<Decoder>(tied_decoder()), nullptr, 0, 1};
  ref.lora = apply_lora(ref.model, tied_lora());
  const LoraTrained reference = lora_train(ref, 3);
  for (const LoraLayout& l : lora_layouts({.max_adapters = 3})) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(tied_decoder(), tied_lora());
    const LoraTrained after = lora_train(run, 3);
    for (size_t i = 0; i < after.losses.size(); ++i)
      EXPECT_NEAR(after.losses[i], reference.losses[i], 1e-6 * reference.losses[i]) << "step " << i;
    for (const auto& [key, t] : reference.adapter)
      expect_close(after.adapter.at(key), t, 1e-5, "trained " + key);
    run.lora->add_adapter("other", tied_lora(5));
    run.lora->add_adapter("plain", tied_lora(7, {"wq"}));
    expect_mixed_batch_as_alone(run, {"other", "default", "", "plain"}, ids_of(2));
  }
}

// lora_dropout applies to the projection's input, as on PEFT's tied lm_head: in training mode
// the logits move with it, in eval mode they are the undropped ones.
TEST(LoraTied, DropoutAppliesToTheProjectionInTrainingOnly) {
  if (world_size() > 1) GTEST_SKIP() << "one process";
  LoraConfig dropping = tied_lora(3, {"tok_embeddings"});
  dropping.lora_dropout = 0.5;
  auto m = std::make_shared<Decoder>(tied_decoder());
  auto lora = apply_lora(m, dropping);
  auto plain = std::make_shared<Decoder>(tied_decoder());
  auto plain_lora = apply_lora(plain, tied_lora(3, {"tok_embeddings"}));
  NoGradGuard no_grad;
  const Tensor ids = ids_of(1);
  EXPECT_GT(max_abs_diff((*m)(ids), (*plain)(ids)), 1e-3) << "dropout in training";
  m->eval();
  expect_close((*m)(ids), (*plain)(ids), 1e-6, "eval mode");
}

// save_adapter writes ensure_weight_tying and load_adapter reads it back (same logits); the
// adapter table restores it. Refused, naming the field: a tied table targeted without
// ensure_weight_tying (apply_lora, add_adapter or a file), or with DoRA.
TEST(LoraTied, FilesTheTableAndWhatIsRefused) {
  if (world_size() > 1) GTEST_SKIP() << "one process";
  const std::string dir = scratch_dir("lora_tied");
  auto m = std::make_shared<Decoder>(tied_decoder());
  auto lora = apply_lora(m, tied_lora(), "default", {.max_adapters = 3});
  NoGradGuard no_grad;
  const Tensor want = (*m)(ids_of(3));
  lora->save_adapter(dir + "/adapter", "default");
  {
    std::ifstream in(dir + "/adapter/adapter_config.json");
    EXPECT_EQ(nlohmann::json::parse(in).at("ensure_weight_tying"), true);
  }
  LoraRun fresh{"plain", std::make_shared<Decoder>(tied_decoder()), nullptr, 0, 1};
  fresh.lora = apply_lora(fresh.model, tied_lora(9), "default", {.max_adapters = 3});
  fresh.lora->load_adapter(dir + "/adapter", "loaded");
  fresh.lora->set_adapter("loaded");
  expect_close(fresh.logits(ids_of(3)), want, 1e-6, "loaded");
  LoraRun run{"plain", m, lora, 0, 1};
  save_lora_checkpoint(run, dir + "/ckpt.h5");
  LoraRun back{"plain", std::make_shared<Decoder>(tied_decoder()), nullptr, 0, 1};
  back.lora = apply_lora(back.model, tied_lora(11), "default", {.max_adapters = 3});
  load_lora_checkpoint(back, dir + "/ckpt.h5");
  EXPECT_TRUE(back.lora->config("default").ensure_weight_tying);
  expect_close(back.logits(ids_of(3)), want, 1e-6, "restored");

  LoraConfig untied = tied_lora();
  untied.ensure_weight_tying = false;
  expect_error(
      [&] { lora->add_adapter("untied", untied); },
      {"LoRA: 'tok_embeddings' is also the Decoder's output projection", "ensure_weight_tying"});
  LoraConfig dora = tied_lora();
  dora.use_dora = true;
  auto other = std::make_shared<Decoder>(tied_decoder());
  expect_error([&] { apply_lora(other, dora); }, {"apply_lora: 'tok_embeddings'", "DoRA"});
  expect_error([&] { apply_lora(other, untied); },
               {"apply_lora: 'tok_embeddings' is also the Decoder's output projection",
                "ensure_weight_tying"});
  EXPECT_EQ(other->tok_embeddings->type_name(), "Embedding") << "left as it was";
  std::string text;
  {
    std::ifstream in(dir + "/adapter/adapter_config.json");
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  text.replace(text.find("\"ensure_weight_tying\": true"), 27, "\"ensure_weight_tying\": false");
  std::ofstream(dir + "/adapter/adapter_config.json") << text;
  expect_error([&] { lora->load_adapter(dir + "/adapter", "file"); },
               {"PEFT config '" + dir + "/adapter/adapter_config.json'",
                "'tok_embeddings' is also the Decoder's output projection", "ensure_weight_tying"});
  EXPECT_EQ(lora->adapters(), std::vector<std::string>{"default"});
}
