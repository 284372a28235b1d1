// fully_shard against the plain model trained in the same process on the whole global batch:
// every FSDP variant (plain, HSDP, FSDP x TP, gradient accumulation, frozen parameters) must give
// the same losses and the same final weights as single-rank training with the mean loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <string>

#include "common/affine_batch.h"
#include "common/small_decoder.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/tessera.h"
#include "tessera/testing.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using tessera::testing::affine_batch;
using tessera::testing::Batch;
using tessera::testing::compare_trajectories;
using tessera::testing::expect_close;
using tessera::testing::expect_error;
using tessera::testing::kSmallBatch;
using tessera::testing::kSmallSeq;
using tessera::testing::ParityOptions;
using tessera::testing::ParityResult;
using tessera::testing::small_decoder_config;
using tessera::testing::Trajectory;
using tessera::testing::world_mean;

namespace {

constexpr int64_t kBatch = kSmallBatch;
constexpr int64_t kSeq = kSmallSeq;

Batch make_batch(int step, int64_t rows = kBatch) {
  return affine_batch(step, rows, kSeq, small_decoder_config().vocab_size);
}

Batch rows_of(const Batch& b, int64_t dp_rank, int64_t dp_size) {
  const int64_t n = b.ids.size(0) / dp_size;
  return {kernels::narrow(b.ids, 0, dp_rank * n, n).contiguous(),
          kernels::narrow(b.targets, 0, dp_rank * n, n).contiguous()};
}

// How a test shards the model; returns the groups, root last.
using Apply = std::function<std::vector<std::shared_ptr<FSDPState>>(std::shared_ptr<Decoder>)>;

std::vector<std::shared_ptr<FSDPState>> shard_blocks_and_root(const std::shared_ptr<Decoder>& net,
                                                              const DeviceMesh& mesh,
                                                              FSDPOptions opts = {}) {
  std::vector<std::shared_ptr<FSDPState>> states;
  for (auto& layer : net->layers)
    states.push_back(fully_shard(layer, mesh, opts));
  states.push_back(fully_shard(net, mesh, opts));
  return states;
}

// The losses of every step (mean over the ranks) and the parameters after the last.
Trajectory train(const std::shared_ptr<Decoder>& net, int steps, int64_t dp_rank, int64_t dp_size,
                 const std::function<void(Decoder&)>& check_step = {}) {
  AdamW opt(net->parameters(), AdamWOptions{.lr = 3e-3});
  Trajectory run;
  for (int s = 0; s < steps; ++s) {
    Batch b = rows_of(make_batch(s), dp_rank, dp_size);
    opt.zero_grad();
    Tensor loss = cross_entropy((*net)(b.ids), b.targets);
    backward(loss);
    if (check_step) check_step(*net);
    opt.step();
    run.losses.push_back(world_mean(loss.item<float>()));
  }
  run.parameters[steps - 1] = net->state_dict();
  return run;
}

const std::map<std::string, Tensor>& final_state(const Trajectory& t) {
  return t.parameters.rbegin()->second;
}

// Losses within tol relative, parameters within tol * (1 + |want|). Prints the margins on rank 0
// so that a run shows how much room the tolerance leaves.
void expect_same_run(const Trajectory& got, const Trajectory& want, double tol,
                     const std::string& label = {}) {
  const ParityOptions opts{
      .steps = int(want.losses.size()), .loss = {tol, 0}, .parameters = {tol, tol}};
  const ParityResult r = compare_trajectories(got, want, opts);
  EXPECT_FALSE(r.divergence) << label << ": " << r.str();
  if (!label.empty() && world_rank() == 0)
    std::printf("[parity] %s, %zu steps: %s (tolerance %.0e)\n", label.c_str(), got.losses.size(),
                r.str().c_str(), tol);
}

// The parity tests' decoder, optionally with the output projection tied to the embedding.
DecoderConfig decoder_config(bool tied = false) {
  DecoderConfig cfg = small_decoder_config();
  cfg.tie_embeddings = tied;
  return cfg;
}

std::string tied_label(bool tied) {
  return tied ? ", tied embeddings" : "";
}

// Plain Decoder, whole batch, no DTensor: shares nothing with the sharded runs but the seed.
const Trajectory& reference_run(bool tied = false) {
  static const Trajectory untied =
      train(std::make_shared<Decoder>(decoder_config(false)), 30, 0, 1);
  static const Trajectory with_tied =
      train(std::make_shared<Decoder>(decoder_config(true)), 30, 0, 1);
  return tied ? with_tied : untied;
}

DeviceMesh dp_mesh() {
  return DeviceMesh(Shape{world_size()}, {"dp"});
}

TEST(FullyShard, TrainingMatchesSingleRank) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Decoder>(small_decoder_config());
  auto states = shard_blocks_and_root(net, mesh);
  EXPECT_TRUE(states.back()->is_root());
  EXPECT_FALSE(states.front()->is_root());
  int unsharded_during_forward = 0;
  // Between backward and step every group is resharded and has its gradient on the stored leaf.
  auto check = [&](Decoder& d) {
    for (auto& s : states) {
      EXPECT_FALSE(s->is_unsharded());
      for (Parameter* p : s->parameters()) {
        EXPECT_FALSE(p->is_unsharded());
        ASSERT_TRUE(p->grad().defined());
        EXPECT_EQ(p->grad().shape(), p->stored().shape());
      }
    }
    (void)d;
  };
  net->layers[1]->register_forward_hook([&](Module&, const Tensor&, const Tensor&) {
    // Resharded right after its forward unless it is the root.
    unsharded_during_forward += states[1]->is_unsharded() ? 1 : 0;
    return Tensor();
  });
  Trajectory run = train(net, 30, mesh.local_rank(0), world_size(), check);
  expect_same_run(run, reference_run(), 1e-5, "FSDP dp=" + std::to_string(world_size()));
  // The hook registered after fully_shard's runs after its reshard.
  EXPECT_EQ(unsharded_during_forward, 0);
}

