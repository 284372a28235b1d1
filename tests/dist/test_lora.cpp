// LoRA under every parallelism: initial values that do not depend on the mesh, forwards equal to
// the plain model, the collectives of the layer without adapters and no more, read/write of
// global tensors, and bad use. Several adapters in one model (mixed batches, merge/unmerge, PEFT
// files onto any mesh) are in test_lora_adapters.cpp, of the same binary.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "dist/checkpoint_models.h"
#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

TEST(Lora, InitialValuesDoNotDependOnTheMesh) {
  // Random and orthogonal init: B is drawn too, so both matrices carry values to compare.
  for (const LoraInit init : {LoraInit::Random, LoraInit::Orthogonal}) {
    const LoraConfig cfg = lora_test_config(init);
    auto plain = std::make_shared<Decoder>(lora_decoder_config());
    auto ref = apply_lora(plain, cfg)->read_adapter("default");
    ASSERT_EQ(ref.size(), 2u * 2u * 7u);  // 2 layers x 7 projections x (A, B)
    for (const LoraLayout& l : lora_layouts()) {
      LoraRun run = l.build(lora_decoder_config(), cfg);
      const auto got = run.lora->read_adapter("default");
      ASSERT_EQ(got.size(), ref.size()) << l.name;
      for (const auto& [key, t] : ref)
        expect_identical(got.at(key), t, l.name + " " + key);
    }
  }
}

TEST(Lora, ForwardEqualsThePlainModelUnderEveryLayout) {
  const LoraConfig cfg = lora_test_config(LoraInit::Random);
  auto plain = std::make_shared<Decoder>(lora_decoder_config());
  apply_lora(plain, cfg);
  const Batch b = affine_batch(0, 4, 8, lora_decoder_config().vocab_size);
  const Tensor want = (*plain)(b.ids);
  for (const LoraLayout& l : lora_layouts()) {
    LoraRun run = l.build(lora_decoder_config(), cfg);
    const Tensor got = run.logits(b.ids);
    expect_close(got, want, 1e-5, l.name + " logits");
  }
}

namespace {

const LoraTrained& reference() {
  static const LoraTrained r = [] {
    LoraRun run{"plain", std::make_shared<Decoder>(lora_decoder_config()), nullptr, 0, 1};
    run.lora = apply_lora(run.model, lora_test_config());
    return lora_train(run, 20);
  }();
  return r;
}

}  // namespace

// LoRA fine-tuning of the decoder, 20 steps, under every layout: the losses and adapters of the
// single-rank run within 1e-6 relative, the frozen base untouched, every replicated adapter
// matrix bitwise identical on the ranks that hold it.
TEST(Lora, FineTuningMatchesSingleRank) {
  const LoraTrained& ref = reference();
  const auto initial = std::make_shared<Decoder>(lora_decoder_config())->state_dict();
  for (const LoraLayout& l : lora_layouts()) {
    LoraRun run = l.build(lora_decoder_config(), lora_test_config());
    expect_lora_parity(run, lora_train(run, 20), ref, initial, l.name);
  }
  // The reference itself moved: a run that trained nothing could not pass.
  EXPECT_LT(ref.losses.back(), ref.losses.front() * 0.9);
}

