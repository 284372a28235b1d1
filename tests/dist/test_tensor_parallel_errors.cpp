// Tensor parallelism's errors: plans, styles, meshes and models it refuses, on every rank alike
// and before anything changes. Part of the test_tensor_parallel binary.
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

// --- errors ---

TEST(TensorParallelErrors, HeadsNotDivisibleByTheDegree) {
  const int64_t n = world_size();
  if (n == 1) GTEST_SKIP() << "every head count divides by 1";
  DecoderConfig cfg = tiny_config();
  cfg.dim = 48;
  cfg.n_heads = 6;
  cfg.n_kv_heads = 3;  // odd: divides by neither 2 nor 4
  expect_error([&] { decoder_tp_plan(cfg, tp_mesh(n)); },
               {"heads not divisible by the tensor-parallel degree", "n_heads = 6",
                "n_kv_heads = 3", "tensor-parallel degree = " + std::to_string(n)});
}

// A hand-written plan that splits heads unevenly (one head of 6 features over 4 ranks: 2, 2, 2,
// 0) leaves ranks 0-2 partial heads while rank 3 holds none and would go on into wo's
// all-gather: every rank refuses, naming a position whose share is not whole heads.
TEST(TensorParallelErrors, AnUnevenHeadSplitFailsOnEveryRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DecoderConfig cfg = tiny_config();
  cfg.dim = 6;
  cfg.n_heads = 1;
  cfg.n_kv_heads = 1;
  Generator gen(3);
  auto attn = std::make_shared<Attention>(cfg, gen);
  parallelize_module(attn, tp_mesh(4),
                     {{"wq", std::make_shared<ColwiseParallel>()},
                      {"wk", std::make_shared<ColwiseParallel>()},
                      {"wv", std::make_shared<ColwiseParallel>()},
                      {"wo", std::make_shared<RowwiseParallel>()}});
  const Tensor x = tessera::testing::random_tensor({1, 4, 6}, 5, DType::Float32);
  expect_error([&] { (*attn)(x); }, {"Attention: the tensor-parallel split gives mesh position 0",
                                     "q width 2", "not whole heads of head_dim 6"});
}

TEST(TensorParallelErrors, PatternMatchingNothingNamesItAndChangesNothing) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  auto net = std::make_shared<Decoder>(cfg);
  auto col = std::make_shared<const ColwiseParallel>();
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"layers.*.attention.wz", col}});
      },
      {"'layers.*.attention.wz'", "matches no module", "wq, wk, wv, wo"});
  // '*' stands for exactly one path component.
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"layers.*.attention.wq", col}, {"layers.*.wq", col}});
      },
      {"'layers.*.wq'", "attention_norm"});
  // The first pattern was fine, but nothing is applied before every pattern has matched.
  EXPECT_FALSE(net->layers[0]->attention->wq->weight.is_dtensor());
  EXPECT_FALSE(net->layers[0]->attention->wq->dtensor_io().has_value());
  // Within a component '*' matches any run of characters, as fnmatch does.
  parallelize_module(net, mesh, {{"layers.*.feed_forward.w*", col}});
  for (const auto& layer : net->layers) {
    EXPECT_TRUE(layer->feed_forward->w1->weight.is_dtensor());
    EXPECT_TRUE(layer->feed_forward->w2->weight.is_dtensor());
    EXPECT_TRUE(layer->feed_forward->w3->weight.is_dtensor());
    EXPECT_FALSE(layer->attention->wq->weight.is_dtensor());
  }
}

TEST(TensorParallelErrors, StyleOnTheWrongModuleType) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  auto net = std::make_shared<Decoder>(cfg);
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"norm", std::make_shared<ColwiseParallel>()}});
      },
      {"ColwiseParallel", "Linear or Embedding", "RMSNorm"});
  expect_error(
      [&] {
        parallelize_module(net, mesh,
                           {{"layers.0.attention", std::make_shared<RowwiseParallel>()}});
      },
      {"RowwiseParallel", "Attention"});
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"output", std::make_shared<SequenceParallel>()}});
      },
      {"SequenceParallel", "RMSNorm, LayerNorm or Dropout", "Linear"});
  // A second style on an already sharded layer would cut its shards again.
  parallelize_module(net, mesh, {{"output", std::make_shared<ColwiseParallel>()}});
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"output", std::make_shared<RowwiseParallel>()}});
      },
      {"RowwiseParallel", "already tensor-parallel"});
}