// The table shared by the lookup and the output projection is one parameter, in the root's group
// (the blocks' groups do not claim it), and its gradient is the sum of both uses'.
TEST(FullyShard, TiedEmbeddingsMatchSingleRank) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Decoder>(decoder_config(true));
  auto states = shard_blocks_and_root(net, mesh);
  int holders = 0;
  for (auto& s : states)
    for (Parameter* p : s->parameters())
      holders += p == &net->tok_embeddings->weight ? 1 : 0;
  EXPECT_EQ(holders, 1);
  const auto root_names = states.back()->parameter_names();
  EXPECT_EQ(std::count(root_names.begin(), root_names.end(), "tok_embeddings.weight"), 1);
  EXPECT_EQ(std::count(root_names.begin(), root_names.end(), "output.weight"), 0);
  Trajectory run = train(net, 30, mesh.local_rank(0), world_size());
  expect_same_run(run, reference_run(true), 1e-5,
                  "FSDP dp=" + std::to_string(world_size()) + tied_label(true));
}

TEST(FullyShard, StoredShardsAreOneFlatBufferPerGroup) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Decoder>(small_decoder_config());
  int64_t total = 0;
  for (Parameter* p : net->parameters())
    total += shape_numel(p->global_shape());
  auto before = net->state_dict();
  auto states = shard_blocks_and_root(net, mesh);
  const int64_t n = world_size();
  int64_t stored = 0, padded = 0, claimed = 0;
  for (auto& s : states) {
    padded += s->flat_buffer().numel();
    claimed += int64_t(s->parameters().size());
    for (Parameter* p : s->parameters()) {
      stored += p->stored().numel();
      EXPECT_TRUE(p->stored().storage().is_same(s->flat_buffer().storage()));
      ASSERT_TRUE(p->is_dtensor());
      EXPECT_EQ(p->stored_dtensor().placements(), Placements{Shard(0)});
    }
  }
  EXPECT_EQ(claimed, int64_t(net->parameters().size()));
  // ceil(rows / n) padding per parameter at most.
  EXPECT_LE(stored, padded);
  EXPECT_LE(padded, total / n + 64 * int64_t(net->parameters().size()));
  EXPECT_GE(padded * n, total);
  Tensor count = from_vector<int64_t>({stored});
  world_group()->all_reduce(count, ReduceOp::Sum)->wait();
  EXPECT_EQ(count.item<int64_t>(), total);
  // The global values are unchanged.
  for (const auto& [name, t] : net->state_dict())
    expect_close(t, before.at(name), 0, name);
}

