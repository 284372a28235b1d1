// Several adapters in one LoRA model under every parallelism: mixed-adapter batches and their
// masks, merge/unmerge of one adapter among others, deleting the active one, and PEFT files
// written from one layout and loaded into every other. Part of the test_lora binary.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

// Several adapters of different ranks in preallocated slots: a mixed batch routes each sample to
// its own adapter (its output is that adapter's alone), only the adapters used get gradients,
// and adapters come and go after fully_shard without wrapping the model again.
TEST(Lora, MixedBatchesRouteEachSampleToItsAdapter) {
  const DecoderConfig cfg = lora_decoder_config();
  // Slots are fixed by apply_lora: build the layouts with them.
  for (const LoraLayout& l : lora_layouts({.max_adapters = 3, .max_rank = 8})) {
    LoraConfig a = lora_test_config(LoraInit::Random);
    LoraRun run = l.build(cfg, a);
    LoraConfig b = a;
    b.r = 8;
    b.seed = 11;
    LoraConfig c = a;
    c.r = 2;
    c.seed = 12;
    c.target_modules = {"wq", "wv"};
    run.lora->add_adapter("b", b);
    run.lora->add_adapter("c", c);
    const Batch batch = affine_batch(3, 6, cfg.max_seq_len, cfg.vocab_size);
    // Each adapter alone, on the whole batch.
    std::map<std::string, Tensor> alone;
    for (const std::string name : {"default", "b", "c", ""}) {
      run.lora->set_adapter(name);
      alone[name] = run.logits(batch.ids);
    }
    // By name, as PEFT's adapter_names ("__base__": the base model); the ids below.
    const std::vector<std::string> route = {"default", "b", "", "b", "default", "c"};
    run.lora->set_batch_adapters({"default", "b", "__base__", "b", "default", "c"});
    const Tensor mixed = run.logits(batch.ids);
    for (int64_t row = 0; row < 6; ++row)
      expect_close(kernels::narrow(mixed, 0, row, 1),
                   kernels::narrow(alone[route[size_t(row)]], 0, row, 1), 1e-5,
                   l.name + " row " + std::to_string(row) + " (" + route[size_t(row)] + ")");
    expect_error(
        [&] {
          run.lora->set_batch_adapters({"default", "nope"});
        },
        {"set_batch_adapters", "no adapter 'nope'", "default, b, c"});
    // Training on a batch that uses only "default" and "c": "b" gets no gradient.
    run.lora->set_batch_adapters(from_vector<int64_t>({0, -1, 0, 2, 2, -1}, {6}));
    Tensor loss = cross_entropy(run.logits(batch.ids), batch.targets);
    backward(loss);
    for (Parameter* p : run.lora->adapter_parameters("b"))
      EXPECT_FALSE(p->grad().defined()) << l.name << ": an unused adapter got a gradient";
    int with_grad = 0;
    for (Parameter* p : run.lora->adapter_parameters("default"))
      with_grad += p->grad().defined();
    EXPECT_GT(with_grad, 0) << l.name;
    // Delete and add after fully_shard: the slot is reused, the values are the new adapter's.
    run.lora->set_batch_adapters(Tensor());
    run.lora->delete_adapter("b");
    LoraConfig d = b;
    d.seed = 99;
    run.lora->add_adapter("d", d);
    EXPECT_EQ(run.lora->adapter_id("d"), 1);
    run.lora->set_adapter("d");
    const Tensor with_d = run.logits(batch.ids);
    EXPECT_EQ(run.lora->adapters(), (std::vector<std::string>{"default", "d", "c"}));
    auto ref = std::make_shared<Decoder>(cfg);
    LoraConfig only_d = d;
    auto ref_lora = apply_lora(ref, only_d, "d");
    expect_close(with_d, (*ref)(batch.ids), 1e-5, l.name + ": adapter d in a reused slot");
  }
}

