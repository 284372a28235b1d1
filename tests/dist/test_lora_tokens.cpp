// PEFT's trainable tokens (trainable_token_indices): the rows of a few ids of a table train and
// the table stays; under every layout, in mixed batches, merged, in PEFT's files and the adapter
// table, and what is refused. Part of the test_lora binary.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

const std::vector<int64_t> kIds = {3, 7, 11};
constexpr const char* kDeltaKey = "tok_embeddings.token_adapter.trainable_tokens_delta";

// LoRA on the decoder's projections, and the rows of `ids` of its table (the key "" is the input
// embedding, PEFT's list form).
LoraConfig with_tokens(std::vector<int64_t> ids = kIds, const std::string& key = "",
                       uint64_t seed = 3) {
  LoraConfig c = lora_test_config();
  c.trainable_token_indices = {{key, std::move(ids)}};
  c.seed = seed;
  return c;
}

// A LoRA config targeting `path` alone.
LoraConfig lora_test_config_for(const std::string& path) {
  LoraConfig c = lora_test_config();
  c.target_modules = {path};
  return c;
}

Tensor ids_of(int step) {
  return affine_batch(step, 4, 8, lora_decoder_config().vocab_size).ids;
}

// PEFT's forward table: `w` with row ids[j] replaced by row j of `rows` (W.index_copy).
Tensor index_copy(const Tensor& w, const std::vector<int64_t>& ids, const Tensor& rows) {
  Tensor out = w.clone();
  for (size_t j = 0; j < ids.size(); ++j)
    kernels::narrow(out, 0, ids[j], 1).copy_(kernels::narrow(rows, 0, int64_t(j), 1));
  return out;
}

// Rows `ids` of `w`, stacked.
Tensor rows_of(const Tensor& w, const std::vector<int64_t>& ids) {
  return embedding(from_vector<int64_t>(ids), w);
}

TokenEmbedding& table_of(Decoder& m) {
  auto t = std::dynamic_pointer_cast<TokenEmbedding>(m.tok_embeddings);
  EXPECT_NE(t, nullptr) << "tok_embeddings is a " << m.tok_embeddings->type_name();
  return *t;
}

// The adapter's token rows under `key` moved by `by` (so that they differ from the table's),
// through write_adapter.
void shift_rows(LoraModel& lora, const std::string& adapter, const std::string& key = kDeltaKey,
                double by = 0.5) {
  std::map<std::string, Tensor> values = lora.read_adapter(adapter);
  values.at(key) = add(values.at(key), by);
  lora.write_adapter(adapter, values);
}

// A table "emb" whose output a Linear "proj" reads.
class TableAndProj : public Module {
 public:
  TableAndProj(int64_t num, int64_t dim) : Module("TableAndProj") {
    Generator gen(11);
    emb = std::make_shared<Embedding>(num, dim, gen);
    proj = std::make_shared<Linear>(dim, dim, false, gen);
    register_module("emb", emb);
    register_module("proj", proj);
  }
  Tensor forward(const Tensor& ids) override { return (*proj)((*emb)(ids)); }
  std::shared_ptr<Embedding> emb;
  std::shared_ptr<Linear> proj;
};

}  // namespace