TEST(FullyShard, GradientAccumulationEqualsOneLargeBatch) {
  DeviceMesh mesh = dp_mesh();
  constexpr int kMicro = 4;
  // Reference: one batch of 4 x kBatch rows, mean loss.
  auto ref = std::make_shared<Decoder>(small_decoder_config());
  Batch big = make_batch(3, kMicro * kBatch);
  backward(cross_entropy((*ref)(big.ids), big.targets));

  auto net = std::make_shared<Decoder>(small_decoder_config());
  auto states = shard_blocks_and_root(net, mesh);
  for (int m = 0; m < kMicro; ++m) {
    const bool last = m == kMicro - 1;
    for (auto& s : states)
      s->set_requires_gradient_sync(last);
    Batch micro = {kernels::narrow(big.ids, 0, m * kBatch, kBatch).contiguous(),
                   kernels::narrow(big.targets, 0, m * kBatch, kBatch).contiguous()};
    Batch mine = rows_of(micro, mesh.local_rank(0), world_size());
    backward(mul(cross_entropy((*net)(mine.ids), mine.targets), 1.0 / kMicro));
    if (!last) {
      for (Parameter* p : net->parameters())
        EXPECT_FALSE(p->grad().defined()) << "no reduce-scatter while sync is off";
    }
  }
  auto ref_params = ref->named_parameters();
  auto params = net->named_parameters();
  ASSERT_EQ(ref_params.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(params[i].first, ref_params[i].first);
    expect_close(params[i].second->grad_dtensor().full_tensor(), ref_params[i].second->grad(), 1e-5,
                 params[i].first);
  }
}

TEST(FullyShard, FrozenParameterGetsNoGradientAndStaysUnchanged) {
  const std::string frozen = "layers.0.attention.wq.weight";
  auto freeze = [&](Decoder& d) {
    for (auto& [name, p] : d.named_parameters())
      if (name == frozen) p->set_requires_grad(false);
  };
  auto ref = std::make_shared<Decoder>(small_decoder_config());
  freeze(*ref);
  Trajectory want = train(ref, 5, 0, 1);

  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Decoder>(small_decoder_config());
  const Tensor initial = net->state_dict().at(frozen);
  freeze(*net);
  shard_blocks_and_root(net, mesh);
  Trajectory got = train(net, 5, mesh.local_rank(0), world_size(), [&](Decoder& d) {
    for (auto& [name, p] : d.named_parameters())
      if (name == frozen) {
        EXPECT_FALSE(p->grad().defined());
      }
  });
  expect_same_run(got, want, 1e-5);
  expect_close(final_state(got).at(frozen), initial, 0, frozen);
}

// The reference run trains until the parameters move far beyond the tolerance, so a sharded run
// that dropped or mis-averaged a gradient could not pass.
TEST(FullyShard, ReferenceRunMovesParametersBeyondTheTolerance) {
  auto initial = std::make_shared<Decoder>(small_decoder_config())->state_dict();
  const Trajectory& ref = reference_run();
  EXPECT_LT(ref.losses.back(), 0.5 * ref.losses.front());
  for (const auto& [name, t] : final_state(ref)) {
    auto a = t.to_vector<double>(), b = initial.at(name).to_vector<double>();
    double moved = 0;
    for (size_t i = 0; i < a.size(); ++i)
      moved = std::max(moved, std::abs(a[i] - b[i]) / (1.0 + std::abs(b[i])));
    EXPECT_GT(moved, 1e-3) << name;
  }
}

