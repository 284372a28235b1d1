// reshard_after_forward as an int N (PyTorch's post-forward mesh): after its forward a block keeps
// 1/N of its gathered parameters and its backward all-gathers over a sub-group of N ranks. The
// training must be the one with reshard_after_forward = true, bit for bit (the same values reach
// the same leaves, and the reduce-scatters are unchanged), with the backward's all-gathers counted
// over N ranks and the memory held from forward to backward between true's and false's.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <map>
#include <string>

#include "dist/fsdp_parity.h"
#include "tessera/autograd/checkpoint.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::fsdp_test;
using tessera::testing::expect_close;
using tessera::testing::expect_error;

namespace {

constexpr int kSteps = 4;

// What a run leaves to compare: the parameters after the last step, every step's local
// gradients, and each state's collective counts.
struct Outcome {
  std::map<std::string, Tensor> parameters;
  std::vector<std::map<std::string, Tensor>> grads;
  std::vector<FSDPCommStats> stats;
};

// Variations on the plain loop that must leave the int form's results those of true.
struct Variant {
  bool accumulate = false;                    // two micro-batches, the first without gradient sync
  bool unshard_before_backward = false;       // the user's unshard() between forward and backward
  bool reshard_before_backward = false;       // unshard() and then reshard() in between
  bool reshard_only_before_backward = false;  // reshard() alone in between
  bool checkpoint_blocks = false;             // activation checkpointing of every block
  bool bf16 = false;                          // MixedPrecisionPolicy param_dtype
  bool dropped_forward = false;  // a forward whose output is dropped, before the optimizer step
};

Tensor step_loss(Decoder& net, const Batch& b, const Variant& v,
                 const std::vector<std::shared_ptr<FSDPState>>& states) {
  Tensor loss = cross_entropy(net(b.ids), b.targets);
  if (v.unshard_before_backward || v.reshard_before_backward) states.front()->unshard();
  if (v.reshard_before_backward || v.reshard_only_before_backward) states.front()->reshard();
  return loss;
}

using Shard = std::function<std::vector<std::shared_ptr<FSDPState>>(const std::shared_ptr<Decoder>&,
                                                                    const FSDPOptions&)>;

Outcome train_with(ReshardAfterForward r, const Shard& shard, int64_t dp_rank, int64_t dp_size,
                   const Variant& v = {}) {
  auto net = std::make_shared<Decoder>(decoder_config());
  FSDPOptions opts;
  opts.reshard_after_forward = r;
  if (v.bf16) opts.mp_policy.param_dtype = DType::BFloat16;
  auto states = shard(net, opts);
  if (v.checkpoint_blocks)
    for (auto& block : net->layers)
      checkpoint(block);
  AdamW opt(net->parameters(), AdamWOptions{.lr = 3e-3});
  Outcome run;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    if (v.accumulate) {
      const Batch b = rows_of(make_batch(s), dp_rank, dp_size);
      const Batch halves[2] = {rows_of(b, 0, 2), rows_of(b, 1, 2)};
      states.back()->set_requires_gradient_sync(false);
      backward(step_loss(*net, halves[0], v, states));
      states.back()->set_requires_gradient_sync(true);
      backward(step_loss(*net, halves[1], v, states));
    } else {
      backward(step_loss(*net, rows_of(make_batch(s), dp_rank, dp_size), v, states));
    }
    std::map<std::string, Tensor> grads;
    for (auto& [name, p] : net->named_parameters())
      grads[name] = p->grad().clone();
    run.grads.push_back(std::move(grads));
    // Grad mode on, output dropped (an evaluation that forgot no_grad): the pieces it keeps
    // for a backward that never comes must not stand for the weights after the step.
    if (v.dropped_forward) (void)(*net)(rows_of(make_batch(s + 50), dp_rank, dp_size).ids);
    opt.step();
  }
  run.parameters = net->state_dict();
  for (const auto& st : states)
    run.stats.push_back(st->comm_stats());
  return run;
}