// The rows start as the table's (the adapter changes nothing), train, and are what the forward
// reads for those ids, as PEFT's index_copy; the table stays frozen and unchanged; other
// adapters, the base model and a deleted adapter read the table alone.
TEST(LoraTokens, TheNamedRowsTrainAndTheTableStays) {
  if (world_size() > 1) GTEST_SKIP() << "one process: layouts are the next tests'";
  const int64_t dim = lora_decoder_config().dim;
  auto base = std::make_shared<Decoder>(lora_decoder_config());
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, with_tokens(), "default", {.max_adapters = 2});
  TokenEmbedding& table = table_of(*m);
  ASSERT_EQ(lora->token_tables().size(), 1u);
  EXPECT_EQ(lora->token_tables().front().first, "tok_embeddings");
  EXPECT_EQ(table.max_tokens(), 3);
  EXPECT_EQ(table.token_indices(0), kIds);
  const Tensor w = table.weight.full().clone();
  Parameter& delta = table.trainable_tokens_delta(0);
  EXPECT_EQ(delta.global_shape(), (Shape{3, dim}));
  expect_identical(delta.full(), rows_of(w, kIds), "the rows start as the table's");
  EXPECT_TRUE(delta.requires_grad());
  EXPECT_FALSE(table.weight.requires_grad());
  EXPECT_EQ(m->state_dict().count(std::string(kDeltaKey) + ".0"), 1u);
  expect_close((*m)(ids_of(0)), (*base)(ids_of(0)), 1e-6, "a new adapter");

  // The gradient of row j is the sum of the output gradients of the ids kIds[j].
  const Tensor ids = from_vector<int64_t>({3, 0, 7, 11, 3, 5}, {2, 3});
  const Tensor g = random_tensor({2, 3, dim}, 5, DType::Float32);
  backward(sum(mul(table(ids), g)));
  const Tensor gf = reshape(g, {6, dim});
  Tensor want = zeros({3, dim});
  for (const auto& [k, j] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {4, 0}, {2, 1}, {3, 2}})
    kernels::narrow(want, 0, j, 1)
        .copy_(add(kernels::narrow(want, 0, j, 1), kernels::narrow(gf, 0, k, 1)));
  expect_close(delta.grad(), want, 1e-6, "the rows' gradient");
  EXPECT_FALSE(table.weight.grad().defined());
  delta.zero_grad();

  train_one_process(*m, *lora, 3);
  expect_identical(table.weight.full(), w, "the table after training");
  EXPECT_GT(max_abs_diff(delta.full(), rows_of(w, kIds)), 1e-4);
  NoGradGuard no_grad;
  expect_identical(table(ids), embedding(ids, index_copy(w, kIds, delta.full())),
                   "PEFT's forward: the table with the rows replaced");
  {
    auto guard = lora->disable_adapter();
    expect_identical(table(ids), embedding(ids, w), "adapters disabled");
  }
  LoraConfig plain = lora_test_config();
  plain.seed = 5;
  lora->add_adapter("plain", plain);
  lora->set_adapter("plain");
  expect_identical(table(ids), embedding(ids, w), "an adapter training no tokens");
  lora->set_adapter("default");
  std::vector<Parameter*> own = lora->adapter_parameters("default");
  EXPECT_NE(std::find(own.begin(), own.end(), &delta), own.end());
  EXPECT_EQ(std::find(own.begin(), own.end(), &table.weight), own.end());
  lora->delete_adapter("default");
  EXPECT_TRUE(table.token_indices(0).empty());
  expect_identical(delta.full(), zeros({3, dim}), "a freed slot's rows");
  expect_identical(table(ids), embedding(ids, w), "after the adapter is deleted");
}

