// PEFT's add_weighted_adapter ("cat" and "linear") on every layout: the combined adapter's values
// against the formulas, the same on every mesh as on one process, frozen; and what it refuses.
// Part of the test_lora binary.
#include <gtest/gtest.h>

#include <cmath>

#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

const LoraSlots kSlots{.max_adapters = 5, .max_rank = 8};

// "default" (r 4, alpha 8, every projection and the table), "b" (r 2, alpha 6, wq, wv and the
// table) and "c" (r 4, alpha 2, as "default"): random B, so that every update is non-zero.
LoraConfig config_of(const std::string& name) {
  LoraConfig c = lora_test_config(LoraInit::Random);
  c.target_modules.push_back("tok_embeddings");
  if (name == "b") {
    c.r = 2;
    c.lora_alpha = 6;
    c.seed = 5;
    c.target_modules = {"wq", "wv", "tok_embeddings"};
  } else if (name == "c") {
    c.lora_alpha = 2;
    c.seed = 7;
  }
  return c;
}

void add_sources(LoraModel& lora) {
  lora.add_adapter("b", config_of("b"));
  lora.add_adapter("c", config_of("c"));
}

// scale B A of `adapter` in `layer`, from read_adapter's values (zero where it has none).
Tensor update(LoraModel& lora, const std::map<std::string, Tensor>& v, const std::string& adapter,
              const std::string& path, const LoraLayer& layer) {
  const auto a = v.find(path + "." + layer.adapter_key(true));
  if (a == v.end()) return zeros({layer.lora_out(), layer.lora_in()});
  const double s = layer.slot(lora.adapter_id(adapter)).scale;
  return mul(matmul(v.at(path + "." + layer.adapter_key(false)), a->second), s);
}

}  // namespace

TEST(LoraWeighted, CatAndLinearCombineTheUpdatesOnEveryLayout) {
  const DecoderConfig cfg = lora_decoder_config();
  const Batch batch = affine_batch(2, 4, cfg.max_seq_len, cfg.vocab_size);
  // One process: the reference values and logits, and the formulas.
  auto ref = std::make_shared<Decoder>(cfg);
  auto rl = apply_lora(ref, config_of("default"), "default", kSlots);
  add_sources(*rl);
  rl->add_weighted_adapter({"default", "b"}, {0.7, -1.5}, "cat", "cat");
  rl->add_weighted_adapter({"default", "c"}, {0.5, 2.0}, "lin", "linear");
  std::map<std::string, std::map<std::string, Tensor>> v;
  for (const std::string name : {"default", "b", "c", "cat", "lin"})
    v[name] = rl->read_adapter(name);
  for (const auto& [path, layer] : rl->layers()) {
    SCOPED_TRACE(path);
    // "cat" (scale 1): exactly 0.7 of default's update and -1.5 of b's.
    EXPECT_EQ(layer->slot(rl->adapter_id("cat")).scale, 1.0);
    const Tensor want = add(mul(update(*rl, v["default"], "default", path, *layer), 0.7),
                            mul(update(*rl, v["b"], "b", path, *layer), -1.5));
    expect_close(update(*rl, v["cat"], "cat", path, *layer), want, 1e-6, "cat's update");
    // "linear": A and B each the sum of sqrt(w s) times the adapters' (PEFT's).
    for (const bool is_a : {true, false}) {
      const std::string key = path + "." + layer->adapter_key(is_a);
      const double fa = std::sqrt(0.5 * layer->slot(rl->adapter_id("default")).scale);
      const double fc = std::sqrt(2.0 * layer->slot(rl->adapter_id("c")).scale);
      expect_close(v["lin"].at(key), add(mul(v["default"].at(key), fa), mul(v["c"].at(key), fc)),
                   1e-6, key);
    }
  }
  for (Parameter* p : rl->adapter_parameters("cat"))
    EXPECT_FALSE(p->requires_grad()) << "the combined adapter is frozen, as PEFT's";
  EXPECT_EQ(rl->config("cat").r, 6);
  EXPECT_EQ(rl->config("lin").r, 4);
  std::map<std::string, Tensor> ref_logits;
  {
    NoGradGuard no_grad;
    for (const std::string name : {"cat", "lin"}) {
      rl->set_adapter(name);
      ref_logits[name] = (*ref)(batch.ids);
    }
  }
  // Every layout: the same values (each rank's window of them) and logits.
  for (const LoraLayout& l : lora_layouts(kSlots)) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(cfg, config_of("default"));
    add_sources(*run.lora);
    run.lora->add_weighted_adapter({"default", "b"}, {0.7, -1.5}, "cat", "cat");
    run.lora->add_weighted_adapter({"default", "c"}, {0.5, 2.0}, "lin", "linear");
    for (const std::string name : {"cat", "lin"}) {
      for (const auto& [key, t] : run.lora->read_adapter(name))
        expect_close(t, v[name].at(key), 1e-6, name + " " + key);
      NoGradGuard no_grad;
      run.lora->set_adapter(name);
      expect_close(run.logits(batch.ids), ref_logits[name], 1e-5, name + "'s logits");
    }
  }
}