// (replicate, shard): 2 x 2 on 4 ranks, 2 x 4 on 8.
TEST(FullyShard, HybridShardingMatchesSingleRank) {
  if (world_size() != 4 && world_size() != 8) GTEST_SKIP() << "HSDP runs on 4 or 8 ranks";
  DeviceMesh mesh(Shape{2, world_size() / 2}, {"replicate", "shard"});
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied embeddings" : "separate output projection");
    auto net = std::make_shared<Decoder>(decoder_config(tied));
    shard_blocks_and_root(net, mesh);
    Parameter* w = net->parameters().front();
    EXPECT_EQ(w->stored_dtensor().placements(), (Placements{Replicate(), Shard(0)}));
    Trajectory run = train(net, 30, world_rank(), world_size());
    expect_same_run(run, reference_run(tied), 1e-5,
                    "HSDP " + std::to_string(mesh.size(0)) + "x" + std::to_string(mesh.size(1)) +
                        tied_label(tied));
  }
}

// (dp, tp): 2 x 2 on 4 ranks, 4 x 2 on 8.
TEST(FullyShard, WithTensorParallelMatchesSingleRank) {
  if (world_size() != 4 && world_size() != 8) GTEST_SKIP() << "FSDP x TP runs on 4 or 8 ranks";
  const int64_t tp = 2, dp = world_size() / tp;
  DeviceMesh mesh(Shape{dp, tp}, {"dp", "tp"});
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied embeddings" : "separate output projection");
    const DecoderConfig cfg = decoder_config(tied);
    auto net = std::make_shared<Decoder>(cfg);
    parallelize_module(net, mesh["tp"], decoder_tp_plan(cfg, mesh["tp"]));
    shard_blocks_and_root(net, mesh["dp"]);
    for (auto& [name, p] : net->named_parameters()) {
      ASSERT_TRUE(p->is_dtensor()) << name;
      // Tied, the root's group holds no TP parameter (the plan leaves the table whole), so it
      // shards on dp alone.
      if (!tied || name.starts_with("layers.")) {
        EXPECT_EQ(p->stored_dtensor().mesh().ndim(), 2) << name << " " << p->str();
      }
      if (name == "layers.0.attention.wq.weight") {
        EXPECT_EQ(p->stored_dtensor().placements(), (Placements{StridedShard(0, tp), Shard(0)}));
      }
      if (name == "layers.0.attention.wo.weight") {
        EXPECT_EQ(p->stored_dtensor().placements(), (Placements{Shard(0), Shard(1)}));
      }
    }
    // full_tensor of every parameter is the original logical weight.
    auto original = std::make_shared<Decoder>(cfg)->state_dict();
    for (const auto& [name, t] : net->state_dict())
      expect_close(t, original.at(name), 0, name);
    Trajectory run = train(net, 30, mesh.local_rank(0), dp);
    expect_same_run(
        run, reference_run(tied), 1e-5,
        "FSDP x TP " + std::to_string(dp) + "x" + std::to_string(tp) + tied_label(tied));
  }
}

// HSDP x TP on a (replicate, shard, tp) = (2, 2, 2) mesh: TP inside each (shard, tp) plane, the
// shard dim split by FSDP and the planes replicated.
TEST(FullyShard, HybridShardingWithTensorParallelMatchesSingleRank) {
  if (world_size() != 8) GTEST_SKIP() << "HSDP x TP runs on a (2, 2, 2) mesh";
  DeviceMesh mesh(Shape{2, 2, 2}, {"replicate", "shard", "tp"});
  const DecoderConfig cfg = small_decoder_config();
  auto net = std::make_shared<Decoder>(cfg);
  parallelize_module(net, mesh["tp"], decoder_tp_plan(cfg, mesh["tp"]));
  shard_blocks_and_root(net, mesh[std::vector<std::string>{"replicate", "shard"}]);
  for (auto& [name, p] : net->named_parameters()) {
    ASSERT_TRUE(p->is_dtensor()) << name;
    EXPECT_EQ(p->stored_dtensor().mesh().ndim(), 3) << name << " " << p->str();
    if (name == "layers.0.attention.wq.weight") {
      EXPECT_EQ(p->stored_dtensor().placements(),
                (Placements{Replicate(), StridedShard(0, 2), Shard(0)}));
    }
  }
  auto original = std::make_shared<Decoder>(cfg)->state_dict();
  for (const auto& [name, t] : net->state_dict())
    expect_close(t, original.at(name), 0, name);
  // Data parallel over replicate x shard: 4 ways.
  const int64_t dp_rank = mesh.local_rank(0) * 2 + mesh.local_rank(1);
  Trajectory run = train(net, 30, dp_rank, 4);
  expect_same_run(run, reference_run(), 1e-5, "HSDP x TP 2x2x2");
}