// Under every layout: the rows laid out for the table (replicated beside a vocabulary-parallel
// table, then sharded by FSDP), the plain model's logits, and after three AdamW steps its losses
// and rows.
TEST(LoraTokens, EveryLayoutGivesThePlainModel) {
  const LoraConfig c = with_tokens();
  LoraRun ref{"plain", std::make_shared<Decoder>(lora_decoder_config()), nullptr, 0, 1};
  ref.lora = apply_lora(ref.model, c);
  const Tensor want = ref.logits(ids_of(0));
  const LoraTrained reference = lora_train(ref, 3);
  ASSERT_EQ(reference.adapter.count(kDeltaKey), 1u);
  EXPECT_GT(max_abs_diff(reference.adapter.at(kDeltaKey),
                         rows_of(reference.base.at("tok_embeddings.weight"), kIds)),
            1e-4);
  for (const LoraLayout& l : lora_layouts()) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(lora_decoder_config(), c);
    const Parameter& delta = table_of(*run.model).trainable_tokens_delta(0);
    const Parameter& w = table_of(*run.model).weight;
    ASSERT_EQ(w.is_dtensor(), delta.is_dtensor());
    if (l.name.rfind("tp", 0) == 0) {  // beside the vocabulary-parallel table, whole
      EXPECT_EQ(placements_str(delta.stored_dtensor().placements()), "[R]");
    }
    expect_close(run.logits(ids_of(0)), want, 1e-5, "logits");
    const LoraTrained after = lora_train(run, 3);
    for (size_t i = 0; i < after.losses.size(); ++i)
      EXPECT_NEAR(after.losses[i], reference.losses[i], 1e-6 * reference.losses[i]) << "step " << i;
    ASSERT_EQ(after.adapter.size(), reference.adapter.size());
    for (const auto& [key, t] : after.adapter)
      expect_close(t, reference.adapter.at(key), 1e-5, "trained " + key);
    expect_identical(after.base.at("tok_embeddings.weight"),
                     reference.base.at("tok_embeddings.weight"), "the table");
  }
}

// A vocabulary-parallel table (into replicated outputs or sequence shards) and one split on dim
// 1, with LoRA applied before or after parallelize_module: one process's output and row
// gradients, and the plain table's collectives in the forward and the backward.
TEST(LoraTokens, ASplitTableGivesOneProcesssValuesAndItsCollectives) {
  const int64_t n = world_size(), num = 10, dim = 8, seq = 4;
  if (n == 1) GTEST_SKIP() << "needs a split table";
  const DeviceMesh mesh(Shape{n}, {"tp"});
  const Tensor ids = from_vector<int64_t>({9, 0, 4, 4, 7, 2, 1, 8}, {2, seq});
  LoraConfig config = lora_test_config();
  config.target_modules = {"proj"};
  config.trainable_token_indices = {{"emb", {4, 9, 1}}};
  const std::string key = "emb.token_adapter.trainable_tokens_delta";
  for (const std::string kind : {"vocabulary", "vocabulary into sequence shards", "column"}) {
    SCOPED_TRACE(kind);
    ParallelizePlan plan;
    if (kind == "column") {
      ColwiseParallel s;
      s.output_layouts = {Replicate()};
      plan.emplace_back("emb", std::make_shared<ColwiseParallel>(s));
    } else {
      RowwiseParallel s;
      s.input_layouts = {Replicate()};
      if (kind != "vocabulary") s.output_layouts = {Shard(1)};
      plan.emplace_back("emb", std::make_shared<RowwiseParallel>(s));
    }
    auto plain = std::make_shared<TableAndProj>(num, dim);
    parallelize_module(plain, mesh, plan);
    const auto [plain_fwd, plain_bwd] = table_collectives(*plain->emb, ids);
    auto ref = std::make_shared<TableAndProj>(num, dim);
    auto ref_lora = apply_lora(ref, config);
    shift_rows(*ref_lora, "default", key, 0.5);
    const Tensor full = (*ref->emb)(ids);
    backward(sum(mul(full, full)));
    auto& ref_table = dynamic_cast<TokenEmbedding&>(*ref->emb);
    for (const bool lora_first : {true, false}) {
      SCOPED_TRACE(lora_first ? "LoRA first" : "LoRA after");
      auto m = std::make_shared<TableAndProj>(num, dim);
      std::shared_ptr<LoraModel> lora;
      if (lora_first) lora = apply_lora(m, config);
      parallelize_module(m, mesh, plan);
      if (!lora_first) lora = apply_lora(m, config);
      shift_rows(*lora, "default", key, 0.5);
      auto& table = dynamic_cast<TokenEmbedding&>(*m->emb);
      const Placement want_p = kind == "column" ? Placement(Shard(1)) : Placement(Replicate());
      EXPECT_EQ(placements_str(table.trainable_tokens_delta(0).stored_dtensor().placements()),
                placements_str({want_p}));
      const auto [fwd, bwd] = table_collectives(*m->emb, ids);
      EXPECT_EQ(counts_str(fwd), counts_str(plain_fwd)) << "forward";
      EXPECT_EQ(counts_str(bwd), counts_str(plain_bwd)) << "backward";
      expect_close(table.trainable_tokens_delta(0).grad_dtensor().full_tensor(),
                   ref_table.trainable_tokens_delta(0).grad(), 1e-5, "the rows' gradient");
      NoGradGuard no_grad;
      const Tensor got = (*m->emb)(ids);
      const Tensor want =
          kind == "vocabulary into sequence shards"
              ? kernels::narrow(full, 1, mesh.local_rank(0) * (seq / n), seq / n).contiguous()
              : full;
      if (seq % n == 0) expect_close(got, want, 1e-6, "output");
    }
  }
}

