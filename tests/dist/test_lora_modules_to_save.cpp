// PEFT's modules_to_save: per adapter, a trained copy of whole modules (the output layer, the
// embeddings, the last norm), in the model, under every layout, in PEFT's files and in the
// adapter table. Part of the test_lora binary.
#include <gtest/gtest.h>

#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr const char* kSaved[] = {"tok_embeddings", "norm", "output"};

LoraConfig saving(LoraInit init = LoraInit::Kaiming) {
  LoraConfig c = lora_test_config(init);
  c.modules_to_save = {"output", "norm", "tok_embeddings"};
  return c;
}

Parameter& param(Module& m, const std::string& name) {
  for (auto& [n, p] : m.named_parameters())
    if (n == name) return *p;
  ADD_FAILURE() << "no parameter " << name;
  static Parameter none;
  return none;
}

Tensor ids_of(int step) {
  return affine_batch(step, 4, 8, lora_decoder_config().vocab_size).ids;
}

// Global values of the three saved modules' own weights.
std::map<std::string, Tensor> originals(Module& m) {
  std::map<std::string, Tensor> out;
  for (const char* s : kSaved)
    out[s] = param(m, std::string(s) + ".weight").full().clone();
  return out;
}

}  // namespace

// The adapter computes with its copies, which start as the modules' values and train; the
// originals stay frozen and serve the base model and adapters that do not save them.
TEST(LoraModulesToSave, TheAdapterTrainsItsCopiesAndTheOriginalsStay) {
  if (world_size() > 1) GTEST_SKIP() << "one process: layouts are the next test's";
  auto base = std::make_shared<Decoder>(lora_decoder_config());
  const Tensor base_logits = (*base)(ids_of(0));
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, saving(), "default", {.max_adapters = 2});
  const auto before = originals(*m);
  for (const char* s : kSaved) {
    SCOPED_TRACE(s);
    Parameter& copy = param(*m, std::string(s) + ".modules_to_save.0.weight");
    expect_identical(copy.full(), before.at(s), "copy starts as the module");
    EXPECT_TRUE(copy.requires_grad());
    EXPECT_FALSE(param(*m, std::string(s) + ".weight").requires_grad());
    EXPECT_FALSE(param(*m, std::string(s) + ".modules_to_save.1.weight").requires_grad());
  }
  expect_close((*m)(ids_of(0)), base_logits, 1e-6, "Kaiming adapter and fresh copies");
  // Trained, the copies move and the originals do not.
  train_one_process(*m, *lora, 3);
  for (const char* s : kSaved) {
    SCOPED_TRACE(s);
    expect_identical(param(*m, std::string(s) + ".weight").full(), before.at(s), "original");
    EXPECT_GT(
        max_abs_diff(param(*m, std::string(s) + ".modules_to_save.0.weight").full(), before.at(s)),
        1e-4);
  }
  const Tensor trained = (*m)(ids_of(1));
  EXPECT_GT(max_abs_diff(trained, (*base)(ids_of(1))), 1e-3);
  // The base model, and an adapter that saves nothing, compute with the originals.
  {
    auto guard = lora->disable_adapter();
    expect_close((*m)(ids_of(1)), (*base)(ids_of(1)), 1e-6, "adapters disabled");
  }
  LoraConfig plain = lora_test_config();
  plain.seed = 5;
  lora->add_adapter("plain", plain);
  lora->set_adapter("plain");
  expect_close((*m)(ids_of(1)), (*base)(ids_of(1)), 1e-6, "an adapter saving nothing");
  lora->set_adapter("default");
  expect_close((*m)(ids_of(1)), trained, 0, "back to the adapter");
  // Only the adapter's own copies are its parameters.
  std::vector<Parameter*> own = lora->adapter_parameters("default");
  for (const char* s : kSaved) {
    EXPECT_NE(
        std::find(own.begin(), own.end(), &param(*m, std::string(s) + ".modules_to_save.0.weight")),
        own.end())
        << s;
    EXPECT_EQ(std::find(own.begin(), own.end(), &param(*m, std::string(s) + ".weight")), own.end())
        << s;
  }
  // Deleted, the adapter's copies are zeroed and frozen, and the model computes as the base.
  lora->delete_adapter("default");
  EXPECT_FALSE(param(*m, "output.modules_to_save.0.weight").requires_grad());
  EXPECT_EQ(max_abs_diff(param(*m, "output.modules_to_save.0.weight").full(),
                         zeros_like(before.at("output"))),
            0.0);
}

