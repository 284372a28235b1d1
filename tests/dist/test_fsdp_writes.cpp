// fully_shard against writes to the shards between a forward and its backward: an optimizer
// step, a write on one rank only, a forward whose result is dropped, a gathered group that must
// see the write. Part of the test_fsdp binary with test_fsdp_state.cpp, whose helpers it shares
// (fsdp_parity.h, fsdp_mlp.h).
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dist/fsdp_mlp.h"
#include "dist/fsdp_parity.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::fsdp_test;
using tessera::testing::expect_close;
using tessera::testing::expect_error;

namespace {
// An optimizer step between forward and backward changes the shards that a resharded group
// gathers again for its backward: backward refuses, as it does without FSDP, instead of
// differentiating at the new weights.
TEST(FullyShard, StepBetweenForwardAndBackwardIsAnError) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Mlp>();
  fully_shard(net->b0, mesh);
  fully_shard(net->b1, mesh);
  fully_shard(net, mesh);
  SGD opt(net->parameters(), {.lr = 0.1});
  Generator gen(5);
  const Tensor x = randn({4, 16}, gen);
  backward(mean(square((*net)(x))));  // every parameter gets a gradient
  opt.step();
  Tensor loss = mean(square((*net)(x)));
  opt.step();  // b0's and b1's shards change after their forward
  expect_error([&] { backward(loss); }, "modified by an in-place operation");
  // Without the step in between, the same sequence trains on.
  Tensor again = mean(square((*net)(x)));
  EXPECT_NO_THROW(backward(again));
}

// A forward under grad mode whose result is dropped without a backward (an evaluation that forgot
// no_grad) leaves nothing behind: the next steps train as without it (the next forward took it
// for a second use of the modules in one step: a false "modified by an in-place operation" after
// the optimizer step, and every group kept gathered until the end of the next backward).
TEST(FullyShard, AForwardWhoseResultIsDroppedLeavesNothingBehind) {
  DeviceMesh mesh = dp_mesh();
  auto make = [&](std::shared_ptr<FSDPState>* b1_state) {
    auto net = std::make_shared<Mlp>();
    fully_shard(net->b0, mesh);
    auto b1 = fully_shard(net->b1, mesh);
    if (b1_state) *b1_state = b1;
    fully_shard(net, mesh);
    return net;
  };
  std::shared_ptr<FSDPState> b1_state;
  auto net = make(&b1_state), ref = make(nullptr);
  // Once b0's output gradient arrives, b1's backward is over and its weights must be freed.
  std::vector<bool> b1_gathered_at_b0;
  net->b0->register_forward_hook([&](Module&, const Tensor&, const Tensor& y) {
    if (grad_enabled())
      register_hook(y, [&](const Tensor&) {
        b1_gathered_at_b0.push_back(b1_state->is_unsharded());
        return Tensor();
      });
    return Tensor();
  });
  SGD opt(net->parameters(), {.lr = 0.1}), ref_opt(ref->parameters(), {.lr = 0.1});
  Generator gen(5);
  const Tensor x = randn({4, 16}, gen), x_val = randn({4, 16}, gen);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    backward(mean(square((*net)(x))));
    backward(mean(square((*ref)(x))));
    opt.step();
    ref_opt.step();
    (void)mean(square((*net)(x_val)));  // dropped at once, never backpropagated
  }
  for (auto& [name, p] : net->named_parameters())
    for (auto& [ref_name, q] : ref->named_parameters())
      if (name == ref_name) expect_close(p->full(), q->full(), 1e-6, name);
  EXPECT_EQ(b1_gathered_at_b0, std::vector<bool>(3, false));
}

// Where the parameters stay gathered from forward to backward (a root sharded alone), a write to
// the shards in between is refused too, although no saved leaf's version counter sees it.
TEST(FullyShard, StepBetweenForwardAndBackwardIsAnErrorForGatheredRoot) {
  auto net = std::make_shared<Mlp>();
  fully_shard(net, dp_mesh());
  Generator gen(5);
  const Tensor x = randn({4, 16}, gen);
  Tensor loss = mean(square((*net)(x)));
  net->head->weight.fill_(0.5);  // as an optimizer step or a load would write
  expect_error([&] { backward(loss); }, "modified by an in-place operation");
}