// A single adapter is "linear" whatever the type asked (as in PEFT): its update scaled by the
// weight.
TEST(LoraWeighted, OneAdapterIsScaled) {
  auto model = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(model, config_of("default"), "default", kSlots);
  lora->add_weighted_adapter({"default"}, {2.0}, "twice", "cat");
  const auto v = lora->read_adapter("default"), w = lora->read_adapter("twice");
  for (const auto& [path, layer] : lora->layers())
    expect_close(update(*lora, w, "twice", path, *layer),
                 mul(update(*lora, v, "default", path, *layer), 2.0), 1e-6, path);
}

// "cat" of an orthogonally initialised adapter (r 2) and one of r 3 has rank 5, which the
// orthogonal init refuses: the combined adapter is written, not drawn, so it takes its values.
TEST(LoraWeighted, AnOddCombinedRankAfterAnOrthogonalAdapter) {
  auto model = std::make_shared<Decoder>(lora_decoder_config());
  LoraConfig first = config_of("b");
  first.init_lora_weights = LoraInit::Orthogonal;
  auto lora = apply_lora(model, first, "default", kSlots);
  LoraConfig second = config_of("b");
  second.r = 3;
  second.seed = 9;
  lora->add_adapter("three", second);
  lora->add_weighted_adapter({"default", "three"}, {1.0, 0.5}, "five", "cat");
  EXPECT_EQ(lora->config("five").r, 5);
  const auto d = lora->read_adapter("default"), t = lora->read_adapter("three"),
             f = lora->read_adapter("five");
  for (const auto& [path, layer] : lora->layers())
    expect_close(update(*lora, f, "five", path, *layer),
                 add(update(*lora, d, "default", path, *layer),
                     mul(update(*lora, t, "three", path, *layer), 0.5)),
                 1e-6, path);
}

TEST(LoraWeighted, WhatCannotBeCombinedIsRefusedAndChangesNothing) {
  auto model = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(model, config_of("default"), "default",
                         {.max_adapters = 5, .max_rank = 8, .use_dora = true});
  add_sources(*lora);
  LoraConfig dora = config_of("c");
  dora.use_dora = true;
  lora->add_adapter("d", dora);
  const std::vector<std::string> before = lora->adapters();
  auto refused = [&](const std::vector<std::string>& adapters, const std::vector<double>& weights,
                     const std::string& name, const std::string& type,
                     const std::vector<std::string>& what) {
    expect_error([&] { lora->add_weighted_adapter(adapters, weights, name, type); }, what);
    EXPECT_EQ(lora->adapters(), before) << type;
  };
  refused({"default", "b"}, {1, 1}, "c", "cat", {"add_weighted_adapter", "'c' exists already"});
  refused({"default", "zz"}, {1, 1}, "n", "cat", {"add_weighted_adapter", "no adapter 'zz'"});
  refused({"default", "b"}, {1}, "n", "cat", {"2 adapters (default, b) and 1 weights"});
  refused({"default", "b"}, {1, 1}, "n", "svd", {"'svd' is PEFT's but not built here"});
  refused({"default", "b"}, {1, 1}, "n", "concat", {"'concat' is no combination type"});
  refused({"default", "b"}, {1, 1}, "n", "linear",
          {"\"linear\" needs equal ranks", "'b' has rank 2 in tok_embeddings"});
  refused({"default", "c"}, {1, -1}, "n", "linear", {"weight -1 of adapter 'c' is negative"});
  refused({"default", "c", "b"}, {1, 1, 1}, "n", "cat", {"rank 10", "at most rank 8"});
  refused({"default", "d"}, {1, 1}, "n", "cat", {"'d' uses DoRA"});
  // The last free slot taken: add_adapter's refusal, and nothing left behind.
  lora->add_adapter("e", config_of("c"));
  expect_error(
      [&] {
        lora->add_weighted_adapter({"default", "c"}, {1, 1}, "n", "cat");
      },
      {"add_adapter"});
  EXPECT_EQ(lora->adapters().size(), 5u);
}