// The sharded state dict holds the stored shards themselves (no gather), and loads into a model
// sharded any other way: FSDP on an equal mesh (redistributed in place), tensor parallel or plain
// (gathered and cut).
TEST(FullyShard, ShardedStateDictHoldsShardsAndLoadsIntoOtherLayouts) {
  DeviceMesh mesh = dp_mesh();
  const DecoderConfig cfg = small_decoder_config();
  auto net = std::make_shared<Decoder>(cfg);
  shard_blocks_and_root(net, mesh);
  train(net, 2, world_rank(), world_size());  // move away from the initial weights
  const auto full = net->state_dict();
  const auto sharded = net->sharded_state_dict();
  ASSERT_EQ(sharded.size(), full.size());
  for (auto& [name, p] : net->named_parameters()) {
    const DTensor& d = sharded.at(name);
    EXPECT_EQ(d.placements(), (Placements{Shard(0)})) << name;
    EXPECT_TRUE(d.to_local().storage().is_same(p->stored().storage())) << name << ": copied";
    expect_close(d.full_tensor(), full.at(name), 0, name);
  }

  auto check_loaded = [&](Decoder& m, const std::string& what) {
    for (const auto& [name, t] : m.state_dict())
      expect_close(t, full.at(name), 0, what + ": " + name);
  };
  auto fsdp = std::make_shared<Decoder>(cfg);  // another FSDP model, its own equal mesh
  shard_blocks_and_root(fsdp, dp_mesh());
  fsdp->load_sharded_state_dict(sharded);
  check_loaded(*fsdp, "FSDP");
  auto tp = std::make_shared<Decoder>(cfg);
  DeviceMesh tp_mesh(Shape{world_size()}, {"tp"});
  if (cfg.n_kv_heads % world_size() == 0)
    parallelize_module(tp, tp_mesh, decoder_tp_plan(cfg, tp_mesh));
  tp->load_sharded_state_dict(sharded);
  check_loaded(*tp, "TP");
  auto plain = std::make_shared<Decoder>(cfg);
  plain->load_sharded_state_dict(sharded);
  check_loaded(*plain, "plain");
  // ... and back: a plain model's sharded state dict loads into the FSDP one.
  auto fresh = std::make_shared<Decoder>(cfg);
  net->load_sharded_state_dict(fresh->sharded_state_dict());
  const auto fresh_full = fresh->state_dict();
  for (const auto& [name, t] : net->state_dict())
    expect_close(t, fresh_full.at(name), 0, "back: " + name);

  // A wrong shape names the key, and nothing is written.
  auto bad = sharded;
  bad["norm.weight"] = sharded.at("output.weight");
  expect_error([&] { plain->load_sharded_state_dict(bad); },
               {"load_sharded_state_dict into Decoder", "mis-shaped keys: norm.weight"});
  check_loaded(*plain, "after a failed load");
}

// Linear layers in custom modules, with bfloat16 reductions as well.
class MlpBlock : public Module {
 public:
  explicit MlpBlock(Generator& gen) : Module("MlpBlock") {
    fc1 = std::make_shared<Linear>(16, 24, true, gen);
    fc2 = std::make_shared<Linear>(24, 16, true, gen);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  Tensor forward(const Tensor& x) override { return add(x, (*fc2)(silu((*fc1)(x)))); }
  std::shared_ptr<Linear> fc1, fc2;
};

class Mlp : public Module {
 public:
  Mlp() : Module("Mlp") {
    Generator gen(11);
    b0 = std::make_shared<MlpBlock>(gen);
    b1 = std::make_shared<MlpBlock>(gen);
    head = std::make_shared<Linear>(16, 5, true, gen);
    register_module("b0", b0);
    register_module("b1", b1);
    register_module("head", head);
  }
  Tensor forward(const Tensor& x) override { return (*head)((*b1)((*b0)(x))); }
  std::shared_ptr<MlpBlock> b0, b1;
  std::shared_ptr<Linear> head;
};

std::vector<double> train_mlp(const std::shared_ptr<Mlp>& net, int steps, int64_t dp_rank,
                              int64_t dp_size, const std::function<void(Mlp&)>& check_step = {}) {
  AdamW opt(net->parameters(), AdamWOptions{.lr = 1e-2});
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Generator gen(uint64_t(100 + s));
    Tensor x = randn({kBatch, 16}, gen), t = randn({kBatch, 5}, gen);
    const int64_t n = kBatch / dp_size;
    x = kernels::narrow(x, 0, dp_rank * n, n).contiguous();
    t = kernels::narrow(t, 0, dp_rank * n, n).contiguous();
    opt.zero_grad();
    Tensor y = (*net)(x);
    EXPECT_EQ(y.dtype(), DType::Float32);
    Tensor loss = mean(square(sub(y, t)));
    backward(loss);
    if (check_step) check_step(*net);
    opt.step();
    losses.push_back(world_mean(loss.item<float>()));
  }
  return losses;
}