// merge_and_unload puts the active adapter's copies in the modules' place, as PEFT's does;
// unload gives the base model back. Either way the copies leave the model.
TEST(LoraModulesToSave, MergeAndUnloadKeepTheCopiesUnloadTheOriginals) {
  if (world_size() > 1) GTEST_SKIP() << "one process";
  for (bool merge : {true, false}) {
    SCOPED_TRACE(merge ? "merge_and_unload" : "unload");
    auto m = std::make_shared<Decoder>(lora_decoder_config());
    auto lora = apply_lora(m, saving(LoraInit::Random));
    const auto before = originals(*m);
    NoGradGuard no_grad;
    for (const char* s : kSaved) {
      Parameter& copy = param(*m, std::string(s) + ".modules_to_save.0.weight");
      copy.copy_from_full(add(copy.full(), 0.25));
    }
    const Tensor with_adapter = (*m)(ids_of(2));
    ModulePtr out = merge ? lora->merge_and_unload() : lora->unload();
    for (const auto& [name, t] : out->state_dict())
      EXPECT_EQ(name.find("modules_to_save"), std::string::npos) << name;
    for (const char* s : kSaved) {
      const Tensor w = param(*out, std::string(s) + ".weight").full();
      EXPECT_NEAR(max_abs_diff(w, before.at(s)), merge ? 0.25 : 0.0, 1e-6) << s;
    }
    if (merge) expect_close((*out)(ids_of(2)), with_adapter, 1e-5, "merged model");
  }
}

// Under every layout: the copies laid out as the modules they stand for, the plain model's
// logits, and after three AdamW steps its losses and copies.
TEST(LoraModulesToSave, EveryLayoutGivesThePlainModel) {
  const LoraConfig c = saving();
  LoraRun ref{"plain", std::make_shared<Decoder>(lora_decoder_config()), nullptr, 0, 1};
  ref.lora = apply_lora(ref.model, c);
  const Tensor want = ref.logits(ids_of(0));
  const LoraTrained reference = lora_train(ref, 3);  // AdamW, eps 1e-6
  const std::vector<double>& ref_losses = reference.losses;
  const auto& trained = reference.adapter;
  for (const char* s : kSaved)
    EXPECT_EQ(trained.count(std::string(s) + ".weight"), 1u) << s;
  for (const LoraLayout& l : lora_layouts()) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(lora_decoder_config(), c);
    for (const char* s : kSaved) {
      const Parameter& own = param(*run.model, std::string(s) + ".weight");
      const Parameter& copy = param(*run.model, std::string(s) + ".modules_to_save.0.weight");
      ASSERT_EQ(own.is_dtensor(), copy.is_dtensor()) << s;
      if (own.is_dtensor()) {
        EXPECT_EQ(placements_str(own.stored_dtensor().placements()),
                  placements_str(copy.stored_dtensor().placements()))
            << s;
        EXPECT_EQ(own.stored().shape(), copy.stored().shape()) << s;
      }
    }
    expect_close(run.logits(ids_of(0)), want, 1e-5, "logits");
    const LoraTrained after = lora_train(run, 3);
    const std::vector<double>& losses = after.losses;
    for (size_t i = 0; i < losses.size(); ++i)
      EXPECT_NEAR(losses[i], ref_losses[i], 1e-6 * ref_losses[i]) << "step " << i;
    for (const auto& [key, t] : after.adapter)
      expect_close(t, trained.at(key), 1e-5, "trained " + key);
  }
}

