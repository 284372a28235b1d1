// LoRA under every parallelism: initial values that do not depend on the mesh, forwards equal to
// the plain model, the collectives of the layer without adapters and no more, read/write of
// global tensors, mixed-adapter batches, merge/unmerge, and bad use.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

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

struct Trained {
  std::vector<double> losses;
  std::map<std::string, Tensor> adapter;
  std::map<std::string, Tensor> base;
};

Trained train(LoraRun& run, int steps) {
  // eps 1e-6: where a gradient is as small as Adam's eps (the first layer's key adapters see
  // gradients near 1e-8), eps 1e-8 turns its last-bit differences between layouts into 2e-6
  // differences of the update, which says nothing about the sharding.
  AdamW opt(run.lora->parameters(), AdamWOptions{.lr = 3e-3, .eps = 1e-6, .weight_decay = 0.0});
  Trained t;
  for (int s = 0; s < steps; ++s)
    t.losses.push_back(lora_train_step(run, opt, s));
  t.adapter = run.lora->read_adapter("default");
  for (auto& [name, p] : run.model->named_parameters())
    if (name.find("lora_") == std::string::npos) t.base[name] = p->full();
  return t;
}

const Trained& reference() {
  static const Trained r = [] {
    LoraRun run{"plain", std::make_shared<Decoder>(lora_decoder_config()), nullptr, 0, 1};
    run.lora = apply_lora(run.model, lora_test_config());
    return train(run, 20);
  }();
  return r;
}

}  // namespace

// LoRA fine-tuning of the decoder, 20 steps, under every layout: the losses and adapters of the
// single-rank run within 1e-6 relative, the frozen base untouched, every replicated adapter
// matrix bitwise identical on the ranks that hold it.
TEST(Lora, FineTuningMatchesSingleRank) {
  const Trained& ref = reference();
  const auto initial = std::make_shared<Decoder>(lora_decoder_config())->state_dict();
  for (const LoraLayout& l : lora_layouts()) {
    LoraRun run = l.build(lora_decoder_config(), lora_test_config());
    const Trained got = train(run, 20);
    double worst_loss = 0, worst_param = 0;
    for (size_t s = 0; s < ref.losses.size(); ++s) {
      EXPECT_NEAR(got.losses[s], ref.losses[s], 1e-6 * std::abs(ref.losses[s]))
          << l.name << " step " << s;
      worst_loss = std::max(worst_loss, std::abs(got.losses[s] - ref.losses[s]) / ref.losses[s]);
    }
    // Each adapter matrix within 1e-6 of the reference, relative to its norm.
    for (const auto& [key, t] : ref.adapter) {
      const auto a = got.adapter.at(key).to_vector<double>(), b = t.to_vector<double>();
      double diff = 0, norm = 0, worst_elem = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        diff += (a[i] - b[i]) * (a[i] - b[i]);
        norm += b[i] * b[i];
        worst_elem = std::max(worst_elem, std::abs(a[i] - b[i]));
      }
      const double rel = std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
      EXPECT_LE(rel, 1e-6) << l.name << " " << key << " (largest element difference " << worst_elem
                           << ")";
      worst_param = std::max(worst_param, rel);
    }
    for (const auto& [name, t] : got.base)
      expect_identical(t, initial.at(name), l.name + ": frozen " + name);
    // Replicated adapter matrices (over dp without FSDP, over tp for the unsplit factor) stay
    // bitwise identical.
    for (Parameter* p : run.lora->parameters()) {
      if (!p->is_dtensor()) continue;
      SCOPED_TRACE(l.name + " " + p->str());
      tessera::testing::expect_replicas_equal(p->stored_dtensor());
    }
    if (world_rank() == 0)
      std::printf(
          "[lora parity] %s: worst relative loss %.2e, worst relative adapter matrix "
          "%.2e (tolerance 1e-6)\n",
          l.name.c_str(), worst_loss, worst_param);
  }
  // The reference itself moved: a run that trained nothing could not pass.
  EXPECT_LT(ref.losses.back(), ref.losses.front() * 0.9);
}

namespace {

// One projection, for counting what a layer alone communicates.
class OneLayer : public Module {
 public:
  explicit OneLayer(std::shared_ptr<Linear> l) : Module("OneLayer"), proj(std::move(l)) {
    register_module("proj", proj);
  }
  Tensor forward(const Tensor& x) override { return (*proj)(x); }
  std::shared_ptr<Linear> proj;
};

std::string str(const std::map<std::string, int64_t>& m) {
  std::string s;
  for (const auto& [k, v] : m)
    s += (s.empty() ? "" : ", ") + k + " " + std::to_string(v);
  return s.empty() ? "none" : s;
}

int64_t total(const std::map<std::string, int64_t>& m) {
  int64_t n = 0;
  for (const auto& [k, v] : m)
    n += v;
  return n;
}

// The collectives of one forward and one backward, by kind; the input requires grad, as inside a
// network.
std::pair<std::map<std::string, int64_t>, std::map<std::string, int64_t>> count(Module& m,
                                                                                const Tensor& x) {
  world_group()->barrier()->wait();
  Tensor in = x.detach().clone();
  in.set_requires_grad(true);
  reset_comm_op_counts();
  Tensor y = m(in);
  auto fwd = comm_op_counts();
  reset_comm_op_counts();
  backward(sum(mul(y, y)));
  auto bwd = comm_op_counts();
  return {fwd, bwd};
}

}  // namespace

