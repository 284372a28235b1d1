// Adapters of token rows alone (no target modules: PEFT's TrainableTokensConfig): under every
// layout, in a mixed batch, merged, in PEFT's TrainableTokens files and the adapter table, and
// what is refused. Part of the test_lora binary.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

const std::vector<int64_t> kIds = {2, 5, 9};
constexpr const char* kDeltaKey = "tok_embeddings.token_adapter.trainable_tokens_delta";

// No LoRA target; the rows of `ids` of the input embedding train.
LoraConfig tokens_only(std::vector<int64_t> ids = kIds, uint64_t seed = 3) {
  LoraConfig c = lora_test_config();
  c.target_modules.clear();
  c.trainable_token_indices = {{"", std::move(ids)}};
  c.seed = seed;
  return c;
}

Tensor ids_of(int step) {
  return affine_batch(step, 4, 8, lora_decoder_config().vocab_size).ids;
}

// The paths of the model's LoRA-wrapped layers.
std::vector<std::string> lora_layers(Module& m) {
  std::vector<std::string> out;
  for (const auto& [path, sub] : m.named_modules())
    if (std::dynamic_pointer_cast<LoraLayer>(sub)) out.push_back(path);
  return out;
}

// The adapter's token rows moved by 0.5, so that they differ from the table's.
void shift_rows(LoraModel& lora, const std::string& adapter) {
  std::map<std::string, Tensor> values = lora.read_adapter(adapter);
  values.at(kDeltaKey) = add(values.at(kDeltaKey), 0.5);
  lora.write_adapter(adapter, values);
}

// Two tables whose outputs add.
class TwoTables : public Module {
 public:
  TwoTables() : Module("TwoTables") {
    Generator gen(5);
    a = std::make_shared<Embedding>(8, 4, gen);
    b = std::make_shared<Embedding>(8, 4, gen);
    register_module("a", a);
    register_module("b", b);
  }
  Tensor forward(const Tensor& ids) override { return add((*a)(ids), (*b)(ids)); }
  std::shared_ptr<Embedding> a, b;
};

}  // namespace

// No layer is wrapped and the rows are what trains: the plain model at first, then under every
// layout one process's losses and rows after three AdamW steps, the rest frozen.
TEST(LoraNoTargets, EveryLayoutTrainsOnlyTheRows) {
  auto plain = std::make_shared<Decoder>(lora_decoder_config());
  LoraRun ref{"plain", std::make_shared<Decoder>(lora_decoder_config()), nullptr, 0, 1};
  ref.lora = apply_lora(ref.model, tokens_only());
  EXPECT_TRUE(ref.lora->layers().empty());
  EXPECT_EQ(lora_layers(*ref.model), std::vector<std::string>{});
  EXPECT_EQ(ref.lora->adapter_parameters("default").size(), 1u);
  EXPECT_EQ(ref.lora->parameters().size(), 1u);
  expect_close(ref.logits(ids_of(0)), (*plain)(ids_of(0)), 1e-6, "before training");
  const Tensor start = ref.lora->read_adapter("default").at(kDeltaKey).clone();
  const LoraTrained reference = lora_train(ref, 3);
  ASSERT_EQ(reference.adapter.size(), 1u);
  EXPECT_GT(max_abs_diff(reference.adapter.at(kDeltaKey), start), 1e-4) << "trained";
  for (const LoraLayout& l : lora_layouts()) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(lora_decoder_config(), tokens_only());
    EXPECT_EQ(lora_layers(*run.model), std::vector<std::string>{});
    expect_close(run.logits(ids_of(0)), (*plain)(ids_of(0)), 1e-5, "logits");
    const LoraTrained after = lora_train(run, 3);
    for (size_t i = 0; i < after.losses.size(); ++i)
      EXPECT_NEAR(after.losses[i], reference.losses[i], 1e-6 * reference.losses[i]) << "step " << i;
    ASSERT_EQ(after.adapter.size(), 1u);
    expect_close(after.adapter.at(kDeltaKey), reference.adapter.at(kDeltaKey), 1e-5, "rows");
    for (const auto& [name, w] : after.base)
      if (name.find("token_adapter") == std::string::npos)
        expect_identical(w, reference.base.at(name), "frozen " + name);
  }
}

