// Tensor parallelism end to end: the decoder plan (plain, sequence parallel, loss parallel, tied
// embeddings) trained with AdamW against the same decoder trained unparallelized in the same
// process, gradients, state dicts across degrees, and the collectives a block's backward issues.
// The styles on single layers (test_tensor_parallel_styles.cpp) and the errors
// (test_tensor_parallel_errors.cpp) are in the same binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "common/affine_batch.h"
#include "dist/tensor_parallel_util.h"
#include "tessera/tessera.h"
#include "tessera/testing.h"

using namespace tessera;
using namespace tessera::tensor_parallel_test;
using tessera::testing::affine_batch;
using tessera::testing::Batch;
using tessera::testing::error_of;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;

// --- the decoder plan ---

TEST(TensorParallel, PlanShardsTheProjectionsAndKeepsNames) {
  const DecoderConfig cfg = tiny_config();
  const int64_t tp = world_size();
  DeviceMesh mesh = tp_mesh(tp);
  for (bool sp : {false, true}) {
    Model m = build(cfg, &mesh, {sp, false});
    Model ref = build(cfg, nullptr);
    auto named = m.net->named_parameters(), ref_named = ref.net->named_parameters();
    ASSERT_EQ(named.size(), ref_named.size());
    for (size_t i = 0; i < named.size(); ++i) {
      const auto& [name, p] = named[i];
      EXPECT_EQ(name, ref_named[i].first);
      EXPECT_EQ(p->global_shape(), ref_named[i].second->global_shape()) << name;
      auto ends = [&](const std::string& s) {
        return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
      };
      Placements want;
      if (ends("wq.weight") || ends("wk.weight") || ends("wv.weight") || ends("w1.weight") ||
          ends("w3.weight") || name == "output.weight" || name == "tok_embeddings.weight")
        want = {Shard(0)};
      else if (ends("wo.weight") || ends("w2.weight"))
        want = {Shard(1)};
      else if (sp)
        want = {Replicate()};  // norms under sequence parallelism
      if (want.empty()) {
        EXPECT_FALSE(p->is_dtensor()) << name << " " << p->str();
        continue;
      }
      ASSERT_TRUE(p->is_dtensor()) << name;
      EXPECT_EQ(p->dtensor().placements(), want) << name;
      Shape local = p->global_shape();
      if (want[0].is_shard()) local[size_t(want[0].dim())] /= tp;
      EXPECT_EQ(p->local().shape(), local) << name;
    }
  }
}

TEST(TensorParallel, TrainingMatchesUnparallelizedDecoder) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  const Trajectory& ref = reference_run(false);
  // The reference learns: otherwise matching it would prove little.
  EXPECT_LT(ref.losses.back(), 0.7 * ref.losses.front());
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name);
    expect_same_training(train(build(cfg, &mesh, v.opts), kSteps), ref, v.name);
  }
}

TEST(TensorParallel, UnevenShardsTrainLikeTheUnparallelizedDecoder) {
  // Over 4 ranks: ffn 66 -> 17, 17, 17, 15 columns; vocabulary 50 -> 13, 13, 13, 11 rows;
  // sequence 15 -> 4, 4, 4, 3 tokens under sequence parallelism (over 2: 33/33, 25/25, 8/7).
  DecoderConfig cfg = tiny_config();
  cfg.ffn_dim = 66;
  cfg.vocab_size = 50;
  constexpr int64_t kUnevenSeq = 15;
  constexpr int kUnevenSteps = 10;
  DeviceMesh mesh = tp_mesh(world_size());
  const Trajectory ref = train(build(cfg, nullptr), kUnevenSteps, kUnevenSeq);
  for (const Variant& v : variants())
    expect_same_training(train(build(cfg, &mesh, v.opts), kUnevenSteps, kUnevenSeq), ref, v.name);
}

TEST(TensorParallel, TiedEmbeddingsTrainLikeTheUnparallelizedDecoder) {
  const DecoderConfig cfg = tiny_config(/*tied=*/true);
  DeviceMesh mesh = tp_mesh(world_size());
  const Trajectory& ref = reference_run(true);
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name);
    Model m = build(cfg, &mesh, v.opts);
    EXPECT_FALSE(m.net->tok_embeddings->weight.is_dtensor()) << "the tied weight stays replicated";
    expect_same_training(train(m, kSteps), ref, v.name);
  }
}