// Each sample reads its own adapter's rows (two adapters training some of the same ids), or the
// table for the base model, as that adapter alone gives; an adapter whose rows are NaN reaches no
// other sample.
TEST(LoraTokens, AMixedBatchGivesEachSampleItsAdaptersRows) {
  for (const LoraLayout& l : lora_layouts({.max_adapters = 3})) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(lora_decoder_config(), with_tokens());
    run.lora->add_adapter("other", with_tokens({7, 20}, "tok_embeddings", 5));
    shift_rows(*run.lora, "default", kDeltaKey, 0.5);
    shift_rows(*run.lora, "other", kDeltaKey, -0.25);
    // Every sample holds both adapters' ids.
    std::vector<int64_t> v;
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t id : {3L, 7L, 11L, 20L, r, r + 9, 7L, 30L})
        v.push_back(id);
    const Tensor ids = from_vector<int64_t>(v, {4, 8});
    const std::vector<Tensor> alone =
        expect_mixed_batch_as_alone(run, {"other", "default", "", "default"}, ids);
    EXPECT_GT(max_abs_diff(alone[0], alone[1]), 1e-3);
    // NaN rows for "other" (whose rows come first in the batch's stacked rows): the other
    // samples' logits stay their adapters'.
    std::map<std::string, Tensor> values = run.lora->read_adapter("other");
    values.at(kDeltaKey) = full_like(values.at(kDeltaKey), std::nan(""));
    run.lora->write_adapter("other", values);
    run.lora->set_batch_adapters(
        std::vector<std::string>{"other", "default", "__base__", "default"});
    NoGradGuard no_grad;
    const Tensor mixed = run.logits(ids);
    for (int64_t r : {1, 2, 3})
      expect_close(kernels::narrow(mixed, 0, r, 1), kernels::narrow(alone[size_t(r)], 0, r, 1),
                   1e-5, "sample " + std::to_string(r));
    run.lora->set_batch_adapters(Tensor());
  }
}