// Layouts a linear style cannot hand over are refused when the plan is applied, naming the style,
// the module and the layouts, before anything changes: a StridedShard (FSDP's parameter layout)
// describes no local activation, Partial ids are no ids, and a column-parallel output is a slice,
// not a term of a sum (a row-parallel one is a sum's term: Partial() keeps it so, as PyTorch).
TEST(TensorParallelErrors, LayoutsALinearStyleCannotHandOverAreRefused) {
  DeviceMesh mesh = tp_mesh(world_size());
  auto net = std::make_shared<Decoder>(tiny_config());
  const auto refused = [&](const std::string& path, std::shared_ptr<ParallelStyle> style,
                           const std::vector<std::string>& needles) {
    expect_error([&] { parallelize_module(net, mesh, {{path, style}}); }, needles);
    EXPECT_FALSE(net->output->weight.is_dtensor());
    EXPECT_FALSE(net->tok_embeddings->weight.is_dtensor());
  };
  auto col = std::make_shared<ColwiseParallel>();
  col->input_layouts = {StridedShard(0, 2)};
  refused("output", col, {"ColwiseParallel on 'output' (Linear)", "input_layouts [SS(0,2)]"});
  auto row = std::make_shared<RowwiseParallel>();
  row->output_layouts = {StridedShard(1, 2)};
  refused("layers.0.attention.wo", row,
          {"RowwiseParallel on 'layers.0.attention.wo' (Linear)", "output_layouts"});
  auto col_partial_out = std::make_shared<ColwiseParallel>();
  col_partial_out->output_layouts = {Partial()};
  refused("output", col_partial_out,
          {"ColwiseParallel on 'output' (Linear)", "output_layouts [P(sum)]", "not a sum"});
  auto row_max_out = std::make_shared<RowwiseParallel>();
  row_max_out->output_layouts = {Partial(ReduceOp::Max)};
  refused("layers.0.attention.wo", row_max_out, {"RowwiseParallel", "output_layouts [P(max)]"});
  for (std::shared_ptr<ParallelStyle> style :
       {std::shared_ptr<ParallelStyle>(std::make_shared<ColwiseParallel>()),
        std::shared_ptr<ParallelStyle>(std::make_shared<RowwiseParallel>())}) {
    if (auto* c = dynamic_cast<ColwiseParallel*>(style.get())) c->input_layouts = {Partial()};
    if (auto* r = dynamic_cast<RowwiseParallel*>(style.get())) r->input_layouts = {Partial()};
    refused("tok_embeddings", style, {"on 'tok_embeddings' (Embedding)", "input_layouts [P(sum)]"});
  }
  // What PyTorch accepts still applies: a Partial input to a linear is reduced into the layout
  // the layer needs, and a row-parallel output may stay a Partial sum.
  auto row_partial = std::make_shared<RowwiseParallel>();
  row_partial->input_layouts = {Partial()};
  row_partial->output_layouts = {Partial()};
  auto col_partial_in = std::make_shared<ColwiseParallel>();
  col_partial_in->input_layouts = {Partial()};
  parallelize_module(net, mesh,
                     {{"layers.0.attention.wo", row_partial}, {"output", col_partial_in}});
  EXPECT_TRUE(net->output->weight.is_dtensor());
  // And computes what it says: each rank's input a term of x, the row-parallel output summed
  // over the ranks is the unsplit layer's, the column-parallel output its slice.
  const int n = world_size();
  const Tensor x = random_tensor({3, 8}, 41, DType::Float32);
  const Tensor term = div(x, double(n));
  for (bool rowwise : {false, true}) {
    Generator g1(42), g2(42);
    Linear full(8, 6, true, g1), split(8, 6, true, g2);
    const Tensor want = full(x);
    if (rowwise) {
      row_partial->apply(split, mesh);
      DTensor y = DTensor::from_local(split(term), mesh, {Partial()});
      expect_close(y.full_tensor(), want, 1e-5, "row-parallel, Partial in and out");
    } else {
      col_partial_in->apply(split, mesh);
      DTensor y = DTensor::from_local(split(term), mesh, {Shard(-1)}, Shape{3, 6});
      expect_close(y.full_tensor(), want, 1e-5, "column-parallel, Partial in");
    }
  }
}

// A Shard dim of a linear style's output layouts needs the output's rank, known at the forward
// only (an input's dims are checked where its pieces are put together): the forward refuses one
// the output lacks on every rank, naming the style, the module and the layouts, rather than
// redistribute failing without saying whose layouts they were.
namespace {
struct OneProjection : Module {
  std::shared_ptr<Linear> proj;
  explicit OneProjection(Generator& g) : Module("OneProjection") {
    proj = std::make_shared<Linear>(8, 6, true, g);
    register_module("proj", proj);
  }
  Tensor forward(const Tensor& x) override { return (*proj)(x); }
};
}  // namespace