void expect_same(const Outcome& got, const Outcome& want, const std::string& label) {
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t s = 0; s < want.grads.size(); ++s)
    for (const auto& [name, g] : want.grads[s])
      expect_close(got.grads[s].at(name), g, 0,
                   label + ", step " + std::to_string(s) + ", gradient of " + name);
  for (const auto& [name, t] : want.parameters)
    expect_close(got.parameters.at(name), t, 0, label + ", " + name);
}

Shard blocks_and_root(const DeviceMesh& mesh) {
  return [mesh](const std::shared_ptr<Decoder>& net, const FSDPOptions& opts) {
    return shard_blocks_and_root(net, mesh, opts);
  };
}

// The blocks' all-gathers of one run: per step a forward's over the shard group and a
// backward's over `backward_ranks`.
void expect_block_gathers(const Outcome& run, int64_t shard_size, int64_t backward_ranks,
                          int64_t per_step, const std::string& label) {
  for (size_t b = 0; b + 1 < run.stats.size(); ++b) {
    std::map<int64_t, int64_t> want;
    want[shard_size] += kSteps * per_step;
    want[backward_ranks] += kSteps * per_step;
    EXPECT_EQ(run.stats[b].all_gathers_by_group_size, want) << label << ", block " << b;
  }
  // The root keeps its parameters from forward to backward: one all-gather per forward.
  const std::map<int64_t, int64_t> root{{shard_size, kSteps * per_step}};
  EXPECT_EQ(run.stats.back().all_gathers_by_group_size, root) << label << ", root";
}

TEST(ReshardAfterForwardInt, TrainsAsTrueWithTheBackwardGatherOverTheSubGroup) {
  if (world_size() != 4 && world_size() != 8) GTEST_SKIP() << "needs a shard group of 4 or 8";
  const DeviceMesh mesh = dp_mesh();
  const Outcome want = train_with(true, blocks_and_root(mesh), world_rank(), world_size());
  expect_block_gathers(want, world_size(), world_size(), 1, "true");
  for (int64_t n = 2; n < world_size(); n *= 2) {
    const std::string label = "reshard_after_forward=" + std::to_string(n);
    const Outcome got = train_with(n, blocks_and_root(mesh), world_rank(), world_size());
    expect_same(got, want, label);
    expect_block_gathers(got, world_size(), n, 1, label);
  }
}

TEST(ReshardAfterForwardInt, KeepsOtherFeaturesAsTrue) {
  if (world_size() != 4) GTEST_SKIP() << "runs on 4 ranks, N = 2";
  const DeviceMesh mesh = dp_mesh();
  const std::vector<std::pair<std::string, Variant>> variants = {
      {"gradient accumulation", {.accumulate = true}},
      {"unshard() before backward", {.unshard_before_backward = true}},
      {"unshard() and reshard() before backward", {.reshard_before_backward = true}},
      {"reshard() before backward", {.reshard_only_before_backward = true}},
      {"checkpointed blocks", {.checkpoint_blocks = true}},
      {"bfloat16 parameters", {.bf16 = true}},
      {"a dropped forward before each step", {.dropped_forward = true}},
  };
  for (const auto& [name, v] : variants) {
    SCOPED_TRACE(name);
    const Outcome want = train_with(true, blocks_and_root(mesh), world_rank(), 4, v);
    const Outcome got = train_with(2, blocks_and_root(mesh), world_rank(), 4, v);
    expect_same(got, want, name);
    // unshard() before backward gathers the first block from its kept piece, as backward would;
    // reshard() after it frees the piece too, so that block's backward gathers over all 4 ranks.
    // reshard() alone frees the piece as well (PyTorch's goes from the post-forward state to the
    // sharded one): the backward gathers over all 4 ranks, and nothing over 2.
    if (v.reshard_before_backward) {
      const std::map<int64_t, int64_t> first{{4, 2 * kSteps}, {2, kSteps}};
      EXPECT_EQ(got.stats.front().all_gathers_by_group_size, first) << name;
    } else if (v.reshard_only_before_backward) {
      const std::map<int64_t, int64_t> first{{4, 2 * kSteps}};
      EXPECT_EQ(got.stats.front().all_gathers_by_group_size, first) << name;
    } else if (v.dropped_forward) {
      // Each step's dropped forward gathers over all 4 ranks and keeps a piece nobody uses: the
      // next forward gathers from the (new) shards, over all 4 ranks again.
      const std::map<int64_t, int64_t> block{{4, 2 * kSteps}, {2, kSteps}};
      EXPECT_EQ(got.stats.front().all_gathers_by_group_size, block) << name;
    } else {
      expect_block_gathers(got, 4, 2, v.accumulate ? 2 : 1, name);
    }
  }
}