// A LoRA layer issues as many collectives per forward and per backward as the same layer
// without adapters (trainable, as in ordinary training): column parallel, row parallel, and row
// parallel into sequence-sharded activations; with dropout in training too (the mask's draw
// needs no agreement: the slot's stream is the same on every rank by construction); and in a
// mixed batch of two adapters, whose routed products keep the layer's one collective.
TEST(Lora, AdaptersAddNoCollectives) {
  if (world_size() == 1) GTEST_SKIP() << "no collectives on one rank";
  const int64_t n = world_size();
  DeviceMesh mesh(Shape{n}, {"tp"});
  struct Case {
    std::string name;
    ParallelStylePtr style;
    Shape input;  // this rank's piece
  };
  RowwiseParallel sp_row;
  sp_row.output_layouts = {Shard(1)};
  const std::vector<Case> cases = {
      {"colwise", std::make_shared<ColwiseParallel>(), {2, 8, 16}},
      {"rowwise", std::make_shared<RowwiseParallel>(), {2, 8, 16 / n}},
      {"rowwise into sequence shards", std::make_shared<RowwiseParallel>(sp_row), {2, 8, 16 / n}}};
  for (const Case& c : cases)
    for (double dropout : {0.0, 0.1})
      for (bool lora_first : {false, true})
        for (bool mixed : {false, true}) {
          Generator gen(1);
          auto plain = std::make_shared<OneLayer>(std::make_shared<Linear>(16, 24, false, gen));
          parallelize_module(plain, mesh, {{"proj", c.style}});
          Generator gen2(1);
          auto with = std::make_shared<OneLayer>(std::make_shared<Linear>(16, 24, false, gen2));
          LoraConfig cfg = lora_test_config(LoraInit::Random);
          cfg.target_modules = {"proj"};
          cfg.lora_dropout = dropout;
          const LoraSlots slots{.max_adapters = 2};
          std::shared_ptr<LoraModel> lora_model;
          if (lora_first) lora_model = apply_lora(with, cfg, "default", slots);
          parallelize_module(with, mesh, {{"proj", c.style}});
          if (!lora_first) lora_model = apply_lora(with, cfg, "default", slots);
          if (mixed) {
            LoraConfig second = cfg;
            second.seed = 9;
            lora_model->add_adapter("second", second);
            lora_model->set_batch_adapters(from_vector<int64_t>({1, 0}));
          }
          Generator gx(5);
          const Tensor x = rand(c.input, gx);
          const auto base = count_collectives(*plain, x);
          const auto lora = count_collectives(*with, x);
          const std::string what = c.name + (lora_first ? " (LoRA first)" : "") +
                                   (dropout > 0 ? " with dropout" : "") +
                                   (mixed ? ", mixed batch" : "");
          EXPECT_EQ(counts_total(lora.first), counts_total(base.first))
              << what << ", forward: with adapters " << counts_str(lora.first) << "; without "
              << counts_str(base.first);
          EXPECT_EQ(counts_total(lora.second), counts_total(base.second))
              << what << ", backward: with adapters " << counts_str(lora.second) << "; without "
              << counts_str(base.second);
          if (world_rank() == 0 && !lora_first && dropout == 0 && !mixed)
            std::printf(
                "[lora collectives] tp%lld %s: without adapters forward {%s} backward {%s}; "
                "with {%s} {%s}\n",
                (long long)n, what.c_str(), counts_str(base.first).c_str(),
                counts_str(base.second).c_str(), counts_str(lora.first).c_str(),
                counts_str(lora.second).c_str());
        }
}

// DoRA adds what docs/lora.md says and no more: a row-parallel layer one all-reduce of its rows'
// sums of squares per forward, a column-parallel one nothing; the backward adds nothing (m's
// gradient is local where m is sharded, and whole where it is replicated). Without dropout.
TEST(Lora, DoraAddsOneAllReducePerRowParallelForward) {
  if (world_size() == 1) GTEST_SKIP() << "no collectives on one rank";
  const int64_t n = world_size();
  DeviceMesh mesh(Shape{n}, {"tp"});
  RowwiseParallel sp_row;
  sp_row.output_layouts = {Shard(1)};
  const std::vector<std::tuple<std::string, ParallelStylePtr, Shape, int64_t>> cases = {
      {"colwise", std::make_shared<ColwiseParallel>(), {2, 8, 16}, 0},
      {"rowwise", std::make_shared<RowwiseParallel>(), {2, 8, 16 / n}, 1},
      {"rowwise into sequence shards",
       std::make_shared<RowwiseParallel>(sp_row),
       {2, 8, 16 / n},
       1}};
  for (const auto& [name, style, input, extra] : cases) {
    auto layer = [&](bool dora) {
      Generator gen(1);
      auto m = std::make_shared<OneLayer>(std::make_shared<Linear>(16, 24, false, gen));
      LoraConfig cfg = lora_test_config(LoraInit::Random);
      cfg.target_modules = {"proj"};
      cfg.lora_dropout = 0.0;
      cfg.use_dora = dora;
      parallelize_module(m, mesh, {{"proj", style}});
      apply_lora(m, cfg);
      return m;
    };
    Generator gx(5);
    const Tensor x = rand(input, gx);
    auto lora = layer(false);
    auto dora = layer(true);
    const auto base = count_collectives(*lora, x);
    const auto got = count_collectives(*dora, x);
    EXPECT_EQ(counts_total(got.first), counts_total(base.first) + extra)
        << name << ", forward: DoRA " << counts_str(got.first) << "; LoRA "
        << counts_str(base.first);
    EXPECT_EQ(counts_total(got.second), counts_total(base.second))
        << name << ", backward: DoRA " << counts_str(got.second) << "; LoRA "
        << counts_str(base.second);
  }
}