// PEFT's files: the copies under "base_model.model.<path>.weight", modules_to_save in the
// config; loaded into a model with copies, the same model. The adapter table keeps them too
// (format 3), and a table or file naming modules without copies is refused.
TEST(LoraModulesToSave, PeftFilesAndTheAdapterTableKeepTheCopies) {
  const std::string dir = scratch_dir("lora_modules_to_save");
  const LoraConfig c = saving(LoraInit::Random);
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, c, "default", {.max_adapters = 2});
  {
    NoGradGuard no_grad;
    Parameter& copy = param(*m, "output.modules_to_save.0.weight");
    copy.copy_from_full(add(copy.full(), 0.5));
  }
  const Tensor want = (*m)(ids_of(3));
  lora->save_adapter(dir + "/adapter", "default");
  const SafetensorsFile file = load_safetensors(dir + "/adapter/adapter_model.safetensors");
  for (const char* s : kSaved)
    EXPECT_EQ(file.tensors.count("base_model.model." + std::string(s) + ".weight"), 1u) << s;
  EXPECT_EQ(file.tensors.count("base_model.model.output.modules_to_save.0.weight"), 0u);
  // A pattern entry is written as the paths it matched, as target_modules' are.
  LoraConfig patterned = saving();
  patterned.modules_to_save = {"out*", "norm"};
  patterned.seed = 4;
  lora->add_adapter("patterned", patterned);
  lora->save_adapter(dir + "/patterned", "patterned");
  {
    std::ifstream in(dir + "/patterned/adapter_config.json");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("\"modules_to_save\": [\n    \"output\",\n    \"norm\"\n  ]"),
              std::string::npos)
        << text;
  }
  lora->delete_adapter("patterned");

  // A model whose apply_lora made the copies loads it as the same model.
  auto m2 = std::make_shared<Decoder>(lora_decoder_config());
  LoraConfig other = saving();
  other.seed = 9;
  auto lora2 = apply_lora(m2, other, "first", {.max_adapters = 2});
  lora2->load_adapter(dir + "/adapter", "loaded", /*is_trainable=*/true);
  EXPECT_EQ(lora2->config("loaded").modules_to_save, c.modules_to_save);
  lora2->set_adapter("loaded");
  expect_close((*m2)(ids_of(3)), want, 1e-6, "loaded from PEFT files");
  EXPECT_TRUE(param(*m2, "output.modules_to_save.1.weight").requires_grad());

  // The table: format 3, and restored into a fresh model with the state dict.
  const StateDict table = lora->state_dict();
  EXPECT_NE(std::get<std::string>(table.at("adapters")).find("\"format\":3"), std::string::npos);
  auto m3 = std::make_shared<Decoder>(lora_decoder_config());
  auto lora3 = apply_lora(m3, other, "x", {.max_adapters = 2});
  lora3->load_state_dict(table);
  m3->load_state_dict(m->state_dict());
  EXPECT_EQ(lora3->adapters(), (std::vector<std::string>{"default"}));
  expect_close((*m3)(ids_of(3)), want, 0, "restored from the table");

  // Without copies: refused, naming the module, and nothing changes.
  auto m4 = std::make_shared<Decoder>(lora_decoder_config());
  auto lora4 = apply_lora(m4, lora_test_config(), "default", {.max_adapters = 2});
  expect_error([&] { lora4->load_adapter(dir + "/adapter", "loaded"); },
               {"adapter/adapter_config.json'",
                "'output' names a module apply_lora made no "
                "copies for"});
  expect_error([&] { lora4->load_state_dict(table); },
               {"'output' names a module apply_lora made no copies for"});
  EXPECT_EQ(lora4->adapters(), (std::vector<std::string>{"default"}));
}