// merge_adapter writes the rows into the table (the logits stay), unmerge_adapter puts the
// table's rows back bit for bit; merge_and_unload leaves a plain Embedding holding the rows,
// unload the table as it was; safe_merge refuses NaN rows, naming the table.
TEST(LoraTokens, MergeWritesTheRowsAndUnmergePutsTheTableBack) {
  for (const LoraLayout& l : lora_layouts()) {
    SCOPED_TRACE(l.name);
    for (const std::string how : {"merge", "merge_and_unload", "unload"}) {
      SCOPED_TRACE(how);
      const bool and_unload = how != "merge";
      LoraRun run = l.build(lora_decoder_config(), with_tokens());
      shift_rows(*run.lora, "default");
      TokenEmbedding& table = table_of(*run.model);
      const Tensor w = table.weight.full().clone();
      const Tensor rows = table.trainable_tokens_delta(0).full().clone();
      NoGradGuard no_grad;
      const Tensor want = run.logits(ids_of(1));
      const bool sharded = l.name.rfind("fsdp", 0) == 0 || l.name.rfind("hsdp", 0) == 0;
      if (and_unload && sharded) {
        expect_error([&] { run.lora->merge_and_unload(); }, {"fully_shard"});
        continue;
      }
      if (and_unload) {
        ModulePtr out = how == "unload" ? run.lora->unload() : run.lora->merge_and_unload();
        auto m = std::dynamic_pointer_cast<Decoder>(out);
        EXPECT_EQ(m->tok_embeddings->type_name(), "Embedding");
        for (const auto& [name, t] : m->state_dict())
          EXPECT_EQ(name.find("token_adapter"), std::string::npos) << name;
        expect_identical(m->tok_embeddings->weight.full(),
                         how == "unload" ? w : index_copy(w, kIds, rows), "the unloaded table");
        continue;
      }
      run.lora->merge_adapter("default");
      expect_identical(table.weight.full(), index_copy(w, kIds, rows), "merged table");
      expect_close(run.logits(ids_of(1)), want, 1e-6, "merged logits");
      run.lora->unmerge_adapter("default");
      expect_identical(table.weight.full(), w, "unmerged table");
      expect_close(run.logits(ids_of(1)), want, 1e-6, "unmerged logits");
      std::map<std::string, Tensor> values = run.lora->read_adapter("default");
      kernels::narrow(values.at(kDeltaKey), 0, 1, 1).fill_(std::nan(""));
      run.lora->write_adapter("default", values);
      expect_error([&] { run.lora->merge_adapter("default", /*safe_merge=*/true); },
                   {"tok_embeddings (trainable tokens)", "NaN or infinite", "nothing was merged"});
      expect_identical(table.weight.full(), w, "after the refused merge");
    }
  }
}