// Two tokens-only adapters in one mixed batch: each sample reads its own adapter's rows, as it
// does with that adapter alone.
TEST(LoraNoTargets, AMixedBatchOfTokensOnlyAdapters) {
  for (const LoraLayout& l : lora_layouts({.max_adapters = 2})) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(lora_decoder_config(), tokens_only());
    run.lora->add_adapter("other", tokens_only({5, 1}, 7));
    shift_rows(*run.lora, "default");
    shift_rows(*run.lora, "other");
    NoGradGuard no_grad;
    const Tensor ids = ids_of(3);
    std::map<std::string, Tensor> alone;
    for (const std::string name : {"default", "other"}) {
      run.lora->set_adapter(name);
      alone[name] = run.logits(ids);
    }
    EXPECT_GT(max_abs_diff(alone.at("default"), alone.at("other")), 1e-3);
    run.lora->set_batch_adapters({"other", "default", "default", "other"});
    const Tensor mixed = run.logits(ids);
    for (int64_t s = 0; s < 4; ++s)
      expect_close(kernels::narrow(mixed, 0, s, 1),
                   kernels::narrow(alone.at(s == 0 || s == 3 ? "other" : "default"), 0, s, 1), 1e-6,
                   "sample " + std::to_string(s));
  }
}

// Merged, a tokens-only adapter gives the same logits and is known as merged (its table speaks
// for it: set_adapter unmerges it, write_adapter refuses it). save_adapter writes PEFT's
// TrainableTokens files (the rows on the table's own key), which load into another layout; the
// adapter table restores it from a checkpoint.
TEST(LoraNoTargets, MergeFilesAndTheTableKeepATokensOnlyAdapter) {
  const std::string dir = scratch_dir("lora_no_targets");
  for (const std::string key : {"", "tok_embeddings"}) {
    SCOPED_TRACE("key '" + key + "'");
    LoraConfig c = tokens_only();
    c.trainable_token_indices.front().first = key;
    auto m = std::make_shared<Decoder>(lora_decoder_config());
    auto lora = apply_lora(m, c);
    shift_rows(*lora, "default");
    NoGradGuard no_grad;
    const Tensor want = (*m)(ids_of(2));
    lora->save_adapter(dir, "default");
    {
      std::ifstream in(dir + "/adapter_config.json");
      const nlohmann::json j = nlohmann::json::parse(in);
      EXPECT_EQ(j.at("peft_type"), "TRAINABLE_TOKENS");
      EXPECT_EQ(j.at("token_indices"), nlohmann::json(kIds));
      EXPECT_EQ(j.at("target_modules"),
                key.empty() ? nlohmann::json(nullptr) : nlohmann::json({"tok_embeddings"}));
      EXPECT_EQ(j.at("init_weights"), true);
      EXPECT_EQ(j.count("r"), 0u);
      const SafetensorsFile file = load_safetensors(dir + "/adapter_model.safetensors");
      ASSERT_EQ(file.tensors.size(), 1u);
      EXPECT_EQ(file.tensors.begin()->first,
                "base_model.model.tok_embeddings.trainable_tokens_delta");
      expect_identical(file.tensors.begin()->second, lora->read_adapter("default").at(kDeltaKey),
                       "the file's rows");
    }
    world_group()->barrier()->wait();
    for (const LoraLayout& l : lora_layouts({.max_adapters = 2, .max_trainable_tokens = 3})) {
      SCOPED_TRACE(l.name);
      LoraRun run = l.build(lora_decoder_config(), tokens_only({1}, 9));
      run.lora->load_adapter(dir, "loaded");
      EXPECT_EQ(run.lora->config("loaded").trainable_token_indices,
                (std::vector<std::pair<std::string, std::vector<int64_t>>>{{key, kIds}}));
      run.lora->set_adapter("default");
      const Tensor other = run.logits(ids_of(2));
      run.lora->set_adapter("loaded");
      expect_close(run.logits(ids_of(2)), want, 1e-5, "loaded from PEFT's files");
      run.lora->merge_adapter("loaded");
      expect_close(run.logits(ids_of(2)), want, 1e-5, "merged");
      expect_error([&] { run.lora->write_adapter("loaded", run.lora->read_adapter("loaded")); },
                   {"write_adapter 'loaded'", "merged into the base weights"});
      run.lora->set_adapter("default");
      expect_close(run.logits(ids_of(2)), other, 1e-6, "another adapter after the merge");
      run.lora->set_adapter("loaded");
      const std::string ckpt = dir + "/ckpt.h5";
      save_lora_checkpoint(run, ckpt);
      LoraRun back = l.build(lora_decoder_config(), tokens_only({4}, 11));
      load_lora_checkpoint(back, ckpt);
      EXPECT_EQ(back.lora->active_adapter(), "loaded");
      expect_close(back.logits(ids_of(2)), want, 1e-5, "restored from a checkpoint");
    }
    world_group()->barrier()->wait();
  }
}