// With dropout in training, DoRA feeds dropout(x) to both extra terms: the layer computes
// (x - dropout(x)) W^T too, as one product with its other one (the two batches stacked), so that
// it makes the collectives it makes without dropout: no more reductions in a row-parallel
// forward, no more all-reduces in a column-parallel backward. Drawing the dropout mask adds
// nothing (the slot's stream needs no cross-rank check). As lora_linear.h and docs/lora.md say.
TEST(Lora, DoraWithDropoutMakesTheCollectivesOfDoraWithout) {
  const int64_t n = world_size();
  DeviceMesh mesh(Shape{n}, {"tp"});
  RowwiseParallel sp_row;
  sp_row.output_layouts = {Shard(1)};
  struct Case {
    std::string name;
    ParallelStylePtr style;
    Shape input;       // this rank's piece
    int64_t forward;   // the collectives dropout adds, over more than one rank
    int64_t backward;  // likewise
  };
  const std::vector<Case> cases = {
      {"colwise", std::make_shared<ColwiseParallel>(), {2, 8, 16}, 0, 0},
      {"rowwise", std::make_shared<RowwiseParallel>(), {2, 8, 16 / n}, 0, 0},
      {"rowwise into sequence shards",
       std::make_shared<RowwiseParallel>(sp_row),
       {2, 8, 16 / n},
       0,
       0}};
  for (const Case& c : cases) {
    auto layer = [&](double dropout) {
      Generator gen(1);
      auto m = std::make_shared<OneLayer>(std::make_shared<Linear>(16, 24, false, gen));
      LoraConfig cfg = lora_test_config(LoraInit::Random);
      cfg.use_dora = true;
      cfg.target_modules = {"proj"};
      cfg.lora_dropout = dropout;
      parallelize_module(m, mesh, {{"proj", c.style}});
      apply_lora(m, cfg);
      return m;
    };
    Generator gx(5);
    const Tensor x = rand(c.input, gx);
    auto plain = layer(0.0);
    auto dropped = layer(0.3);
    ASSERT_TRUE(dropped->is_training());
    const auto without = count_collectives(*plain, x);
    const auto with = count_collectives(*dropped, x);
    const std::string what = c.name + " at " + std::to_string(n) + " ranks";
    EXPECT_EQ(counts_total(with.first), counts_total(without.first) + (n > 1 ? c.forward : 0))
        << what << ", forward: with dropout " << counts_str(with.first) << "; without "
        << counts_str(without.first);
    EXPECT_EQ(counts_total(with.second), counts_total(without.second) + (n > 1 ? c.backward : 0))
        << what << ", backward: with dropout " << counts_str(with.second) << "; without "
        << counts_str(without.second);
  }
}