// An adapter whose every value is NaN in a mixed batch: the other samples' logits are their
// adapter's alone, and the gradients of the adapter beside it are those of the same batch with
// the broken sample routed to the base model, finite (with 0/1 masks over every adapter's
// activations, 0 * NaN reached every sample). The table is adapted too: lookups of A and the
// vocabulary-parallel reduction with the base's partial rows.
TEST(Lora, AnAdapterOfNaNsReachesNoOtherSampleOfAMixedBatch) {
  const DecoderConfig cfg = lora_decoder_config();
  for (const LoraLayout& l : lora_layouts({.max_adapters = 2, .max_rank = 4})) {
    LoraConfig config = lora_test_config(LoraInit::Random);
    config.target_modules.push_back("tok_embeddings");
    LoraRun run = l.build(cfg, config);
    LoraConfig bad = config;
    bad.seed = 17;
    run.lora->add_adapter("bad", bad);
    {
      NoGradGuard no_grad;
      for (Parameter* p : run.lora->adapter_parameters("bad"))
        p->fill_(std::numeric_limits<double>::quiet_NaN());
    }
    const Batch batch = affine_batch(5, 4, cfg.max_seq_len, cfg.vocab_size);
    std::map<std::string, Tensor> alone;
    for (const std::string name : {"default", ""}) {
      NoGradGuard no_grad;
      run.lora->set_adapter(name);
      alone[name] = run.logits(batch.ids);
    }
    run.lora->set_adapter("");
    const int64_t bad_id = run.lora->adapter_id("bad");
    // The default adapter's gradients with sample 1 routed to `sample1`.
    auto grads = [&](int64_t sample1, Tensor* logits) {
      for (Parameter* p : run.lora->adapter_parameters("default"))
        p->zero_grad();
      run.lora->set_batch_adapters(from_vector<int64_t>({0, sample1, -1, 0}, {4}));
      *logits = run.logits(batch.ids);
      backward(cross_entropy(*logits, batch.targets));
      std::vector<Tensor> out;
      for (Parameter* p : run.lora->adapter_parameters("default"))
        out.push_back(full_grad(*p));
      run.lora->set_batch_adapters(Tensor());
      return out;
    };
    Tensor mixed, clean;
    const std::vector<Tensor> got = grads(bad_id, &mixed), want = grads(-1, &clean);
    const std::vector<std::string> route = {"default", "bad", "", "default"};
    for (int64_t row : {0, 2, 3})
      expect_close(kernels::narrow(mixed, 0, row, 1),
                   kernels::narrow(alone[route[size_t(row)]], 0, row, 1), 1e-5,
                   l.name + " row " + std::to_string(row) + " (" + route[size_t(row)] + ")");
    EXPECT_TRUE(std::isnan(kernels::narrow(mixed, 0, 1, 1).to_vector<double>()[0]))
        << l.name << ": the broken adapter's own sample";
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      expect_close(got[i], want[i], 1e-5, l.name + ": default's gradient " + std::to_string(i));
  }
}