// A LoRA layer issues as many collectives per forward and per backward as the same layer
// without adapters (trainable, as in ordinary training): column parallel, row parallel, and row
// parallel into sequence-sharded activations.
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
  for (const Case& c : cases) {
    for (bool lora_first : {false, true}) {
      Generator gen(1);
      auto plain = std::make_shared<OneLayer>(std::make_shared<Linear>(16, 24, false, gen));
      parallelize_module(plain, mesh, {{"proj", c.style}});
      Generator gen2(1);
      auto with = std::make_shared<OneLayer>(std::make_shared<Linear>(16, 24, false, gen2));
      LoraConfig cfg = lora_test_config(LoraInit::Random);
      cfg.target_modules = {"proj"};
      if (lora_first) apply_lora(with, cfg);
      parallelize_module(with, mesh, {{"proj", c.style}});
      if (!lora_first) apply_lora(with, cfg);
      Generator gx(5);
      const Tensor x = rand(c.input, gx);
      const auto base = count(*plain, x);
      const auto lora = count(*with, x);
      const std::string what = c.name + (lora_first ? " (LoRA first)" : "");
      EXPECT_EQ(total(lora.first), total(base.first))
          << what << ", forward: with adapters " << str(lora.first) << "; without "
          << str(base.first);
      EXPECT_EQ(total(lora.second), total(base.second))
          << what << ", backward: with adapters " << str(lora.second) << "; without "
          << str(base.second);
      if (world_rank() == 0 && !lora_first)
        std::printf(
            "[lora collectives] tp%lld %s: without adapters forward {%s} backward {%s}; "
            "with {%s} {%s}\n",
            (long long)n, what.c_str(), str(base.first).c_str(), str(base.second).c_str(),
            str(lora.first).c_str(), str(lora.second).c_str());
    }
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
    EXPECT_FALSE(layer->dtensor_io().has_value()) << path;
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
    if (layer->is_training()) training.push_back(path);
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
    LoraLinear& l = *lora->layers().front().second;
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
                    "expected the global shape [" + std::to_string(layer->out_features()) + ", 4]",
                    "a local piece cannot stand for the global tensor"});
      refused = true;
      break;
    }
    EXPECT_TRUE(refused || l.name.rfind("fsdp", 0) != 0) << l.name;
    const auto still = run.lora->read_adapter("default");
    for (const auto& [k, t] : first)
      expect_identical(still.at(k), t, l.name + " after the refused write " + k);
  }
}

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
    const std::vector<std::string> route = {"default", "b", "", "b", "default", "c"};
    std::vector<int64_t> ids;
    for (const auto& r : route)
      ids.push_back(r.empty() ? -1 : run.lora->adapter_id(r));
    run.lora->set_batch_adapters(from_vector<int64_t>(ids, {6}));
    const Tensor mixed = run.logits(batch.ids);
    for (int64_t row = 0; row < 6; ++row)
      expect_close(kernels::narrow(mixed, 0, row, 1),
                   kernels::narrow(alone[route[size_t(row)]], 0, row, 1), 1e-5,
                   l.name + " row " + std::to_string(row) + " (" + route[size_t(row)] + ")");
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
  const std::string dir = scratch_dir("lora_peft_np" + std::to_string(world_size()));
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

// PEFT's per-module ranks and alphas (rank_pattern, alpha_pattern) are refused, naming the field
// and the file, where they would otherwise load with the global r and lora_alpha (a wrong scale)
// or fail with a shape mismatch; empty patterns, as PEFT writes them, load.
TEST(Lora, PeftPerModuleRanksAndAlphasAreRefused) {
  const std::string dir = scratch_dir("lora_peft_patterns_np" + std::to_string(world_size()));
  const DecoderConfig cfg = lora_decoder_config();
  LoraRun run = lora_layouts({.max_adapters = 2, .max_rank = 4})
                    .front()
                    .build(cfg, lora_test_config(LoraInit::Random));
  run.lora->save_adapter(dir + "/adapter", "default");
  const std::string alpha =
      peft_config_variant(dir, "alpha", "\"alpha_pattern\": {}", "\"alpha_pattern\": {\"wq\": 32}");
  expect_error([&] { run.lora->load_adapter(alpha, "alpha"); },
               {"alpha/adapter_config.json'", "alpha_pattern", "per-module"});
  const std::string rank =
      peft_config_variant(dir, "rank", "\"rank_pattern\": {}", "\"rank_pattern\": {\"wq\": 2}");
  expect_error([&] { run.lora->load_adapter(rank, "rank"); },
               {"rank/adapter_config.json'", "rank_pattern", "per-module"});
  EXPECT_EQ(run.lora->adapters(), (std::vector<std::string>{"default"}));
  // The files as saved, with both patterns empty.
  run.lora->load_adapter(dir + "/adapter", "loaded");
  EXPECT_EQ(run.lora->adapters(), (std::vector<std::string>{"default", "loaded"}));
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
  expect_error([&] { lora->add_adapter("big", big); },
               {"adapter 'big' has r 16 but the slots hold at most rank 4"});
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