// Each rank cuts its adapters' windows from its own copy, so adapters holding other values on one
// rank are refused on every rank before any target changes, naming the adapter; the refusal used
// to come from the distribution of that layer's adapters, after earlier targets were sharded.
TEST(Lora, AdaptersDifferingAcrossRanksChangeNothing) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "one rank has no other rank to differ from";
  const DecoderConfig cfg = lora_decoder_config();
  auto m = std::make_shared<Decoder>(cfg);
  auto lora = apply_lora(m, lora_test_config(LoraInit::Random));
  for (const auto& [path, layer] : lora->layers())
    if (path == "layers.1.feed_forward.w2" && world_rank() == n - 1) layer->lora_A(0).fill_(0.25);
  const DeviceMesh mesh(Shape{n}, {"tp"});
  expect_error(
      [&] { parallelize_module(m, mesh, decoder_tp_plan(cfg, mesh)); },
      {"parallelize_module(Decoder)", "[rank " + std::to_string(n - 1) + "]", "differs from rank 0",
       "'layers.1.feed_forward.w2.lora_A.0.weight' float32 [4, 64]"});
  for (Parameter* p : m->parameters())
    EXPECT_FALSE(p->is_dtensor()) << p->str();
  for (const auto& [path, layer] : lora->layers())
    EXPECT_FALSE(layer->module().dtensor_io().has_value()) << path;
}

// A model put in eval mode before apply_lora stays so in the layers LoRA wraps: dropout does not
// run at inference (two forwards agree bit for bit), and does again in train mode.
TEST(Lora, WrappedLayersKeepTheModelsEvalMode) {
  const DecoderConfig cfg = lora_decoder_config();
  const Batch batch = affine_batch(0, 2, cfg.max_seq_len, cfg.vocab_size);
  LoraConfig lc = lora_test_config(LoraInit::Random);  // B nonzero: dropout shows in the output
  lc.lora_dropout = 0.1;
  auto model = std::make_shared<Decoder>(cfg);
  model->eval();
  auto lora = apply_lora(model, lc);
  std::vector<std::string> training;
  for (const auto& [path, layer] : lora->layers())
    if (layer->module().is_training()) training.push_back(path);
  EXPECT_EQ(training.size(), 0u) << "wrapped layers in train mode after model->eval()";
  const Tensor first = (*model)(batch.ids);
  expect_identical((*model)(batch.ids), first, "a second forward in eval mode");
  model->train();
  const Tensor a = (*model)(batch.ids), b = (*model)(batch.ids);
  EXPECT_GT(max_abs_diff(a, b), 1e-4) << "two forwards in train mode: dropout did not run";
}

// apply_lora keeps the forward hooks of the layers it wraps (a plan's PrepareModuleInput, the
// user's own), so LoRA after parallelize_module gives the model LoRA before it gives: each rank
// passes its rows, the pre-hook gathers the batch, the user's hook adds 1.
TEST(Lora, WrappedLayersKeepTheirHooks) {
  const int64_t n = world_size();
  DeviceMesh mesh(Shape{n}, {"tp"});
  PrepareModuleInput gather;
  gather.input_layouts = {Shard(0)};
  gather.desired_input_layouts = {Replicate()};
  LoraConfig cfg = lora_test_config(LoraInit::Random);
  cfg.target_modules = {"proj"};
  Generator gx(5);
  const Tensor x = rand({2 * n, 16}, gx);
  const Tensor mine = kernels::narrow(x, 0, 2 * world_rank(), 2).contiguous();
  Generator gen(1);
  auto ref = std::make_shared<OneLayer>(std::make_shared<Linear>(16, 24, false, gen));
  apply_lora(ref, cfg);
  const Tensor want = add((*ref)(x), 1.0);
  for (bool lora_first : {false, true}) {
    Generator g(1);
    auto m = std::make_shared<OneLayer>(std::make_shared<Linear>(16, 24, false, g));
    m->proj->register_forward_hook(
        [](Module&, const Tensor&, const Tensor& y) { return add(y, 1.0); });
    if (lora_first) apply_lora(m, cfg);
    parallelize_module(m, mesh, {{"proj", std::make_shared<PrepareModuleInput>(gather)}});
    if (!lora_first) apply_lora(m, cfg);
    expect_close((*m)(mine), want, 1e-6, lora_first ? "LoRA first" : "LoRA after the plan");
  }
}