// A mixed batch through checkpointed blocks: the recomputation routes each sample as the forward
// did, and the gradients are those without checkpointing, bit for bit.
TEST(Lora, MixedBatchUnderActivationCheckpointingGivesTheSameGradients) {
  if (world_size() > 1) GTEST_SKIP() << "one process";
  const DecoderConfig cfg = lora_decoder_config();
  const Batch batch = affine_batch(4, 4, cfg.max_seq_len, cfg.vocab_size);
  std::map<std::string, Tensor> grads[2];
  for (int ckpt = 0; ckpt < 2; ++ckpt) {
    auto m = std::make_shared<Decoder>(cfg);
    LoraConfig config = lora_test_config(LoraInit::Random);
    config.lora_dropout = 0.2;
    auto lora = apply_lora(m, config, "default", {.max_adapters = 2});
    LoraConfig second = config;
    second.seed = 8;
    lora->add_adapter("second", second);
    if (ckpt)
      for (auto& layer : m->layers)
        checkpoint(layer);
    lora->set_batch_adapters({"second", "default", "__base__", "second"});
    backward(cross_entropy((*m)(batch.ids), batch.targets));
    for (auto& [name, p] : m->named_parameters())
      if (p->grad().defined()) grads[ckpt][name] = p->grad().clone();
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  EXPECT_GT(grads[0].size(), 0u);
  for (const auto& [name, g] : grads[0]) {
    ASSERT_EQ(grads[1].count(name), 1u) << name;
    EXPECT_EQ(max_abs_diff(g, grads[1].at(name)), 0.0) << name;
  }
}

// The masks of a mixed batch are made once per batch and set of adapters, not once per layer:
// layers holding the same adapters share them (on a device each copy would be a transfer).
// Rank 4, random B (so that an adapter changes the output), on modules named "layer".
LoraConfig random_layer_config() {
  LoraConfig config;
  config.r = 4;
  config.init_lora_weights = LoraInit::Random;
  config.target_modules = {"layer"};
  return config;
}

TEST(Lora, MixedBatchMasksAreSharedByLayersWithTheSameAdapters) {
  auto routing = std::make_shared<LoraRouting>();
  Generator gen(5);
  const LoraConfig config = random_layer_config();
  std::vector<std::shared_ptr<LoraLinear>> layers;
  for (int i = 0; i < 3; ++i) {
    layers.push_back(std::make_shared<LoraLinear>(
        Linear(8, 8, false, gen), LoraSlots{.max_adapters = 2, .max_rank = 4}, routing));
    layers.back()->init_slot(0, "a", config, "layer" + std::to_string(i));
    // The third layer lacks adapter "b": its samples of "b" use the base layer there.
    if (i < 2) layers.back()->init_slot(1, "b", config, "layer" + std::to_string(i));
  }
  routing->sample_slots = std::vector<int64_t>{1, 0, -1, 1};
  Tensor x = randn({4, 8}, gen);
  std::vector<Tensor> ys;
  for (auto& l : layers)
    ys.push_back(l->forward(x));
  EXPECT_EQ(routing->masks.size(), 2u);
  // Each layer's rows are its adapters' (or the base layer's): a layer without masks of its own
  // still routes right.
  for (size_t i = 0; i < layers.size(); ++i) {
    std::vector<Tensor> rows;
    for (int64_t r = 0; r < 4; ++r) {
      const int64_t s = (*routing->sample_slots)[size_t(r)];
      const bool has = s == 0 || (s == 1 && i < 2);
      Tensor xr = kernels::narrow(x, 0, r, 1);
      Tensor base = linear(xr, layers[i]->weight.local());
      Tensor want = has ? add(base, mul(linear(linear(xr, layers[i]->lora_A(s).local()),
                                               layers[i]->lora_B(s).local()),
                                        layers[i]->slot(s).scale))
                        : base;
      expect_close(kernels::narrow(ys[i], 0, r, 1), want, 1e-6,
                   "layer " + std::to_string(i) + " row " + std::to_string(r));
    }
  }
}

// A 1-D input is one sample, as in a plain Linear, whose output for it is [out]: under a mixed
// batch too (its mask of the adapter activations, and dropout's per-sample rates, were shaped
// [1, ...] and broadcast the output to [1, out]). Plain, column and row parallel; eval and
// training with dropout.
TEST(Lora, MixedBatchOfOneDimensionalInputHasTheLinearsShape) {
  std::vector<std::pair<std::string, ParallelStylePtr>> styles = {{"plain", nullptr}};
  if (world_size() > 1) {
    styles.emplace_back("column parallel", std::make_shared<ColwiseParallel>());
    auto row = std::make_shared<RowwiseParallel>();
    row->input_layouts = {Replicate()};
    styles.emplace_back("row parallel", row);
  }
  LoraConfig config = random_layer_config();
  config.lora_dropout = 0.25;
  for (const auto& [name, style] : styles) {
    auto routing = std::make_shared<LoraRouting>();
    Generator gen(5);
    auto layer = std::make_shared<LoraLinear>(Linear(8, 6, true, gen),
                                              LoraSlots{.max_adapters = 2, .max_rank = 4}, routing);
    layer->init_slot(0, "a", config, "layer");
    layer->init_slot(1, "b", config, "layer");
    if (style) parallelize_module(layer, DeviceMesh(Shape{world_size()}, {"tp"}), {{"", style}});
    Generator draw(21);  // the same input on every rank
    const Tensor x = randn({8}, draw);
    for (const bool training : {false, true}) {
      layer->train(training);
      const std::string what = name + (training ? ", training" : ", eval");
      routing->masks.clear();
      routing->sample_slots = std::vector<int64_t>{1};
      const Tensor y = (*layer)(x);
      const Tensor rows = (*layer)(kernels::reshape(x, {1, 8}));
      ASSERT_EQ(y.dim(), 1) << what << ": " << y.str();
      EXPECT_EQ(y.size(0), rows.size(1)) << what;
      if (!training) expect_close(y, kernels::reshape(rows, {rows.size(1)}), 1e-6, what);
      // The same sample, its adapter active for the whole batch.
      routing->sample_slots.reset();
      routing->active_slot = 1;
      if (!training) expect_close(y, (*layer)(x), 1e-6, what + ": as the active adapter");
      routing->active_slot = -1;
    }
  }
}

// merge folds scale B A into each rank's own window of W (W is never gathered): the merged model
// gives the unmerged output within 1e-5, and unmerge restores W within 1e-6.
TEST(Lora, MergeAndUnmerge) {
  const DecoderConfig cfg = lora_decoder_config();
  const Batch batch = affine_batch(1, 4, cfg.max_seq_len, cfg.vocab_size);
  for (const LoraLayout& l : lora_layouts()) {
    LoraRun run = l.build(cfg, lora_test_config(LoraInit::Random));
    const Tensor before = run.logits(batch.ids);
    std::map<std::string, Tensor> base;
    for (auto& [name, p] : run.model->named_parameters())
      if (name.find("lora_") == std::string::npos) base[name] = p->full().clone();
    run.lora->merge_adapter("default");
    const Tensor merged = run.logits(batch.ids);
    expect_close(merged, before, 1e-5, l.name + ": merged output");
    double changed = 0;
    for (auto& [name, p] : run.model->named_parameters())
      if (base.count(name)) changed = std::max(changed, max_abs_diff(p->full(), base.at(name)));
    EXPECT_GT(changed, 1e-3) << l.name << ": merging changed no weight";
    expect_error([&] { run.lora->merge_adapter("default"); }, {"already merged"});
    run.lora->unmerge_adapter("default");
    double restored = 0;
    for (auto& [name, p] : run.model->named_parameters())
      if (base.count(name)) restored = std::max(restored, max_abs_diff(p->full(), base.at(name)));
    EXPECT_LE(restored, 1e-6) << l.name << ": unmerge";
    expect_close(run.logits(batch.ids), before, 1e-5, l.name + ": unmerged output");
  }
}

// A merged adapter reaches neither the base model nor another adapter's samples: set_adapter
// unmerges it first; merging an adapter that is not the active one, or during a mixed batch, is
// refused, and so are a mixed batch and writing its values while it is merged, each refusal
// leaving the model as it was; deleting it unmerges it first.
TEST(Lora, MergedAdapterReachesNoOtherAdapterNorTheBase) {
  const DecoderConfig cfg = lora_decoder_config();
  const Batch batch = affine_batch(2, 4, cfg.max_seq_len, cfg.vocab_size);
  for (const LoraLayout& l : lora_layouts({.max_adapters = 2, .max_rank = 4})) {
    LoraRun run = l.build(cfg, lora_test_config(LoraInit::Random));
    LoraConfig b = lora_test_config(LoraInit::Random);
    b.seed = 21;
    run.lora->add_adapter("b", b);
    std::map<std::string, Tensor> want;
    for (const std::string name : {"", "b", "default"}) {
      run.lora->set_adapter(name);
      want[name] = run.logits(batch.ids);
    }
    const auto base = base_weights(*run.model);
    auto expect_output = [&](const std::string& of, const std::string& what) {
      expect_close(run.logits(batch.ids), want.at(of), 1e-5, l.name + ": " + what);
    };
    run.lora->merge_adapter("default");
    expect_output("default", "merged");
    run.lora->set_adapter("");
    expect_output("", "the base model after merging default");
    EXPECT_LE(largest_change(*run.model, base), 1e-6) << l.name << ": set_adapter(\"\") unmerges";
    run.lora->set_adapter("default");
    run.lora->merge_adapter("default");
    run.lora->set_adapter("b");
    expect_output("b", "adapter b after merging default");
    expect_error([&] { run.lora->merge_adapter("default"); },
                 {"merge_adapter 'default'", "not the active adapter ('b')",
                  "set_adapter(\"default\") first"});
    expect_output("b", "adapter b after the refused merge");
    EXPECT_LE(largest_change(*run.model, base), 1e-6) << l.name << ": the refused merge";
    const Tensor ids = from_vector<int64_t>({run.lora->adapter_id("b"), -1, 0, -1}, {4});
    run.lora->set_adapter("default");
    run.lora->set_batch_adapters(ids);
    expect_error([&] { run.lora->merge_adapter("default"); },
                 {"merge_adapter 'default'", "mixed batch", "set_batch_adapters(Tensor())"});
    run.lora->set_batch_adapters(Tensor());
    run.lora->merge_adapter("default");
    const auto merged = base_weights(*run.model);
    expect_error([&] { run.lora->set_batch_adapters(ids); },
                 {"set_batch_adapters", "'default' is merged", "unmerge"});
    expect_error([&] { run.lora->write_adapter("default", run.lora->read_adapter("default")); },
                 {"write_adapter 'default'", "merged", "unmerge_adapter(\"default\") first"});
    expect_output("default", "merged, after the refused mixed batch and write");
    EXPECT_EQ(largest_change(*run.model, merged), 0.0) << l.name << ": a refusal changed weights";
    run.lora->delete_adapter("default");
    EXPECT_LE(largest_change(*run.model, base), 1e-6) << l.name << ": delete_adapter unmerges";
    EXPECT_EQ(run.lora->active_adapter(), "b");
    expect_output("b", "the remaining adapter after deleting the merged one");
  }
}

// As PEFT's delete_adapter: deleting the active adapter makes the first remaining adapter by
// name active (not by slot: "a" sits after "b"), with a warning naming it; deleting the last
// leaves none active. Deleting one that is not active changes nothing else.
TEST(Lora, DeletingTheActiveAdapterActivatesTheFirstRemainingByName) {
  const DecoderConfig cfg = lora_decoder_config();
  const Batch batch = affine_batch(2, 4, cfg.max_seq_len, cfg.vocab_size);
  for (const LoraLayout& l : lora_layouts({.max_adapters = 3, .max_rank = 4})) {
    LoraRun run = l.build(cfg, lora_test_config(LoraInit::Random));
    LoraConfig other = lora_test_config(LoraInit::Random);
    other.seed = 21;
    run.lora->add_adapter("b", other);
    other.seed = 22;
    run.lora->add_adapter("a", other);
    ASSERT_EQ(run.lora->adapters(), (std::vector<std::string>{"default", "b", "a"}));
    std::map<std::string, Tensor> want;
    for (const std::string name : {"", "a", "b"}) {
      run.lora->set_adapter(name);
      want[name] = run.logits(batch.ids);
    }
    run.lora->set_adapter("default");
    ::testing::internal::CaptureStderr();
    run.lora->delete_adapter("default");
    const std::string warned = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(run.lora->active_adapter(), "a") << l.name;
    EXPECT_NE(warned.find("adapter 'default' was active and is now deleted; the active adapter "
                          "is now 'a'"),
              std::string::npos)
        << l.name << ": " << warned;
    expect_close(run.logits(batch.ids), want.at("a"), 1e-5, l.name + ": a after default");
    run.lora->delete_adapter("b");  // not active
    EXPECT_EQ(run.lora->active_adapter(), "a") << l.name;
    ::testing::internal::CaptureStderr();
    run.lora->delete_adapter("a");
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "") << l.name;
    EXPECT_EQ(run.lora->active_adapter(), "") << l.name;
    expect_close(run.logits(batch.ids), want.at(""), 1e-5, l.name + ": none left");
  }
}