TEST(ReshardAfterForwardInt, HybridAndTensorParallelTrainAsTrue) {
  if (world_size() != 8) GTEST_SKIP() << "needs a shard group of 4 inside 8 ranks";
  {
    const DeviceMesh mesh(Shape{2, 4}, {"replicate", "shard"});
    const Outcome want = train_with(true, blocks_and_root(mesh), world_rank(), 8);
    const Outcome got = train_with(2, blocks_and_root(mesh), world_rank(), 8);
    expect_same(got, want, "HSDP 2x4, reshard_after_forward=2");
    expect_block_gathers(got, 4, 2, 1, "HSDP");
  }
  {
    const DeviceMesh mesh(Shape{4, 2}, {"dp", "tp"});
    auto shard = [mesh](const std::shared_ptr<Decoder>& net, const FSDPOptions& opts) {
      parallelize_module(net, mesh["tp"], decoder_tp_plan(decoder_config(), mesh["tp"]));
      return shard_blocks_and_root(net, mesh["dp"], opts);
    };
    const Outcome want = train_with(true, shard, mesh.local_rank(0), 4);
    const Outcome got = train_with(2, shard, mesh.local_rank(0), 4);
    expect_same(got, want, "FSDP x TP 4x2, reshard_after_forward=2");
    expect_block_gathers(got, 4, 2, 1, "FSDP x TP");
  }
}

// Bytes the allocator holds at the end of forward, and its peak over forward and backward,
// above what the sharded model holds before the step.
struct Memory {
  int64_t after_forward = 0, peak = 0;
};

// Between true's and false's only with enough blocks: during backward the int form holds the
// pieces of the blocks still to come besides the two gathered ones true holds, which with two
// blocks is more than false's two gathered blocks.
Memory step_memory(ReshardAfterForward r) {
  DecoderConfig cfg = decoder_config();
  cfg.n_layers = 8;
  cfg.dim = 64;
  cfg.ffn_dim = 128;
  auto net = std::make_shared<Decoder>(cfg);
  FSDPOptions opts;
  opts.reshard_after_forward = r;
  shard_blocks_and_root(net, dp_mesh(), opts);
  const Batch b = rows_of(make_batch(0), world_rank(), world_size());
  backward(cross_entropy((*net)(b.ids), b.targets));  // the gradients exist from here on
  const int64_t before = memory_stats().current_bytes;
  reset_peak_memory();
  Memory m;
  Tensor loss = cross_entropy((*net)(b.ids), b.targets);
  m.after_forward = memory_stats().current_bytes - before;
  backward(loss);
  m.peak = memory_stats().peak_bytes - before;
  return m;
}

TEST(ReshardAfterForwardInt, HoldsMemoryBetweenTrueAndFalse) {
  if (world_size() != 4) GTEST_SKIP() << "runs on 4 ranks, N = 2";
  const Memory full = step_memory(true), half = step_memory(2), kept = step_memory(false);
  if (world_rank() == 0)
    std::printf(
        "[memory] after forward / peak bytes: true %lld / %lld, 2 %lld / %lld, "
        "false %lld / %lld\n",
        (long long)full.after_forward, (long long)full.peak, (long long)half.after_forward,
        (long long)half.peak, (long long)kept.after_forward, (long long)kept.peak);
  EXPECT_LT(full.after_forward, half.after_forward);
  EXPECT_LT(half.after_forward, kept.after_forward);
  EXPECT_LT(full.peak, half.peak);
  EXPECT_LT(half.peak, kept.peak);
}