// A row-parallel layer with a bfloat16 base keeps the adapter activations h = x A^T in float32
// through its reduction, as one process does: B's gradient (from h) and A's (through h) at TP =
// world size agree with one rank's to float32 rounding; bfloat16 would be off by about 2^-9.
TEST(Lora, RowParallelBfloat16BaseKeepsAdapterActivationsInFloat32) {
  if (world_size() == 1) GTEST_SKIP() << "row parallelism needs two ranks";
  const int64_t n = world_size();
  LoraConfig cfg = lora_test_config(LoraInit::Random);
  cfg.target_modules = {"proj"};
  Generator gx(5);
  const Tensor x = randn({4, 64}, gx).to(DType::BFloat16);
  const Tensor g = randn({4, 16}, gx);
  struct Result {
    Tensor y, grad_a, grad_b;
  };
  auto run = [&](bool parallel) {
    Generator gen(1);
    auto lin = std::make_shared<Linear>(64, 16, false, gen);
    lin->weight = Parameter(lin->weight.full().to(DType::BFloat16), false);
    auto m = std::make_shared<OneLayer>(lin);
    auto lora = apply_lora(m, cfg);
    Tensor in = x;
    if (parallel) {
      parallelize_module(m, DeviceMesh(Shape{n}, {"tp"}),
                         {{"proj", std::make_shared<RowwiseParallel>()}});
      in = kernels::narrow(x, 1, world_rank() * (64 / n), 64 / n).contiguous();
    }
    Result r;
    r.y = (*m)(in);
    backward(sum(mul(cast(r.y, DType::Float32), g)));
    auto& l = dynamic_cast<LoraLinear&>(*lora->layers().front().second);
    r.grad_a =
        l.lora_A(0).is_dtensor() ? l.lora_A(0).grad_dtensor().full_tensor() : l.lora_A(0).grad();
    r.grad_b =
        l.lora_B(0).is_dtensor() ? l.lora_B(0).grad_dtensor().full_tensor() : l.lora_B(0).grad();
    return r;
  };
  const Result one = run(false), tp = run(true);
  expect_close(tp.grad_b, one.grad_b, 1e-5, "B's gradient");
  expect_close(tp.grad_a, one.grad_a, 1e-5, "A's gradient");
  expect_close(cast(tp.y, DType::Float32), cast(one.y, DType::Float32), 1e-2, "output");
  if (world_rank() == 0)
    std::printf("[lora bf16 row] tp%lld: B's gradient within %.2e, A's within %.2e of one rank\n",
                (long long)n, max_abs_diff(tp.grad_b, one.grad_b),
                max_abs_diff(tp.grad_a, one.grad_a));
}