TEST(TensorParallel, RepeatedRunsAreBitIdentical) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  Trajectory a = train(build(cfg, &mesh, {true, true}), kSteps);
  Trajectory b = train(build(cfg, &mesh, {true, true}), kSteps);
  EXPECT_EQ(a.losses, b.losses);
  expect_same_state(final_state(a), final_state(b), 0, "second run");
}

TEST(TensorParallel, GradientsMatchUnparallelizedDecoder) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  const Batch batch = make_batch(0, cfg.vocab_size);
  Model ref = build(cfg, nullptr);
  backward(loss_of(ref, batch));
  auto ref_params = ref.net->named_parameters();
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name);
    Model m = build(cfg, &mesh, v.opts);
    backward(loss_of(m, batch));
    auto params = m.net->named_parameters();
    ASSERT_EQ(params.size(), ref_params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, p] = params[i];
      ASSERT_TRUE(p->grad().defined()) << name;
      Tensor full = p->grad();
      if (p->is_dtensor()) {
        DTensor g = p->grad_dtensor();
        EXPECT_EQ(g.placements(), p->dtensor().placements()) << name;
        full = g.full_tensor();
      }
      expect_close(full, ref_params[i].second->grad(), 1e-5, name, /*relative_to_max=*/true);
    }
  }
}

TEST(TensorParallel, StateDictIsTheUnparallelizedOne) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  for (const Variant& v : variants()) {
    Model m = build(cfg, &mesh, v.opts);
    expect_same_state(m.net->state_dict(), build(cfg, nullptr).net->state_dict(), 0, v.name);
  }
}

TEST(TensorParallel, StateDictLoadsIntoEveryDegree) {
  const DecoderConfig cfg = tiny_config();
  const int64_t n = world_size();
  DeviceMesh mesh = tp_mesh(n);
  // Trained a little, so the weights are no longer what any seed draws.
  Model src = build(cfg, &mesh);
  train(src, 3);
  const std::map<std::string, Tensor> state = src.net->state_dict();
  const Batch batch = make_batch(100, cfg.vocab_size);
  Tensor want;
  {
    NoGradGuard no_grad;
    want = (*src.net)(batch.ids);  // Replicate output: the whole logits
  }
  DecoderConfig other = cfg;
  other.seed = cfg.seed + 1;
  std::vector<DeviceMesh> meshes;
  for (int64_t tp = 1; tp <= n; ++tp)
    if (n % tp == 0) meshes.push_back(tp_mesh(tp));
  for (size_t i = 0; i <= meshes.size(); ++i) {
    const bool plain = i == meshes.size();
    const std::string what = plain ? "unparallelized" : "tp=" + std::to_string(meshes[i].size());
    for (bool sp : plain ? std::vector<bool>{false} : std::vector<bool>{false, true}) {
      Model dst = build(other, plain ? nullptr : &meshes[i], {sp, false});
      ASSERT_NE(dst.net->state_dict().at("output.weight").to_vector<float>(),
                state.at("output.weight").to_vector<float>());
      dst.net->load_state_dict(state);
      expect_same_state(dst.net->state_dict(), state, 0, what + " after load");
      NoGradGuard no_grad;
      expect_close((*dst.net)(batch.ids), want, 1e-5, what + " logits");
    }
  }
}

namespace {

// Every parameter gradient of a parallelized block (gathered where it is a DTensor) against the
// plain block's, within 1e-5 (1 + |want|).
void expect_same_parameter_grads(Module& parallel, Module& plain) {
  std::map<std::string, Parameter*> want;
  for (auto& [name, p] : plain.named_parameters())
    want[name] = p;
  for (auto& [name, p] : parallel.named_parameters())
    tessera::testing::expect_close(p->is_dtensor() ? p->grad_dtensor().full_tensor() : p->grad(),
                                   want.at(name)->grad(), 1e-5, name);
}

}  // namespace