TEST(TensorParallelErrors, AnOutputShardDimTheOutputLacksNamesTheStyle) {
  DeviceMesh mesh = tp_mesh(world_size());
  const Tensor x = random_tensor({3, 8}, 43, DType::Float32);
  for (bool rowwise : {false, true}) {
    Generator g(44);
    auto holder = std::make_shared<OneProjection>(g);
    std::shared_ptr<ParallelStyle> style;
    if (rowwise) {
      auto r = std::make_shared<RowwiseParallel>();
      r->input_layouts = {Replicate()};
      r->output_layouts = {Shard(2)};
      style = r;
    } else {
      auto c = std::make_shared<ColwiseParallel>();
      c->output_layouts = {Shard(-3)};
      style = c;
    }
    parallelize_module(holder, mesh, {{"proj", style}});
    expect_error(
        [&] { (*holder)(x); },
        {rowwise ? "RowwiseParallel on 'proj' (Linear)" : "ColwiseParallel on 'proj' (Linear)",
         rowwise ? "output_layouts [S(2)]" : "output_layouts [S(-3)]", "[3, 6]"});
  }
}

// Every style checks every target before any style changes the model: a plan refused for its
// last entry (a wrong module type, a module taken twice, a plan applied again) leaves the model
// as it was, where the entries before it used to stay applied.
TEST(TensorParallelErrors, ARefusedPlanChangesNothing) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  auto net = std::make_shared<Decoder>(cfg);
  auto col = std::make_shared<const ColwiseParallel>();
  auto untouched = [&](const char* what) {
    EXPECT_FALSE(net->layers[0]->attention->wq->weight.is_dtensor()) << what;
    EXPECT_FALSE(net->layers[0]->attention->wq->dtensor_io().has_value()) << what;
  };
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"layers.*.attention.wq", col}, {"norm", col}});
      },
      {"ColwiseParallel", "Linear or Embedding", "RMSNorm"});
  untouched("a wrong type last");
  expect_error(
      [&] {
        parallelize_module(net, mesh,
                           {{"layers.*.attention.wq", col},
                            {"layers.0.attention.wq", std::make_shared<RowwiseParallel>()}});
      },
      {"'layers.0.attention.wq' is targeted by 'layers.*.attention.wq' and by "
       "'layers.0.attention.wq'"});
  untouched("a module taken twice");
  const ParallelizePlan plan = decoder_tp_plan(cfg, mesh, {.sequence_parallel = true});
  parallelize_module(net, mesh, plan);
  const Batch b = affine_batch(0, 2, cfg.max_seq_len, cfg.vocab_size);
  const Tensor logits = (*net)(b.ids);
  expect_error([&] { parallelize_module(net, mesh, plan); }, {"already"});
  // The refused second plan added no hook: the same logits, of the full shape.
  tessera::testing::expect_close(logits, (*net)(b.ids), 0, "after the refused second plan");
}

// A target refused on one rank only (its model differs there: the output layer is already
// tensor-parallel) is refused on every rank, naming that rank, before any rank changes anything:
// the others used to go on into the first target's distribution and wait there for the rank
// that had thrown.
TEST(TensorParallelErrors, ATargetRefusedOnOneRankIsRefusedOnEveryRank) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "one rank has no other rank to differ from";
  DeviceMesh mesh = tp_mesh(n);
  auto net = std::make_shared<Decoder>(tiny_config());
  if (world_rank() == n - 1)
    net->output->set_dtensor_io(DTensorIO{mesh, {Replicate()}, {Replicate()}, {Replicate()}});
  auto col = std::make_shared<const ColwiseParallel>();
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"layers.*.attention.wq", col}, {"output", col}});
      },
      {"parallelize_module(Decoder)", "[rank " + std::to_string(n - 1) + "]",
       "already tensor-parallel"});
  for (const auto& layer : net->layers) {
    EXPECT_FALSE(layer->attention->wq->weight.is_dtensor());
    EXPECT_FALSE(layer->attention->wq->dtensor_io().has_value());
  }
  EXPECT_FALSE(net->output->weight.is_dtensor());
}