// A write between forward and backward on one rank only (that rank's optimizer, or a load, run
// alone): every rank refuses the backward, at its end, naming the parameters and the rank that
// wrote. The writing rank refusing alone, in the middle, left the others waiting for its
// collectives until the timeout ended the job. The written group: a resharded block, a root kept
// gathered, a block under HSDP (the other replica learns it from the all-reduce), a frozen block
// (its flags alone are reduced), and a block written in a micro-batch without gradient sync, or
// under HSDP in one whose sums wait for a later all-reduce across replicas (the backward that
// syncs, or all-reduces, refuses: only then do all ranks know).
TEST(FullyShard, WriteOnOneRankBetweenForwardAndBackwardIsAnErrorOnEveryRank) {
  enum Case { kBlock, kRoot, kHsdp, kFrozen, kUnsynced, kHsdpKept };
  for (Case c : {kBlock, kRoot, kHsdp, kFrozen, kUnsynced, kHsdpKept}) {
    const bool hsdp = c == kHsdp || c == kHsdpKept;
    if (hsdp && world_size() % 2 != 0) continue;
    const DeviceMesh mesh =
        hsdp ? DeviceMesh(Shape{2, world_size() / 2}, {"replicate", "shard"}) : dp_mesh();
    auto net = std::make_shared<Mlp>();
    if (c == kFrozen)
      for (Parameter* p : net->b1->parameters())
        p->set_requires_grad(false);
    if (c != kRoot) {
      fully_shard(net->b0, mesh);
      fully_shard(net->b1, mesh);
    }
    auto root = fully_shard(net, mesh);
    Generator gen(5);
    const Tensor x = randn({4, 16}, gen);
    Parameter& written = c == kRoot ? net->head->weight : net->b1->fc2->weight;
    const std::string what = "case " + std::to_string(int(c));
    if (c == kUnsynced) root->set_requires_gradient_sync(false);
    if (c == kHsdpKept) root->set_requires_all_reduce(false);
    Tensor loss = mean(square((*net)(x)));
    if (world_rank() == 0) written.fill_(0.5);
    if (c == kUnsynced || c == kHsdpKept) {
      EXPECT_NO_THROW(backward(loss)) << what << ": not every rank knows yet";
      root->set_requires_gradient_sync(true);
      root->set_requires_all_reduce(true);
      loss = mean(square((*net)(x)));
    }
    expect_error([&] { backward(loss); },
                 {c == kRoot ? "head.weight" : "fc2.weight", "modified by an in-place operation",
                  world_rank() == 0 ? "on this rank" : "on rank 0 (not this one)"});
    // Nothing of the refused backward stays: the next step trains on, on every rank alike.
    EXPECT_NO_THROW(backward(mean(square((*net)(x))))) << what;
  }
}

// One rank writing in two micro-batches whose sums wait for a later all-reduce across replicas
// (HSDP, set_requires_all_reduce(false)) is still one rank: the kept sums carry its flag once,
// and every rank names it. Also with a 16-bit reduce dtype, whose flags name the rank in base-256
// digits (each exact in any 16-bit float, so past rank 256 too).
TEST(FullyShard, OneRankWritingInTwoKeptMicroBatchesIsNamedOnce) {
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs a (2, n) mesh";
  const DeviceMesh mesh(Shape{2, world_size() / 2}, {"replicate", "shard"});
  const int writer = world_size() - 1;
  const bool here = world_rank() == writer;
  for (const std::optional<DType>& reduce :
       {std::optional<DType>(), std::optional(DType::BFloat16)}) {
    SCOPED_TRACE(reduce ? dtype_name(*reduce) : "no reduce dtype");
    auto net = std::make_shared<Mlp>();
    FSDPOptions opts;
    opts.mp_policy.reduce_dtype = reduce;
    fully_shard(net->b0, mesh, opts);
    fully_shard(net->b1, mesh, opts);
    auto root = fully_shard(net, mesh, opts);
    Generator gen(5);
    const Tensor x = randn({4, 16}, gen);
    root->set_requires_all_reduce(false);
    for (int micro = 0; micro < 2; ++micro) {
      Tensor loss = mean(square((*net)(x)));
      if (here) net->b1->fc2->weight.fill_(0.5 + micro);
      EXPECT_NO_THROW(backward(loss)) << "micro-batch " << micro << ": not every rank knows yet";
    }
    root->set_requires_all_reduce(true);
    Tensor loss = mean(square((*net)(x)));
    expect_error([&] { backward(loss); },
                 {"fc2.weight", "modified by an in-place operation",
                  here ? "between a forward and its backward, on this rank;"
                       : "on rank " + std::to_string(writer) + " (not this one)"});
    EXPECT_NO_THROW(backward(mean(square((*net)(x)))));
  }
}

// A group kept gathered after a forward (the root's, under grad) whose shards are then written
// is gathered again by the next forward: it computes with the new values, not the stale ones.
TEST(FullyShard, GatheredGroupSeesWritesToItsShards) {
  auto net = std::make_shared<Mlp>();
  auto ref = std::make_shared<Mlp>();
  auto state = fully_shard(net, dp_mesh());
  Generator gen(5);
  const Tensor x = randn({4, 16}, gen);
  Tensor first = (*net)(x);
  ASSERT_TRUE(state->is_unsharded());
  net->head->weight.fill_(0.25);
  ref->head->weight.fill_(0.25);
  expect_close((*net)(x), (*ref)(x), 1e-6, "after writing the shards");
  // A write on one rank only: every rank gathers again (they agree), so none waits in an
  // all-gather the others skip, and all compute with what the shards now hold.
  if (world_rank() == 0) net->head->weight.fill_(0.75);
  const Tensor got = (*net)(x);
  ref->head->weight.copy_from_full(net->head->weight.full());
  expect_close(got, (*ref)(x), 1e-6, "after a write on rank 0 only");
  (void)first;
}

}  // namespace