TEST(LoraModulesToSave, WhatCannotBeSavedIsRefusedNamingIt) {
  auto fresh = [] { return std::make_shared<Decoder>(lora_decoder_config()); };
  LoraConfig c = lora_test_config();
  c.modules_to_save = {"wq"};
  expect_error([&] { apply_lora(fresh(), c); },
               {"modules_to_save: 'layers.0.attention.wq' (Linear)", "adapted by LoRA"});
  c.modules_to_save = {"attention"};
  expect_error([&] { apply_lora(fresh(), c); }, {"'layers.0.attention'", "has submodules"});
  c.modules_to_save = {"lm_head"};
  expect_error([&] { apply_lora(fresh(), c); }, {"'lm_head' matches no module"});
  // Tied weights: a copy would untie them.
  DecoderConfig tied = lora_decoder_config();
  tied.tie_embeddings = true;
  c.modules_to_save = {"tok_embeddings"};
  expect_error([&] { apply_lora(std::make_shared<Decoder>(tied), c); },
               {"'tok_embeddings' (Embedding) is tied to the Decoder's output projection"});
  auto shared = fresh();
  shared->output->weight = shared->tok_embeddings->weight;
  expect_error([&] { apply_lora(shared, c); },
               {"its 'weight' is tied to 'output.weight'", "untie them first"});
  c.modules_to_save = {kAllLinear};
  expect_error([&] { apply_lora(fresh(), c); }, {"\"all-linear\" in modules_to_save"});
  // A later adapter may save only what the first one's copies cover.
  auto m = fresh();
  auto lora = apply_lora(m, saving(), "default", {.max_adapters = 2});
  LoraConfig more = saving();
  more.modules_to_save.push_back("attention_norm");
  expect_error([&] { lora->add_adapter("more", more); },
               {"'attention_norm' names a module apply_lora made no copies for"});
  EXPECT_EQ(lora->adapters(), (std::vector<std::string>{"default"}));
  auto m2 = fresh();
  LoraConfig first = saving();
  first.target_modules = {"wq"};
  apply_lora(m2, first);
  LoraConfig again = saving();
  again.target_modules = {"wk"};
  expect_error([&] { apply_lora(m2, again, "again"); },
               {"'tok_embeddings'", "is saved by an earlier apply_lora"});
}