// A parameter whose shape differs on one rank (a model built with another vocabulary there) is
// found before anything is distributed: every rank throws, naming both shapes, and the first
// target is left as it was, where it used to be distributed before the second one's
// distribution failed.
TEST(TensorParallelErrors, ParametersDifferingAcrossRanksChangeNothing) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "one rank has no other rank to differ from";
  DeviceMesh mesh = tp_mesh(n);
  DecoderConfig cfg = tiny_config();
  if (world_rank() == n - 1) cfg.vocab_size = 40;
  auto net = std::make_shared<Decoder>(cfg);
  auto col = std::make_shared<const ColwiseParallel>();
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"layers.*.attention.wq", col}, {"output", col}});
      },
      {"parallelize_module(Decoder)", "[rank " + std::to_string(n - 1) + "]", "differs from rank 0",
       "'output.weight' float32 [48, 32]", "'output.weight' float32 [40, 32]"});
  for (const auto& layer : net->layers) {
    EXPECT_FALSE(layer->attention->wq->weight.is_dtensor());
    EXPECT_FALSE(layer->attention->wq->dtensor_io().has_value());
  }
  EXPECT_FALSE(net->output->weight.is_dtensor());
}

// A style given other layouts on one rank would make that rank run other collectives in every
// forward (an all-gather of the output where the others keep their slices): refused on every
// rank before anything changes, naming both.
TEST(TensorParallelErrors, LayoutsDifferingAcrossRanksAreRefused) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "one rank has no other rank to differ from";
  DeviceMesh mesh = tp_mesh(n);
  auto net = std::make_shared<Decoder>(tiny_config());
  auto col = std::make_shared<ColwiseParallel>();
  if (world_rank() == n - 1) col->output_layouts = {Replicate()};
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"output", col}});
      },
      {"parallelize_module(Decoder)", "[rank " + std::to_string(n - 1) + "]",
       "ColwiseParallel(input [R], output [S(-1)])", "ColwiseParallel(input [R], output [R])"});
  EXPECT_FALSE(net->output->weight.is_dtensor());
  EXPECT_FALSE(net->output->dtensor_io().has_value());
}

// A parameter tied by assignment to another name would be distributed under one name only: the
// style is refused, naming both, before anything changes.
TEST(TensorParallelErrors, DistributingATiedParameterIsRefused) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  auto net = std::make_shared<Decoder>(cfg);
  net->output->weight = net->tok_embeddings->weight;  // tied by assignment
  auto row = std::make_shared<RowwiseParallel>();
  row->input_layouts = {Replicate()};
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"tok_embeddings", row}});
      },
      {"would distribute 'tok_embeddings.weight'", "shared with 'output.weight'",
       "tied by assignment"});
  EXPECT_FALSE(net->tok_embeddings->weight.is_dtensor());
  EXPECT_FALSE(net->tok_embeddings->dtensor_io().has_value());
}

TEST(TensorParallelErrors, MeshMustBeOneDimensional) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  auto net = std::make_shared<Decoder>(tiny_config());
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"output", std::make_shared<ColwiseParallel>()}});
      },
      {"1-D mesh", "DeviceMesh(dp=2, tp=2)"});
  expect_error([&] { decoder_tp_plan(tiny_config(), mesh); }, {"must be 1-D"});
}

// --- the layouts PrepareModuleInput/Output and SequenceParallel are given ---

// One child under a path, so that errors can be seen to name it.
struct Holder : Module {
  ModulePtr inner;
  explicit Holder(ModulePtr m) : Module("Holder"), inner(std::move(m)) {
    register_module("inner", inner);
  }
  Tensor forward(const Tensor& x) override { return (*inner)(x); }
};

std::shared_ptr<Holder> held_linear() {
  Generator g(3);
  return std::make_shared<Holder>(std::make_shared<Linear>(5, 3, false, g));
}

template <class Style>
ParallelizePlan plan_for_inner(const Style& s) {
  return {{"inner", std::make_shared<const Style>(s)}};
}

// A desired layout that cannot be reached (a Partial the activation is not in: PyTorch's
// redistribute refuses to make one too) or cannot describe a local activation (StridedShard, a
// wrong number of placements) is refused when parallelizing, naming the module's path, before
// any forward.
TEST(TensorParallelErrors, DesiredLayoutsAreCheckedWhenParallelizing) {
  DeviceMesh mesh = tp_mesh(world_size());
  PrepareModuleInput in;
  in.input_layouts = {Shard(0)};
  in.desired_input_layouts = {Partial()};
  auto m = held_linear();
  expect_error([&] { parallelize_module(m, mesh, plan_for_inner(in)); },
               {"PrepareModuleInput on 'inner' (Linear)", "desired_input_layouts [P(sum)]",
                "input_layouts [S(0)]", "Partial"});
  in.desired_input_layouts = {StridedShard(0, 2)};
  expect_error([&] { parallelize_module(m, mesh, plan_for_inner(in)); },
               {"PrepareModuleInput on 'inner' (Linear)", "desired_input_layouts [SS(0,2)]"});
  in.desired_input_layouts = {Replicate(), Replicate()};
  expect_error([&] { parallelize_module(m, mesh, plan_for_inner(in)); },
               {"PrepareModuleInput on 'inner' (Linear)", "one placement per dim"});
  PrepareModuleOutput out;
  out.output_layouts = {Replicate()};
  out.desired_output_layouts = {Partial()};
  expect_error([&] { parallelize_module(m, mesh, plan_for_inner(out)); },
               {"PrepareModuleOutput on 'inner' (Linear)", "desired_output_layouts [P(sum)]",
                "output_layouts [R]"});
  // Nothing was applied: the plain linear's output.
  const Tensor x = random_tensor({4, 5}, 1, DType::Float32);
  Generator g(3);
  tessera::testing::expect_close((*m)(x), Linear(5, 3, false, g)(x), 0, "after the refusals");
  // A Partial that needs no redistribution stays, as in PyTorch.
  out.output_layouts = {Partial()};
  parallelize_module(m, mesh, plan_for_inner(out));
}