// One tensor-parallel decoder block's backward issues one all-reduce for the input of q, k and v
// (their gradients are added locally first) and one for the input of w1 and w3: two in all,
// where reducing each projection's gradient on its own took five. The gradients are those of the
// plain block.
TEST(TensorParallel, BlockBackwardReducesEachSharedInputOnce) {
  if (world_size() == 1) GTEST_SKIP() << "no collectives on one rank";
  const DeviceMesh mesh(Shape{world_size()}, {"tp"});
  if (tiny_config().n_kv_heads % mesh.size() != 0) GTEST_SKIP() << "kv heads do not split";
  const DecoderConfig cfg = tiny_config();
  Generator g1(3), g2(3);
  auto plain = std::make_shared<DecoderBlock>(cfg, g1);
  auto block = std::make_shared<DecoderBlock>(cfg, g2);
  const auto colwise = std::make_shared<ColwiseParallel>();
  const auto rowwise = std::make_shared<RowwiseParallel>();
  parallelize_module(block, mesh,
                     {{"attention.wq", colwise},
                      {"attention.wk", colwise},
                      {"attention.wv", colwise},
                      {"attention.wo", rowwise},
                      {"feed_forward.w1", colwise},
                      {"feed_forward.w3", colwise},
                      {"feed_forward.w2", rowwise}});
  const Tensor x = tessera::testing::random_tensor({2, kSeq, cfg.dim}, 5, DType::Float32);
  Tensor xp = x.clone().set_requires_grad(true), xt = x.clone().set_requires_grad(true);
  backward(sum((*plain)(xp)));
  Tensor y = (*block)(xt);
  world_group()->barrier()->wait();
  reset_comm_op_counts();
  backward(sum(y));
  const auto counts = comm_op_counts();
  int64_t total = 0;
  for (const auto& [op, n] : counts)
    total += n;
  EXPECT_EQ(counts.count("all_reduce") ? counts.at("all_reduce") : 0, 2);
  EXPECT_EQ(total, 2);
  tessera::testing::expect_close(xt.grad(), xp.grad(), 1e-5, "input gradient");
  expect_same_parameter_grads(*block, *plain);
}

// With sequence parallelism the attention and MLP inputs are gathered once each in forward; in
// backward the gradient terms of q, k and v (and of w1 and w3) are reduce-scattered straight
// into this rank's sequence chunk, instead of all-reduced and then cut. The backward's only
// all-reduces are the two norm weights' gradients. The gradients are those of the plain block.
TEST(TensorParallel, SequenceParallelBlockReduceScattersSharedInputs) {
  if (world_size() == 1) GTEST_SKIP() << "no collectives on one rank";
  const DeviceMesh mesh(Shape{world_size()}, {"tp"});
  const int64_t n = mesh.size();
  if (tiny_config().n_kv_heads % n != 0 || kSeq % n != 0) GTEST_SKIP() << "does not split";
  const DecoderConfig cfg = tiny_config();
  Generator g1(3), g2(3);
  auto plain = std::make_shared<DecoderBlock>(cfg, g1);
  auto block = std::make_shared<DecoderBlock>(cfg, g2);
  ColwiseParallel col;
  RowwiseParallel row;
  row.output_layouts = {Shard(1)};
  PrepareModuleInput gather;
  gather.input_layouts = {Shard(1)};
  gather.desired_input_layouts = {Replicate()};
  auto style = [](auto s) -> ParallelStylePtr { return std::make_shared<decltype(s)>(s); };
  parallelize_module(block, mesh,
                     {{"attention_norm", style(SequenceParallel{})},
                      {"attention", style(gather)},
                      {"attention.wq", style(col)},
                      {"attention.wk", style(col)},
                      {"attention.wv", style(col)},
                      {"attention.wo", style(row)},
                      {"ffn_norm", style(SequenceParallel{})},
                      {"feed_forward", style(gather)},
                      {"feed_forward.w1", style(col)},
                      {"feed_forward.w3", style(col)},
                      {"feed_forward.w2", style(row)}});
  const Tensor x = tessera::testing::random_tensor({2, kSeq, cfg.dim}, 5, DType::Float32);
  const int64_t chunk = kSeq / n;
  Tensor xp = x.clone().set_requires_grad(true);
  Tensor xt = kernels::narrow(x, 1, world_rank() * chunk, chunk).contiguous();
  xt.set_requires_grad(true);
  backward(sum((*plain)(xp)));
  Tensor y = (*block)(xt);
  world_group()->barrier()->wait();
  reset_comm_op_counts();
  backward(sum(y));
  auto counts = comm_op_counts();
  EXPECT_EQ(counts["all_reduce"], 2);
  EXPECT_EQ(counts["reduce_scatter_tensor"] + counts["reduce_scatter"], 2);
  tessera::testing::expect_close(
      xt.grad(), kernels::narrow(xp.grad(), 1, world_rank() * chunk, chunk).contiguous(), 1e-5,
      "input gradient chunk");
  expect_same_parameter_grads(*block, *plain);
}