// The copies of a checkpointed module are recomputed with the adapter's copy too.
TEST(LoraModulesToSave, ActivationCheckpointingRecomputesWithTheCopies) {
  if (world_size() > 1) GTEST_SKIP() << "one process: the layouts are the next test's";
  std::map<std::string, Tensor> grads[2];
  for (int ckpt = 0; ckpt < 2; ++ckpt) {
    auto m = std::make_shared<Decoder>(lora_decoder_config());
    auto lora = apply_lora(m, saving(LoraInit::Random));
    if (ckpt) {
      checkpoint(m->output);
      for (auto& layer : m->layers)
        checkpoint(layer);
    }
    const Batch b = affine_batch(0, 4, 8, lora_decoder_config().vocab_size);
    backward(cross_entropy((*m)(b.ids), b.targets));
    for (auto& [name, p] : m->named_parameters())
      if (p->grad().defined()) grads[ckpt][name] = p->grad().clone();
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  EXPECT_EQ(grads[0].count("output.modules_to_save.0.weight"), 1u);
  EXPECT_EQ(grads[0].count("output.weight"), 0u);
  for (const auto& [name, g] : grads[0])
    expect_close(grads[1].at(name), g, 1e-6, name);
}

// The same under every layout: the recomputation (after FSDP gathered the copies again for the
// backward, under FSDP) computes with the copies, so three steps train as without checkpointing.
TEST(LoraModulesToSave, ActivationCheckpointingUnderEveryLayout) {
  for (const LoraLayout& l : lora_layouts()) {
    SCOPED_TRACE(l.name);
    LoraTrained trained[2];
    for (int ckpt = 0; ckpt < 2; ++ckpt) {
      LoraRun run = l.build(lora_decoder_config(), saving(LoraInit::Random));
      if (ckpt) {
        checkpoint(run.model->output);
        checkpoint(run.model->tok_embeddings);
        for (auto& layer : run.model->layers)
          checkpoint(layer);
      }
      trained[ckpt] = lora_train(run, 3);
    }
    for (size_t i = 0; i < trained[0].losses.size(); ++i)
      EXPECT_NEAR(trained[1].losses[i], trained[0].losses[i], 1e-6 * trained[0].losses[i]) << i;
    for (const auto& [key, t] : trained[0].adapter)
      expect_close(trained[1].adapter.at(key), t, 1e-6, key);
  }
}

// A checkpoint of the model and its adapter table, saved from every layout, loads into the last
// layout as the same model: the copies are resharded like any parameter.
TEST(LoraModulesToSave, ACheckpointLoadsOnAnotherMesh) {
  const std::string dir = scratch_dir("lora_modules_to_save_checkpoint");
  const std::vector<LoraLayout> layouts = lora_layouts();
  for (const LoraLayout& from : layouts) {
    SCOPED_TRACE(from.name + " -> " + layouts.back().name);
    LoraRun run = from.build(lora_decoder_config(), saving(LoraInit::Random));
    AdamW opt(run.lora->parameters(), AdamWOptions{.lr = 1e-2, .weight_decay = 0.0});
    lora_train_step(run, opt, 0);
    const Tensor want = run.logits(ids_of(4));
    save_lora_checkpoint(run, dir + "/checkpoint.h5");
    LoraRun fresh = layouts.back().build(lora_decoder_config(), saving());
    EXPECT_GT(max_abs_diff(fresh.logits(ids_of(4)), want), 1e-3);
    load_lora_checkpoint(fresh, dir + "/checkpoint.h5");
    expect_close(fresh.logits(ids_of(4)), want, 1e-5, "loaded");
  }
}

// An adapter added while FSDP holds the groups gathered (reshard_after_forward or
// reshard_after_backward off) gets copies of the modules' values, and a copy written then
// reaches the next forward.
TEST(LoraModulesToSave, CopiesMadeWhileFsdpHoldsTheWeightsGatheredReachTheForward) {
  const DecoderConfig cfg = lora_decoder_config();
  LoraConfig second = saving(LoraInit::Gaussian);
  second.seed = 5;
  const LoraSlots slots{.max_adapters = 2};
  auto bump = [](LoraModel& lora) {
    std::map<std::string, Tensor> values = lora.read_adapter("b");
    values.at("output.weight") = add(values.at("output.weight"), 0.5);
    lora.write_adapter("b", values);
  };
  auto plain = std::make_shared<Decoder>(cfg);
  auto plain_lora = apply_lora(plain, saving(LoraInit::Random), "default", slots);
  plain_lora->add_adapter("b", second);
  plain_lora->set_adapter("b");
  bump(*plain_lora);
  const Batch b = affine_batch(0, 2, cfg.max_seq_len, cfg.vocab_size);
  const Tensor want = (*plain)(b.ids);
  for_each_gathered_lora(saving(LoraInit::Random), slots, b.ids,
                         [&](GatheredLora& g, const std::string& what) {
                           g.lora->add_adapter("b", second);
                           g.lora->set_adapter("b");
                           bump(*g.lora);
                           NoGradGuard no_grad;
                           expect_close((*g.model)(b.ids), want, 1e-5,
                                        what + ": forward with the added adapter's copies");
                         });
}

// A mixed batch gives each sample its adapter's copies, or the originals (the base model, an
// adapter that saves nothing), as PEFT's adapter_names does: each row as that adapter alone
// computes it, under every layout.
TEST(LoraModulesToSave, AMixedBatchGivesEachSampleItsAdaptersCopies) {
  for (const LoraLayout& l : lora_layouts({.max_adapters = 3})) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(lora_decoder_config(), saving(LoraInit::Random));
    LoraConfig second = saving(LoraInit::Random);
    second.seed = 5;
    LoraConfig none = lora_test_config(LoraInit::Random);
    none.seed = 7;
    run.lora->add_adapter("second", second);
    run.lora->add_adapter("none", none);
    std::map<std::string, Tensor> values = run.lora->read_adapter("second");
    values.at("output.weight") = add(values.at("output.weight"), 0.5);
    run.lora->write_adapter("second", values);
    const Tensor ids = ids_of(5);  // 4 samples
    const std::vector<Tensor> alone =
        expect_mixed_batch_as_alone(run, {"default", "second", "", "none"}, ids);
    EXPECT_GT(max_abs_diff(kernels::narrow(alone[1], 0, 1, 1), kernels::narrow(alone[0], 0, 1, 1)),
              1e-3);
  }
}