// The layer itself refuses to run while an adapter other than the active one is merged into its
// weight (it would apply to every sample), naming it, for a whole batch and a mixed one: the
// last guard for code that drives LoraLinear directly.
TEST(Lora, LayerRefusesAMergedAdapterThatIsNotActive) {
  auto routing = std::make_shared<LoraRouting>();
  Generator gen(5);
  const LoraConfig config = random_layer_config();
  auto layer = std::make_shared<LoraLinear>(Linear(8, 8, false, gen),
                                            LoraSlots{.max_adapters = 2, .max_rank = 4}, routing);
  layer->init_slot(0, "a", config, "layer");
  layer->init_slot(1, "b", config, "layer");
  const Tensor x = randn({2, 8}, gen);
  routing->active_slot = 0;
  const Tensor with_a = layer->forward(x);
  layer->merge_slot(0, /*unmerge=*/false);
  expect_close(layer->forward(x), with_a, 1e-6, "the merged adapter, active");
  for (int64_t active : {int64_t(1), int64_t(-1)}) {
    routing->active_slot = active;
    expect_error([&] { layer->forward(x); }, {"adapter 'a' is merged", "not the active"});
  }
  routing->active_slot = 0;
  routing->sample_slots = std::vector<int64_t>{1, -1};
  expect_error([&] { layer->forward(x); }, {"adapter 'a' is merged", "mixed batch"});
}

