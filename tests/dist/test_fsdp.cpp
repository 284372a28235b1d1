// fully_shard against the plain model trained in the same process on the whole global batch:
// every FSDP variant (plain, HSDP, FSDP x TP, gradient accumulation, frozen parameters) must give
// the same losses and the same final weights as single-rank training with the mean loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "dist/fsdp_parity.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::fsdp_test;
using tessera::testing::expect_close;
using tessera::testing::expect_error;

namespace {

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
    states.back()->set_requires_gradient_sync(last);  // the root's reaches the blocks
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
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied embeddings" : "separate output projection");
    const DecoderConfig cfg = decoder_config(tied);
    auto net = std::make_shared<Decoder>(cfg);
    parallelize_module(net, mesh["tp"], decoder_tp_plan(cfg, mesh["tp"]));
    shard_blocks_and_root(net, mesh[std::vector<std::string>{"replicate", "shard"}]);
    for (auto& [name, p] : net->named_parameters()) {
      ASSERT_TRUE(p->is_dtensor()) << name;
      // Tied, the root's group holds no TP parameter, so it shards on (replicate, shard) alone.
      if (!tied || name.starts_with("layers.")) {
        EXPECT_EQ(p->stored_dtensor().mesh().ndim(), 3) << name << " " << p->str();
      }
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
    expect_same_run(run, reference_run(tied), 1e-5, "HSDP x TP 2x2x2" + tied_label(tied));
  }
}

}  // namespace