// A desired Shard dim the activation does not have fails on every rank at the forward, naming
// the module's path, the style, the layouts and the activation's shape, where redistribute used
// to fail without saying for which module.
TEST(TensorParallelErrors, DesiredShardDimOutOfRangeNamesTheModuleAtTheForward) {
  const int64_t n = world_size();
  DeviceMesh mesh = tp_mesh(n);
  PrepareModuleInput in;
  in.input_layouts = {Shard(0)};
  in.desired_input_layouts = {Shard(2)};
  auto m = held_linear();
  parallelize_module(m, mesh, plan_for_inner(in));
  const std::string rows = std::to_string(2 * n);
  expect_error(
      [&] {
        (*m)(zeros({2, 5}));
      },
      {"PrepareModuleInput on 'inner' (Linear)", "desired_input_layouts [S(2)]", "shard dim 2",
       "[" + rows + ", 5]"});
  PrepareModuleOutput out;
  out.output_layouts = {Replicate()};
  out.desired_output_layouts = {Shard(-3)};
  auto m2 = held_linear();
  parallelize_module(m2, mesh, plan_for_inner(out));
  expect_error(
      [&] {
        (*m2)(zeros({4, 5}));
      },
      {"PrepareModuleOutput on 'inner' (Linear)", "desired_output_layouts [S(-3)]", "shard dim -3",
       "[4, 3]"});
}

// A norm's sequence_dim of -1 is the dim it normalises over: refused when parallelizing.
TEST(TensorParallelErrors, SequenceDimANormNormalisesOverIsRefusedWhenParallelizing) {
  DeviceMesh mesh = tp_mesh(world_size());
  SequenceParallel s;
  s.sequence_dim = -1;
  for (ModulePtr norm :
       {ModulePtr(std::make_shared<RMSNorm>(6)), ModulePtr(std::make_shared<LayerNorm>(6))}) {
    auto m = std::make_shared<Holder>(norm);
    expect_error([&] { parallelize_module(m, mesh, plan_for_inner(s)); },
                 {"SequenceParallel on 'inner' (" + norm->type_name() + ")", "sequence_dim -1",
                  "normalises over"});
    EXPECT_FALSE(norm->dtensor_io().has_value());
  }
  // A Dropout normalises nothing: any dim is its sequence dim.
  auto drop = std::make_shared<Holder>(std::make_shared<Dropout>(0.1));
  parallelize_module(drop, mesh, plan_for_inner(s));
}

// At the forward, a sequence_dim the input does not have, or that is the norm's normalised
// (last) dim, fails on every rank naming the path, the style and the input's shape.
TEST(TensorParallelErrors, SequenceDimIsCheckedAgainstTheInputAtTheForward) {
  DeviceMesh mesh = tp_mesh(world_size());
  SequenceParallel s;
  s.sequence_dim = 3;
  auto m = std::make_shared<Holder>(std::make_shared<RMSNorm>(6));
  parallelize_module(m, mesh, plan_for_inner(s));
  expect_error(
      [&] {
        (*m)(zeros({2, 4, 6}));
      },
      {"SequenceParallel on 'inner' (RMSNorm)", "[S(3)]", "shard dim 3", "out of range",
       "[2, 4, 6]"});
  s.sequence_dim = 2;
  auto m2 = std::make_shared<Holder>(std::make_shared<LayerNorm>(6));
  parallelize_module(m2, mesh, plan_for_inner(s));
  expect_error(
      [&] {
        (*m2)(zeros({2, 4, 6}));
      },
      {"SequenceParallel on 'inner' (LayerNorm)", "sequence_dim 2", "normalises over",
       "[2, 4, " + std::to_string(6 * world_size()) + "]"});
}