// A file as PEFT's TrainableTokensConfig writes it by hand (other fields, the rows on the
// table's own key) loads; one PEFT could not have made is refused, naming the file and field.
TEST(LoraNoTargets, PeftTrainableTokensFilesLoad) {
  if (world_size() > 1) GTEST_SKIP() << "one process";
  const std::string dir = scratch_dir("lora_peft_tokens");
  std::filesystem::create_directories(dir);
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora =
      apply_lora(m, tokens_only({1}), "default", {.max_adapters = 2, .max_trainable_tokens = 3});
  const int64_t dim = lora_decoder_config().dim;
  const Tensor rows = random_tensor({2, dim}, 21, DType::Float32);
  save_safetensors(dir + "/adapter_model.safetensors",
                   {{"base_model.model.tok_embeddings.trainable_tokens_delta", rows}},
                   {{"format", "pt"}});
  auto write_config = [&](const std::string& text) {
    std::ofstream(dir + "/adapter_config.json") << text;
  };
  write_config(R"({"auto_mapping": null, "base_model_name_or_path": "x", "inference_mode": true,
                   "init_weights": true, "peft_type": "TRAINABLE_TOKENS", "peft_version": "0.17",
                   "revision": null, "target_modules": ["tok_embeddings"], "task_type": null,
                   "token_indices": [6, 4]})");
  lora->load_adapter(dir, "peft");
  lora->set_adapter("peft");
  NoGradGuard no_grad;
  TokenEmbedding& table = dynamic_cast<TokenEmbedding&>(*m->tok_embeddings);
  const Tensor ids = from_vector<int64_t>({6, 0, 4, 6}, {1, 4});
  const Tensor out = table(ids);
  expect_identical(kernels::narrow(out, 1, 0, 1),
                   kernels::reshape(kernels::narrow(rows, 0, 0, 1), {1, 1, dim}),
                   "id 6: the file's first row");
  expect_identical(kernels::narrow(out, 1, 2, 1),
                   kernels::reshape(kernels::narrow(rows, 0, 1, 1), {1, 1, dim}),
                   "id 4: its second row");
  for (
      const auto& [text, field] : std::vector<std::pair<std::string, std::string>>{
          {R"({"peft_type": "TRAINABLE_TOKENS", "target_modules": "tok_.*", "token_indices": [6]})",
           "a regular expression is not supported"},
          {R"({"peft_type": "TRAINABLE_TOKENS", "token_indices": [6, "x"]})", "not a token id"},
          {R"({"peft_type": "TRAINABLE_TOKENS", "token_indices": []})", "lists no token ids"},
          {R"({"peft_type": "IA3", "r": 4})",
           "peft_type is not \"LORA\" or \"TRAINABLE_TOKENS\""}}) {
    write_config(text);
    expect_error([&] { lora->load_adapter(dir, "bad"); }, {"adapter_config.json'", field});
  }
  EXPECT_EQ(lora->adapters(), (std::vector<std::string>{"default", "peft"}));
}

// An adapter that would train nothing, fields only LoRA layers use beside no targets, a LoRA
// target where apply_lora wrapped no layer, and tables that PEFT's one token_indices cannot
// describe are refused, naming what; the model stays as it was.
TEST(LoraNoTargets, WhatTrainsNothingIsRefusedNamingIt) {
  if (world_size() > 1) GTEST_SKIP() << "one process";
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  LoraConfig nothing = lora_test_config();
  nothing.target_modules.clear();
  expect_error([&] { apply_lora(m, nothing); },
               {"target_modules is empty", "would train nothing", "TrainableTokensConfig"});
  for (const std::string field : {"modules_to_save", "bias", "use_dora", "rank_pattern"}) {
    LoraConfig c = tokens_only();
    if (field == "modules_to_save") c.modules_to_save = {"output"};
    if (field == "bias") c.bias = "all";
    if (field == "use_dora") c.use_dora = true;
    if (field == "rank_pattern") c.rank_pattern = {{"wq", 2}};
    expect_error([&] { apply_lora(m, c); },
                 {field + " is set but target_modules is empty", "TrainableTokensConfig"});
  }
  EXPECT_EQ(m->tok_embeddings->type_name(), "Embedding");
  for (const auto& [name, p] : m->named_parameters())
    EXPECT_TRUE(p->requires_grad()) << name;

  auto lora = apply_lora(m, tokens_only(), "default", {.max_adapters = 3});
  expect_error([&] { lora->add_adapter("wq", lora_test_config()); },
               {"target module 'wq'", "where apply_lora put no slots"});
  EXPECT_EQ(lora->adapters(), std::vector<std::string>{"default"});
  expect_error([&] { lora->add_weighted_adapter({"default"}, {1.0}, "w", "linear"); },
               {"adapter 'default' has trainable tokens"});

  auto two = std::make_shared<TwoTables>();
  LoraConfig c = tokens_only();
  c.trainable_token_indices = {{"a", {1, 2}}, {"b", {1, 3}}};
  auto both = apply_lora(two, c);
  expect_error([&] { both->save_adapter(scratch_dir("lora_two_tables"), "default"); },
               {"save_adapter 'default'", "one token_indices serves every table", "'a' and 'b'"});
}