TEST(FullyShard, MixedPrecisionComputesInParamDtypeAndKeepsFloat32Masters) {
  DeviceMesh mesh = dp_mesh();
  const std::vector<double> want = train_mlp(std::make_shared<Mlp>(), 10, 0, 1);
  // reduce_dtype unset reduces in param_dtype (bfloat16); float32 reduces in full precision.
  for (std::optional<DType> reduce :
       {std::optional<DType>(), std::optional<DType>(DType::Float32)}) {
    SCOPED_TRACE(reduce ? "reduce float32" : "reduce bfloat16");
    FSDPOptions opts;
    opts.mp_policy.param_dtype = DType::BFloat16;
    opts.mp_policy.reduce_dtype = reduce;
    auto net = std::make_shared<Mlp>();
    auto s0 = fully_shard(net->b0, mesh, opts);
    fully_shard(net->b1, mesh, opts);
    // Only the root's output goes back to float32: the blocks feed bfloat16 to the head.
    opts.mp_policy.output_dtype = DType::Float32;
    fully_shard(net, mesh, opts);
    int checked = 0;
    // Runs after fully_shard's pre-hook: the block computes with gathered bfloat16 weights on a
    // bfloat16 input, while the stored shards stay float32.
    net->b0->register_forward_pre_hook([&](Module&, const Tensor& x) {
      EXPECT_EQ(x.dtype(), DType::BFloat16);
      for (Parameter* p : s0->parameters()) {
        EXPECT_TRUE(p->is_unsharded());
        EXPECT_EQ(p->local().dtype(), DType::BFloat16);
        EXPECT_EQ(p->local().shape(), p->global_shape());
        EXPECT_EQ(p->stored().dtype(), DType::Float32);
      }
      ++checked;
      return Tensor();
    });
    std::vector<double> got = train_mlp(net, 10, mesh.local_rank(0), world_size(), [&](Mlp& m) {
      for (Parameter* p : m.parameters()) {
        ASSERT_TRUE(p->grad().defined());
        EXPECT_EQ(p->grad().dtype(), DType::Float32);
        EXPECT_EQ(p->stored().dtype(), DType::Float32);
      }
    });
    EXPECT_EQ(checked, 10);
    // bfloat16 keeps about 3 significant digits.
    for (size_t s = 0; s < want.size(); ++s)
      EXPECT_NEAR(got[s], want[s], 3e-2 * want[s]) << "step " << s;
    for (const auto& [name, t] : net->state_dict())
      EXPECT_EQ(t.dtype(), DType::Float32) << name;
  }
}