// read_adapter gives global tensors; write_adapter takes global tensors only (each rank copies
// its window) and refuses a local shard, naming the key and both shapes; read, write, read is the
// identity under every layout.
TEST(Lora, ReadWriteIsTheIdentityAndRefusesLocalShards) {
  for (const LoraLayout& l : lora_layouts()) {
    LoraRun run = l.build(lora_decoder_config(), lora_test_config(LoraInit::Random));
    const auto first = run.lora->read_adapter("default");
    EXPECT_EQ(first.at("layers.0.attention.wq.lora_A.weight").shape(), (Shape{4, 32}));
    EXPECT_EQ(first.at("layers.1.feed_forward.w2.lora_B.weight").shape(), (Shape{32, 4}));
    // Other values in, then the first ones back.
    auto other = first;
    for (auto& [k, t] : other)
      t = add(t, 1.0);
    run.lora->write_adapter("default", other);
    const auto mid = run.lora->read_adapter("default");
    for (const auto& [k, t] : other)
      expect_identical(mid.at(k), t, l.name + " written " + k);
    run.lora->write_adapter("default", first);
    const auto back = run.lora->read_adapter("default");
    for (const auto& [k, t] : first)
      expect_identical(back.at(k), t, l.name + " read, write, read " + k);
    if (world_size() == 1) continue;
    // A rank's own piece of a sharded adapter matrix where the global one belongs.
    auto bad = first;
    bool refused = false;
    for (auto& [path, layer] : run.lora->layers()) {
      Parameter& b = layer->lora_B(0);
      if (!b.is_dtensor() || b.stored().shape()[0] == b.global_shape()[0]) continue;
      const std::string key = path + ".lora_B.weight";
      bad[key] = kernels::narrow(b.stored(), 1, 0, 4).clone();
      expect_error([&] { run.lora->write_adapter("default", bad); },
                   {"write_adapter 'default'", key,
                    "expected the global shape [" + std::to_string(layer->lora_out()) + ", 4]",
                    "a local piece cannot stand for the global tensor"});
      refused = true;
      break;
    }
    EXPECT_TRUE(refused || l.name.rfind("fsdp", 0) != 0) << l.name;
    // A map that is wrong on one rank only is refused on every rank, naming that rank.
    auto short_map = first;
    const int last = world_size() - 1;
    if (world_rank() == last) short_map.erase(short_map.begin());
    expect_error([&] { run.lora->write_adapter("default", short_map); },
                 {"LoRA write_adapter 'default': [rank " + std::to_string(last) + "]",
                  "missing keys: " + first.begin()->first});
    const auto still = run.lora->read_adapter("default");
    for (const auto& [k, t] : first)
      expect_identical(still.at(k), t, l.name + " after the refused write " + k);
  }
}

TEST(Lora, BadUseIsAClearError) {
  const DecoderConfig cfg = lora_decoder_config();
  auto m = std::make_shared<Decoder>(cfg);
  LoraConfig bad = lora_test_config();
  bad.target_modules = {"wq", "w9"};
  expect_error([&] { apply_lora(m, bad); }, {"target module 'w9' matches no module of Decoder"});
  bad.target_modules = {"attention"};
  expect_error([&] { apply_lora(m, bad); }, {"'layers.0.attention', a Attention, not a Linear"});
  bad = lora_test_config();
  bad.r = 0;
  expect_error([&] { apply_lora(m, bad); }, {"LoraConfig: r must be positive, got 0"});
  bad = lora_test_config();
  bad.lora_alpha = std::numeric_limits<double>::infinity();  // the adapter table cannot hold it
  expect_error([&] { apply_lora(m, bad); }, {"lora_alpha must be positive and finite, got inf"});
  bad = lora_test_config();
  bad.bias = "lora";
  expect_error([&] { apply_lora(m, bad); }, {"bias 'lora' is not one of PEFT's"});
  auto lora = apply_lora(m, lora_test_config(), "default", {.max_adapters = 2, .max_rank = 4});
  expect_error([&] { apply_lora(m, lora_test_config()); }, {"already has LoRA slots"});
  expect_error([&] { lora->add_adapter("default", lora_test_config()); },
               {"adapter 'default' exists already"});
  expect_error([&] { lora->set_adapter("nope"); }, {"no adapter 'nope'", "the model has: default"});
  expect_error([&] { lora->delete_adapter("nope"); }, {"no adapter 'nope'"});
  LoraConfig big = lora_test_config();
  big.r = 16;
  expect_error(
      [&] { lora->add_adapter("big", big); },
      {"adapter 'big' has r 16 at 'layers.0.attention.wq'", "the slots hold at most rank 4"});
  lora->add_adapter("second", lora_test_config());
  expect_error([&] { lora->add_adapter("third", lora_test_config()); },
               {"all 2 adapter slots are in use"});
  expect_error(
      [&] {
        lora->set_batch_adapters(from_vector<int64_t>({0, 7}, {2}));
      },
      {"id 7 is no adapter's"});
  expect_error([&] { lora->write_adapter("default", {}); }, {"missing keys"});
  auto sharded = std::make_shared<Decoder>(cfg);
  fully_shard(sharded, DeviceMesh({world_size()}, {"dp"}));
  expect_error([&] { apply_lora(sharded, lora_test_config()); },
               {"'layers.0.attention.wq' is already sharded by fully_shard",
                "apply LoRA before fully_shard"});
  // The frozen base gets neither gradients nor optimizer state, even in the optimizer.
  AdamW opt(m->parameters(), AdamWOptions{.lr = 1e-2});
  const Batch b = affine_batch(0, 2, cfg.max_seq_len, cfg.vocab_size);
  backward(cross_entropy((*m)(b.ids), b.targets));
  opt.step();
  for (size_t i = 0; i < opt.params().size(); ++i) {
    if (opt.params()[i]->requires_grad()) continue;
    EXPECT_FALSE(opt.params()[i]->grad().defined());
    EXPECT_FALSE(opt.state_tensor(i, "exp_avg", false).defined()) << opt.params()[i]->str();
  }
}