// PEFT's files: the rows under "base_model.model.<table>.token_adapter.trainable_tokens_delta",
// the ids as PEFT's list (the input embedding) or object; loaded into a model with the table
// wrapped, the same logits. The adapter table (format 4) restores them from a checkpoint too,
// onto another mesh.
TEST(LoraTokens, PeftFilesAndTheAdapterTableKeepTheRows) {
  const std::string dir = scratch_dir("lora_tokens");
  for (const std::string key : {"", "tok_embeddings"}) {
    SCOPED_TRACE("key '" + key + "'");
    auto m = std::make_shared<Decoder>(lora_decoder_config());
    auto lora = apply_lora(m, with_tokens(kIds, key), "default", {.max_adapters = 2});
    shift_rows(*lora, "default");
    NoGradGuard no_grad;
    const Tensor want = (*m)(ids_of(2));
    lora->save_adapter(dir, "default");
    const SafetensorsFile file = load_safetensors(dir + "/adapter_model.safetensors");
    const std::string peft_key = std::string("base_model.model.") + kDeltaKey;
    ASSERT_EQ(file.tensors.count(peft_key), 1u);
    expect_identical(file.tensors.at(peft_key), lora->read_adapter("default").at(kDeltaKey),
                     "the file's rows");
    std::ifstream in(dir + "/adapter_config.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    if (key.empty())
      EXPECT_EQ(j.at("trainable_token_indices"), nlohmann::json(kIds));
    else
      EXPECT_EQ(j.at("trainable_token_indices"), nlohmann::json({{"tok_embeddings", kIds}}));
    world_group()->barrier()->wait();
    for (const LoraLayout& l : lora_layouts({.max_adapters = 2, .max_trainable_tokens = 3})) {
      SCOPED_TRACE(l.name);
      LoraRun run = l.build(lora_decoder_config(), with_tokens({1, 2}, key, 9));
      run.lora->load_adapter(dir, "loaded");
      // As PEFT's, for inference unless is_trainable: its rows stay frozen.
      EXPECT_FALSE(table_of(*run.model)
                       .trainable_tokens_delta(run.lora->adapter_id("loaded"))
                       .requires_grad());
      run.lora->set_adapter("loaded");
      expect_close(run.logits(ids_of(2)), want, 1e-5, "loaded from PEFT's files");
      const std::string ckpt = dir + "/ckpt.h5";
      save_lora_checkpoint(run, ckpt);
      LoraRun back = l.build(lora_decoder_config(), with_tokens({5}, key, 11));
      load_lora_checkpoint(back, ckpt);
      EXPECT_EQ(back.lora->active_adapter(), "loaded");
      EXPECT_EQ(table_of(*back.model).token_indices(run.lora->adapter_id("loaded")), kIds);
      expect_close(back.logits(ids_of(2)), want, 1e-5, "restored from a checkpoint");
      run.lora->set_adapter("default");
      back.lora->set_adapter("default");
      expect_close(back.logits(ids_of(2)), run.logits(ids_of(2)), 1e-6, "the other adapter");
    }
  }
}

// What cannot train tokens is refused before the model changes, naming it.
TEST(LoraTokens, WhatCannotTrainTokensIsRefusedNamingIt) {
  if (world_size() > 1) GTEST_SKIP() << "one process";
  auto fresh = [] { return std::make_shared<Decoder>(lora_decoder_config()); };
  auto refused = [&](const LoraConfig& c, const std::vector<std::string>& words,
                     const LoraSlots& slots = {}) {
    auto m = fresh();
    expect_error([&] { apply_lora(m, c, "default", slots); }, words);
    EXPECT_EQ(m->tok_embeddings->type_name(), "Embedding") << "the model changed";
  };
  refused(with_tokens({}), {"no token ids", "the input embedding"});
  refused(with_tokens({3, -1}), {"token id -1"});
  refused(with_tokens({3, 3}), {"token id 3 twice"});
  refused(with_tokens({3, 32}), {"token id 32", "out of range", "num_embeddings 32"});
  refused(with_tokens({3}, "embeddings"), {"'embeddings'", "matches no module"});
  {
    // The key "" outside a Decoder: the model's only Embedding, else refused naming them.
    LoraConfig c = lora_test_config_for("proj");
    c.trainable_token_indices = {{"", {1}}};
    auto one = std::make_shared<TableAndProj>(10, 8);
    EXPECT_EQ(apply_lora(one, c)->token_tables().front().first, "emb");
    auto two = std::make_shared<TableAndProj>(10, 8);
    Generator gen(1);
    two->add_module("extra", std::make_shared<Embedding>(10, 8, gen));
    expect_error([&] { apply_lora(two, c); },
                 {"the key \"\"", "input embedding", "the Embeddings emb, extra"});
  }
  LoraConfig twice = with_tokens();
  twice.trainable_token_indices.push_back({"tok_embeddings", {1}});
  refused(twice, {"'tok_embeddings' is named by two keys"});
  refused(with_tokens({3}, "wq"), {"layers.0.attention.wq", "not an Embedding"});
  LoraConfig both = with_tokens();
  both.target_modules.push_back("tok_embeddings");
  refused(both, {"tok_embeddings", "adapted by LoRA"});
  LoraConfig saved = with_tokens();
  saved.modules_to_save = {"tok_embeddings"};
  refused(saved, {"tok_embeddings", "modules_to_save"});
  refused(with_tokens({1, 2, 3, 4}), {"4 token ids", "max_trainable_tokens is 3"},
          {.max_trainable_tokens = 3});
  {
    // Tied by assignment: the other module would go on reading the table without the rows.
    auto m = fresh();
    m->output->weight = m->tok_embeddings->weight;
    expect_error([&] { apply_lora(m, with_tokens()); },
                 {"tok_embeddings", "tied to 'output.weight'"});
  }
  {
    auto m = fresh();
    fully_shard(m->tok_embeddings, DeviceMesh(Shape{1}, {"dp"}));
    expect_error([&] { apply_lora(m, with_tokens()); }, {"tok_embeddings", "fully_shard"});
  }
  // A later adapter: within the slots' rows, on the tables apply_lora wrapped.
  auto m = fresh();
  auto lora = apply_lora(m, with_tokens(), "default", {.max_adapters = 3});
  expect_error(
      [&] {
        lora->add_adapter("more", with_tokens({1, 2, 4, 5}, "", 4));
      },
      {"'more'", "4 token ids", "at most 3"});
  LoraConfig other_table = lora_test_config();
  other_table.target_modules = {"wq"};
  other_table.trainable_token_indices = {{"output", {1}}};
  expect_error([&] { lora->add_adapter("more", other_table); },
               {"'output'", "did not wrap for trainable tokens"});
  EXPECT_EQ(lora->adapters(), std::vector<std::string>{"default"});
  expect_error([&] { apply_lora(m, lora_test_config_for("tok_embeddings")); },
               {"tok_embeddings", "trainable tokens of an earlier apply_lora"});
  LoraConfig again = with_tokens();
  again.target_modules = {"output"};
  expect_error([&] { apply_lora(m, again); },
               {"tok_embeddings", "trainable tokens of an earlier apply_lora already"});
  // PEFT combines LoRA matrices only.
  lora->add_adapter("second", with_tokens({5}, "", 4));
  expect_error(
      [&] {
        lora->add_weighted_adapter({"default", "second"}, {1.0, 1.0}, "mix", "cat");
      },
      {"'default'", "trainable tokens"});
  // A checkpoint taken while merged cannot be restored: the replaced rows are not in it.
  lora->merge_adapter("default");
  const StateDict table = lora->state_dict();
  lora->unmerge_adapter("default");
  expect_error([&] { lora->load_state_dict(table); },
               {"adapter 'default'", "trainable tokens saved merged", "save it unmerged"});
}

// Under a Decoder's tie_embeddings the output layer reads the adapter's rows too (PEFT's tied
// adapter): logits and the rows' gradients (from the lookup and the projection) are those of the
// tied decoder whose table holds the rows, under every layout; merge and unmerge keep them; in a
// mixed batch each sample reads its own adapter's rows.
TEST(LoraTokens, ATiedOutputLayerReadsTheRowsToo) {
  DecoderConfig cfg = lora_decoder_config();
  cfg.tie_embeddings = true;
  const Tensor ids = ids_of(4);
  for (const LoraLayout& l : lora_layouts({.max_adapters = 3})) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(cfg, with_tokens());
    shift_rows(*run.lora, "default");
    const Tensor rows = run.lora->read_adapter("default").at(kDeltaKey);
    // The reference: the tied decoder with the rows in its table, which trains, and the same
    // LoRA adapter.
    auto ref = std::make_shared<Decoder>(cfg);
    auto ref_lora = apply_lora(ref, lora_test_config());
    ref->tok_embeddings->weight.copy_from_full(
        index_copy(ref->tok_embeddings->weight.full(), kIds, rows));
    ref->tok_embeddings->weight.set_requires_grad(true);
    const Tensor want = (*ref)(ids);
    backward(sum(mul(want, want)));
    const Tensor got = run.logits(ids);
    expect_close(got, want, 1e-5, "logits");
    backward(sum(mul(got, got)));
    Parameter& delta = table_of(*run.model).trainable_tokens_delta(0);
    const Tensor grad = delta.is_dtensor() ? delta.grad_dtensor().full_tensor() : delta.grad();
    expect_close(grad, rows_of(ref->tok_embeddings->weight.grad(), kIds), 1e-4,
                 "the rows' gradient");
    expect_merge_keeps_logits(run, ids, want, l.name);
    NoGradGuard no_grad;
    // A mixed batch: each sample's logits read its own adapter's rows (an adapter training
    // other and shared ids, one training none, the base model).
    run.lora->add_adapter("other", with_tokens({7, 20}, "", 5));
    shift_rows(*run.lora, "other", kDeltaKey, -0.25);
    run.lora->add_adapter("plain", lora_test_config());
    expect_mixed_batch_as_alone(run, {"other", "default", "", "plain"}, ids);
  }
}