// The mixed-precision figure: the decoder gathered and computed in bfloat16, gradients
// reduced in float32, float32 masters: the loss curve stays within 2% of float32 for 30 steps.
TEST(FullyShard, DecoderInBfloat16StaysWithinTwoPercentOfFloat32) {
  DeviceMesh mesh = dp_mesh();
  FSDPOptions opts;
  opts.mp_policy.param_dtype = DType::BFloat16;
  opts.mp_policy.reduce_dtype = DType::Float32;
  auto net = std::make_shared<Decoder>(small_decoder_config());
  for (auto& layer : net->layers)
    fully_shard(layer, mesh, opts);
  opts.mp_policy.output_dtype = DType::Float32;
  fully_shard(net, mesh, opts);
  int bf16_blocks = 0;
  net->layers[0]->register_forward_hook([&](Module&, const Tensor& x, const Tensor& y) {
    bf16_blocks += x.dtype() == DType::BFloat16 && y.dtype() == DType::BFloat16;
    return Tensor();
  });
  Trajectory run = train(net, 30, world_rank(), world_size());
  EXPECT_EQ(bf16_blocks, 30) << "the blocks did not compute in bfloat16";
  const Trajectory& ref = reference_run();
  double worst = 0;
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    const double rel = std::abs(run.losses[s] - ref.losses[s]) / ref.losses[s];
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 0.02) << "step " << s << ": " << run.losses[s] << " vs " << ref.losses[s];
  }
  if (world_rank() == 0)
    std::printf("[mixed precision] bf16 params, fp32 reduce, 30 steps: worst loss |d|/|ref| %.2e\n",
                worst);
  for (const auto& [name, t] : final_state(run))
    EXPECT_EQ(t.dtype(), DType::Float32) << name;
}

TEST(FullyShard, MlpWithoutMixedPrecisionMatchesExactly) {
  DeviceMesh mesh = dp_mesh();
  auto ref = std::make_shared<Mlp>();
  const std::vector<double> want = train_mlp(ref, 10, 0, 1);
  auto net = std::make_shared<Mlp>();
  // head.weight has 5 rows: over 4 ranks 2, 2, 1 and an empty shard.
  fully_shard(net->b0, mesh);
  fully_shard(net->b1, mesh);
  fully_shard(net, mesh);
  std::vector<double> got = train_mlp(net, 10, mesh.local_rank(0), world_size());
  for (size_t s = 0; s < want.size(); ++s)
    EXPECT_NEAR(got[s], want[s], 1e-5 * want[s]) << "step " << s;
  auto want_state = ref->state_dict();
  for (const auto& [name, t] : net->state_dict())
    expect_close(t, want_state.at(name), 1e-5, name);
}

TEST(FullyShard, RootKeepsParametersUnshardedThroughBackward) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Decoder>(small_decoder_config());
  auto states = shard_blocks_and_root(net, mesh);
  Batch b = rows_of(make_batch(0), mesh.local_rank(0), world_size());
  Tensor loss = cross_entropy((*net)(b.ids), b.targets);
  EXPECT_TRUE(states.back()->is_unsharded());
  EXPECT_FALSE(states.front()->is_unsharded());
  backward(loss);
  for (auto& s : states)
    EXPECT_FALSE(s->is_unsharded());
  // With reshard_after_forward off a block stays gathered until its backward is done.
  states.front()->set_reshard_after_forward(false);
  loss = cross_entropy((*net)(b.ids), b.targets);
  EXPECT_TRUE(states.front()->is_unsharded());
  backward(loss);
  EXPECT_FALSE(states.front()->is_unsharded());
  // Explicit unshard/reshard outside forward.
  states.front()->unshard();
  for (Parameter* p : states.front()->parameters())
    EXPECT_EQ(p->local().shape(), p->global_shape());
  states.front()->reshard();
  for (Parameter* p : states.front()->parameters())
    EXPECT_FALSE(p->is_unsharded());
}

TEST(FullyShard, MisuseErrors) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Decoder>(small_decoder_config());
  fully_shard(net->layers[0], mesh);
  expect_error([&] { fully_shard(net->layers[0], mesh); },
               {"fully_shard", "DecoderBlock", "already fully_shard'ed"});
  expect_error([&] { fully_shard(net, mesh["nope"]); }, {"no mesh dim named 'nope'"});
  // A tied table sharded on its own is resharded after the lookup, before the projection needs it.
  auto tied = std::make_shared<Decoder>(decoder_config(true));
  fully_shard(tied->tok_embeddings, mesh);
  fully_shard(tied, mesh);
  Batch b = rows_of(make_batch(0), mesh.local_rank(0), world_size());
  expect_error([&] { (*tied)(b.ids); },
               {"tie_embeddings", "tok_embeddings.weight", "fully_shard them with the decoder"});
}

}  // namespace