// A bfloat16 frozen base next to float32 adapters, under FSDP: one group per dtype (each gathered
// in its own dtype), the base gets neither gradients nor optimizer state and never changes, and
// training follows the unsharded model.
TEST(Lora, Bfloat16BaseWithFloat32AdaptersUnderFsdp) {
  const DecoderConfig cfg = lora_decoder_config();
  auto build = [&](bool shard) {
    auto m = std::make_shared<Decoder>(cfg);
    for (auto& [name, p] : m->named_parameters())
      *p = Parameter(p->full().to(DType::BFloat16), false);
    auto lora = apply_lora(m, lora_test_config());
    if (shard) lora_shard(m, DeviceMesh(Shape{world_size()}, {"dp"}));
    return LoraRun{shard ? "fsdp bf16" : "plain bf16", m, lora, shard ? world_rank() : 0,
                   shard ? world_size() : 1};
  };
  LoraRun ref = build(false), run = build(true);
  for (auto& [name, p] : run.model->named_parameters())
    EXPECT_EQ(p->dtype(),
              name.find("lora_") == std::string::npos ? DType::BFloat16 : DType::Float32)
        << name;
  const auto base_before = ref.model->state_dict();
  AdamW ref_opt(ref.lora->parameters(), AdamWOptions{.lr = 3e-3, .eps = 1e-6});
  AdamW opt(run.model->parameters(), AdamWOptions{.lr = 3e-3, .eps = 1e-6});
  // The loss in float32 (the bfloat16 logits cast up), so that it shows more than bfloat16's
  // 8 bits.
  auto step = [&](LoraRun& r, Optimizer& o, int s) {
    Batch b = affine_batch(s, 8, cfg.max_seq_len, cfg.vocab_size);
    const int64_t rows = 8 / r.dp_size;
    Tensor ids = kernels::narrow(b.ids, 0, r.dp_rank * rows, rows).contiguous();
    Tensor targets = kernels::narrow(b.targets, 0, r.dp_rank * rows, rows).contiguous();
    o.zero_grad();
    Tensor loss = cross_entropy(cast((*r.model)(ids), DType::Float32), targets);
    backward(loss);
    o.step();
    Tensor l = from_vector<double>({double(loss.item<float>())});
    world_group()->all_reduce(l, ReduceOp::Sum)->wait();
    return l.item<double>() / double(world_size());
  };
  for (int s = 0; s < 5; ++s) {
    const double want = step(ref, ref_opt, s);
    const double got = step(run, opt, s);
    EXPECT_NEAR(got, want, 1e-4 * want) << "step " << s;
  }
  for (const auto& [name, t] : run.model->state_dict())
    if (name.find("lora_") == std::string::npos)
      expect_identical(t, base_before.at(name), "frozen bfloat16 " + name);
  for (size_t i = 0; i < opt.params().size(); ++i)
    if (!opt.params()[i]->requires_grad()) {
      EXPECT_FALSE(opt.state_tensor(i, "exp_avg", false).defined());
    }
}