// PEFT's files: written from one layout, loaded into every other (a second adapter slot), with
// PEFT's keys and config; a file for other shapes is an error naming the key.
TEST(Lora, PeftFilesLoadOntoAnyMesh) {
  const std::string dir = scratch_dir("lora_peft");
  const DecoderConfig cfg = lora_decoder_config();
  const auto layouts = lora_layouts({.max_adapters = 2, .max_rank = 4});
  LoraRun src = layouts.back().build(cfg, lora_test_config(LoraInit::Random));
  src.lora->save_adapter(dir + "/adapter", "default");
  const auto saved = src.lora->read_adapter("default");
  if (world_rank() == 0) {
    const SafetensorsFile f = load_safetensors(dir + "/adapter/adapter_model.safetensors");
    EXPECT_EQ(f.tensors.size(), saved.size());
    EXPECT_EQ(f.tensors.at("base_model.model.layers.0.attention.wq.lora_A.weight").shape(),
              (Shape{4, 32}));
    EXPECT_EQ(f.tensors.at("base_model.model.layers.1.feed_forward.w1.lora_B.weight").shape(),
              (Shape{64, 4}));
    std::ifstream j(dir + "/adapter/adapter_config.json");
    const std::string text((std::istreambuf_iterator<char>(j)), std::istreambuf_iterator<char>());
    for (const char* field : {"\"peft_type\": \"LORA\"", "\"r\": 4", "\"lora_alpha\": 8.0",
                              "\"target_modules\"", "\"bias\": \"none\""})
      EXPECT_NE(text.find(field), std::string::npos) << field << " in " << text;
  }
  world_group()->barrier()->wait();
  for (const LoraLayout& l : layouts) {
    LoraConfig other = lora_test_config();
    other.seed = 5;
    LoraRun run = l.build(cfg, other);
    run.lora->load_adapter(dir + "/adapter", "loaded");
    const auto got = run.lora->read_adapter("loaded");
    for (const auto& [k, t] : saved)
      expect_identical(got.at(k), t, l.name + " loaded " + k);
    run.lora->set_adapter("loaded");
    run.lora->delete_adapter("loaded");
  }
  // An adapter saved from a wider model.
  DecoderConfig wide = cfg;
  wide.dim = 48;
  wide.n_heads = 4;
  LoraRun w = layouts.front().build(wide, lora_test_config(LoraInit::Random));
  w.lora->save_adapter(dir + "/wide", "default");
  LoraRun run = layouts.front().build(cfg, lora_test_config());
  expect_error([&] { run.lora->load_adapter(dir + "/wide", "wide"); },
               {"write_adapter 'wide'",
                "layers.0.attention.wq.lora_A.weight (expected the global "
                "shape [4, 32], got [4, 48])"});
  EXPECT_EQ(run.lora->adapters(), (std::vector<std::string>{"default"})) << "the failed load left "
                                                                            "an adapter behind";
  // Files the last rank cannot read (node-local storage): every rank throws, nobody waits.
  const int last = world_size() - 1;
  const std::string where = world_rank() == last ? dir + "/elsewhere" : dir + "/adapter";
  expect_error([&] { run.lora->load_adapter(where, "partly"); },
               {"LoRA load_adapter 'partly'", "[rank " + std::to_string(last) + "] cannot read '" +
                                                  dir + "/elsewhere/adapter_config.json'"});
  // Files that differ between ranks (another run's adapter, same shapes, on the last rank):
  // refused on every rank, naming it, rather than mixing windows of both.
  if (world_size() > 1) {
    LoraConfig other_values = lora_test_config(LoraInit::Random);
    other_values.seed = 11;
    LoraRun o = layouts.front().build(cfg, other_values);
    o.lora->save_adapter(dir + "/other", "default");
    const std::string mine = world_rank() == last ? dir + "/other" : dir + "/adapter";
    expect_error([&] { run.lora->load_adapter(mine, "mixed"); },
                 {"LoRA load_adapter 'mixed'",
                  "rank(s) " + std::to_string(last) + " read files that differ from rank 0's"});
    EXPECT_EQ(run.lora->adapters(), (std::vector<std::string>{"default"}));
  }
  // A config that is not PEFT's.
  if (world_rank() == 0) {
    std::filesystem::create_directories(dir + "/notpeft");
    std::filesystem::copy_file(dir + "/adapter/adapter_model.safetensors",
                               dir + "/notpeft/adapter_model.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    std::ofstream(dir + "/notpeft/adapter_config.json") << R"({"peft_type": "IA3", "r": 4})";
  }
  world_group()->barrier()->wait();
  expect_error([&] { run.lora->load_adapter(dir + "/notpeft", "ia3"); },
               {"notpeft/adapter_config.json'", "peft_type is not \"LORA\""});
  EXPECT_EQ(run.lora->adapters(), (std::vector<std::string>{"default"}));
}

// PEFT's per-module alphas load onto the model's layout with the module's own scale; a
// per-module rank the file's matrices do not have is refused, naming the key and both shapes.
TEST(Lora, PeftPerModuleRanksAndAlphasLoad) {
  const std::string dir = scratch_dir("lora_peft_patterns");
  const DecoderConfig cfg = lora_decoder_config();
  LoraRun run = lora_layouts({.max_adapters = 2, .max_rank = 4})
                    .front()
                    .build(cfg, lora_test_config(LoraInit::Random));
  run.lora->save_adapter(dir + "/adapter", "default");
  const std::string alpha =
      peft_config_variant(dir, "alpha", "\"alpha_pattern\": {}", "\"alpha_pattern\": {\"wq\": 32}");
  run.lora->load_adapter(alpha, "alpha");
  for (const auto& [path, layer] : run.lora->layers())
    EXPECT_DOUBLE_EQ(layer->slot(1).scale, path.ends_with(".wq") ? 32.0 / 4 : 8.0 / 4) << path;
  const Batch b = affine_batch(0, 2, 8, cfg.vocab_size);
  run.lora->set_adapter("alpha");
  const Tensor loaded = run.logits(b.ids);
  run.lora->delete_adapter("alpha");
  // The same scale from a config: the same logits.
  LoraConfig c = lora_test_config(LoraInit::Random);
  c.alpha_pattern = {{"wq", 32}};
  run.lora->add_adapter("alpha", c);
  run.lora->write_adapter("alpha", run.lora->read_adapter("default"));
  run.lora->set_adapter("alpha");
  expect_close(run.logits(b.ids), loaded, 1e-6, "logits of the loaded alpha_pattern");
  run.lora->set_adapter("default");
  run.lora->delete_adapter("alpha");
  const std::string rank =
      peft_config_variant(dir, "rank", "\"rank_pattern\": {}", "\"rank_pattern\": {\"wq\": 2}");
  expect_error([&] { run.lora->load_adapter(rank, "rank"); },
               {"layers.0.attention.wq.lora_A.weight", "[2, 32]", "[4, 32]"});
  EXPECT_EQ(run.lora->adapters(), (std::vector<std::string>{"default"}));
}