// reshard() between forward and backward frees the piece the int form kept, at least the half of
// the block's parameters it holds at N = 2 on 4 ranks; under true there is none, and nothing is
// freed. A second reshard() frees nothing more.
TEST(ReshardAfterForwardInt, ReshardFreesTheKeptPiece) {
  if (world_size() != 4) GTEST_SKIP() << "runs on 4 ranks, N = 2";
  const Batch b = rows_of(make_batch(0), world_rank(), world_size());
  for (const ReshardAfterForward& r : {ReshardAfterForward(2), ReshardAfterForward(true)}) {
    SCOPED_TRACE("reshard_after_forward=" + r.str());
    auto net = std::make_shared<Decoder>(decoder_config());
    FSDPOptions opts;
    opts.reshard_after_forward = r;
    auto states = shard_blocks_and_root(net, dp_mesh(), opts);
    int64_t block_bytes = 0;
    for (const auto& p : net->layers[0]->parameters())
      block_bytes += shape_numel(p->global_shape()) * int64_t(element_size(p->dtype()));
    Tensor loss = cross_entropy((*net)(b.ids), b.targets);
    const int64_t kept = memory_stats().current_bytes;
    states.front()->reshard();
    const int64_t freed = kept - memory_stats().current_bytes;
    states.front()->reshard();
    EXPECT_EQ(memory_stats().current_bytes, kept - freed) << "a second reshard()";
    if (r.world_size())
      EXPECT_GE(freed, block_bytes / 2) << "the block's parameters: " << block_bytes << " bytes";
    else
      EXPECT_EQ(freed, 0);
    backward(loss);
    const std::map<int64_t, int64_t> gathers{{4, 2}};  // forward and backward, over all 4
    EXPECT_EQ(states.front()->comm_stats().all_gathers_by_group_size, gathers);
  }
}

TEST(ReshardAfterForwardInt, ValuesThatAreNoWorldSizeAreRefused) {
  const int64_t size = world_size();
  const std::string group = "shard group of " + std::to_string(size) + " ranks";
  for (int64_t n : {int64_t(0), int64_t(-2), size + 1, size == 4 ? int64_t(3) : 2 * size}) {
    auto net = std::make_shared<Decoder>(decoder_config());
    FSDPOptions opts;
    opts.reshard_after_forward = n;
    expect_error(
        [&] { fully_shard(net->layers[0], dp_mesh(), opts); },
        {"fully_shard(DecoderBlock)", "reshard_after_forward=" + std::to_string(n), group});
    // Refused before any parameter was sharded.
    EXPECT_FALSE(is_fully_sharded(*net->layers[0]->parameters().front()));
  }
  // set_reshard_after_forward checks every group before it changes one.
  auto net = std::make_shared<Decoder>(decoder_config());
  auto states = shard_blocks_and_root(net, dp_mesh());
  expect_error([&] { states.back()->set_reshard_after_forward(size + 1); },
               {"reshard_after_forward=" + std::to_string(size + 1), group});
  for (const auto& s : states)
    EXPECT_TRUE(s->options().reshard_after_forward == true);
}

// As in PyTorch: 1 keeps the parameters gathered (false), the shard group size frees them (true).
TEST(ReshardAfterForwardInt, OneIsFalseAndTheShardSizeIsTrue) {
  if (world_size() == 1) GTEST_SKIP() << "1 is both";
  for (auto [n, want] : {std::pair{int64_t(1), false}, std::pair{int64_t(world_size()), true}}) {
    auto net = std::make_shared<Decoder>(decoder_config());
    FSDPOptions opts;
    opts.reshard_after_forward = n;
    auto states = shard_blocks_and_root(net, dp_mesh(), opts);
    EXPECT_TRUE(states.front()->options().reshard_after_forward == ReshardAfterForward(want))
        << n << " became " << states.front()->options().reshard_after_forward.str();
    const Batch b = rows_of(make_batch(0), world_rank(), world_size());
    Tensor loss = cross_entropy((*net)(b.ids), b.targets);
    EXPECT_EQ(states.front()->is_unsharded(), !want) << n;
    backward(loss);
    states.front()->set_reshard_after_forward(n);
    EXPECT_TRUE(states.front()->options().reshard_after_forward == ReshardAfterForward(want));
  }
}

}  // namespace
