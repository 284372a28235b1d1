// Groups that a step skips (layer drop, a task head used every other step, the other tower of a
// two-tower model): what was issued or summed for them must not outlive the step it belongs to,
// nor be lost with it.
#include <gtest/gtest.h>

#include <string>

#include "dist/fsdp_parity.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/tessera.h"
#include "tessera/testing.h"

using namespace tessera;
using namespace tessera::fsdp_test;

namespace {

// A block that a forward may skip (as layer drop or a task head used every other step does).
class SkippableBlock : public Module {
 public:
  SkippableBlock() : Module("SkippableBlock") {
    Generator gen(41);
    a = std::make_shared<Linear>(6, 6, true, gen);
    b = std::make_shared<Linear>(6, 6, true, gen);
    out = std::make_shared<Linear>(6, 2, true, gen);
    register_module("a", a);
    register_module("b", b);
    register_module("out", out);
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = silu((*a)(x));
    if (!skip_b) h = silu((*b)(h));
    return (*out)(h);
  }
  bool skip_b = false;
  std::shared_ptr<Linear> a, b, out;
};

// a's forward prefetches b, which ran after it in the previous step; when b then does not run,
// that gather must not be what b's next forward uses: the shards were written meanwhile (an
// optimizer step on gradients accumulated over micro-batches, a load), and b computed with the
// weights from before (under no_grad silently; with grad, its backward refused them as modified).
// Dropped at the end of backward (seen by an unshard() by hand before the next forward), or when
// the next forward starts after a step without backward.
TEST(FSDPSchedule, PrefetchOfAGroupThatDidNotRunIsNotUsedLater) {
  for (bool grad : {false, true}) {
    const std::string what = grad ? "skipped in a step with backward" : "skipped under no_grad";
    auto net = std::make_shared<SkippableBlock>();
    fully_shard(net->a, dp_mesh());
    auto b = fully_shard(net->b, dp_mesh());
    fully_shard(net, dp_mesh());
    Generator gen(43);
    Tensor x = randn({4, 6}, gen);
    backward(mean(square((*net)(x))));
    net->skip_b = true;
    if (grad) {
      backward(mean(square((*net)(x))));  // a prefetches b, which does not run
    } else {
      NoGradGuard no_grad;
      (*net)(x);
    }
    for (Parameter* p : net->b->parameters())
      p->fill_(0.25);
    net->skip_b = false;
    if (grad) {
      b->unshard();  // by hand, before any forward
    } else {
      b->set_reshard_after_forward(false);  // keeps what b's forward gathered, to look at
      NoGradGuard no_grad;
      (*net)(x);
    }
    ASSERT_TRUE(b->is_unsharded()) << what;
    for (Parameter* p : net->b->parameters())
      for (double v : p->local().to_vector<double>())
        ASSERT_EQ(v, 0.25) << what << ": " << p->str() << " holds the values from before the write";
    b->reshard();
    backward(mean(square((*net)(x))));
    EXPECT_TRUE(net->b->weight.grad().defined()) << what;
  }
}

// Two roots (the towers of a two-tower model): the first's root prefetches, by an explicit
// target, a group of the second (its root, or a block inside it). Used in the step, that
// all-gather is all the group issues; when the second tower does not run in the first's step,
// the first's step drops it as its own unused prefetches, so the group's next gather, after a
// write to its shards, reads them anew (seen by an unshard() by hand).
TEST(FSDPSchedule, PrefetchOfAGroupUnderAnotherRootFollowsThePrefetchingStep) {
  for (bool target_block : {false, true}) {
    const std::string what = target_block ? "a block of the other root" : "the other root";
    FSDPOptions opts;
    opts.backward_prefetch = false;  // each root's depends on timing (docs/fsdp.md, Limits)
    auto tower_a = std::make_shared<SkippableBlock>();
    auto tower_b = std::make_shared<SkippableBlock>();
    auto a_block = fully_shard(tower_a->a, dp_mesh(), opts);
    auto a_root = fully_shard(tower_a, dp_mesh(), opts);
    auto b_block = fully_shard(tower_b->b, dp_mesh(), opts);
    auto b_root = fully_shard(tower_b, dp_mesh(), opts);
    const auto target = target_block ? b_block : b_root;
    Generator gen(47);
    Tensor x = randn({4, 6}, gen);
    auto both_towers = [&] {
      backward(add(mean(square((*tower_a)(x))), mean(square((*tower_b)(x)))));
    };
    both_towers();  // the first step sets each root's forward order
    reset_comm_op_counts();
    both_towers();
    const int64_t without = comm_op_counts()["all_gather_runs"];
    a_root->set_modules_to_forward_prefetch({a_block, target});
    reset_comm_op_counts();
    both_towers();
    EXPECT_EQ(comm_op_counts()["all_gather_runs"], without) << what << ": all-gathers issued";
    for (bool grad : {true, false}) {
      const double value = grad ? 0.25 : 0.5;
      auto write_target = [&] {
        for (Parameter* p : target->parameters())
          p->fill_(value);
      };
      // The first tower's forward prefetches the target, which does not run.
      if (grad) {
        backward(mean(square((*tower_a)(x))));
        write_target();
      } else {
        NoGradGuard no_grad;
        (*tower_a)(x);
        write_target();
        (*tower_a)(x);  // its start drops the last step's prefetch, then prefetches anew
      }
      const std::string when = what + (grad ? ", step with backward" : ", under no_grad");
      target->unshard();
      for (Parameter* p : target->parameters())
        for (double v : p->local().to_vector<double>())
          ASSERT_EQ(v, value) << when << ": " << p->str()
                              << " holds the values from before the write";
      target->reshard();
    }
  }
}

// An evaluation forward under no_grad prefetches, then an optimizer step writes the shards, then
// a training forward runs: it must compute with the stepped parameters, never with an all-gather
// issued before the step. kSkip: the evaluation skips b, whose prefetch (issued by a) it leaves
// unused; dropped when the root's next forward starts. kOtherRoot: the prefetch is of b from
// another root (an explicit target), and b's root, not the prefetching one, runs next: b's
// forward used the all-gather from before the step. kOtherRootOneRank: rank 0 alone writes b's
// shards instead (a load on one rank): every rank must drop that all-gather alike.
TEST(FSDPSchedule, PrefetchUnderNoGradIsNotUsedAfterAnOptimizerStep) {
  enum Case { kOneRoot, kSkip, kOtherRoot, kOtherRootOneRank };
  for (Case c : {kOneRoot, kSkip, kOtherRoot, kOtherRootOneRank}) {
    const std::string what = "case " + std::to_string(int(c));
    const bool other_root = c == kOtherRoot || c == kOtherRootOneRank;
    auto tower_a = std::make_shared<SkippableBlock>();
    auto net = std::make_shared<SkippableBlock>(), ref = std::make_shared<SkippableBlock>();
    auto a_block = fully_shard(tower_a->a, dp_mesh());
    auto a_root = fully_shard(tower_a, dp_mesh());
    fully_shard(net->a, dp_mesh());
    auto b = fully_shard(net->b, dp_mesh());
    fully_shard(net, dp_mesh());
    if (other_root) a_root->set_modules_to_forward_prefetch({a_block, b});
    SGD opt(net->parameters(), SGDOptions{.lr = 0.5});
    SGD ref_opt(ref->parameters(), SGDOptions{.lr = 0.5});
    Generator gen(49);
    const Tensor x = randn({4, 6}, gen);  // the same on every rank: no averaging to mirror
    backward(mean(square((*net)(x))));    // sets the forward order, and the gradients to step
    backward(mean(square((*ref)(x))));
    {
      NoGradGuard no_grad;
      net->skip_b = c == kSkip;
      (*(other_root ? tower_a : net))(x);
      net->skip_b = false;
    }
    if (c == kOtherRootOneRank) {
      if (world_rank() == 0) net->b->weight.fill_(0.25);
      ref->b->weight.copy_from_full(net->b->weight.full());
    } else {
      opt.step();
      ref_opt.step();
    }
    tessera::testing::expect_close((*net)(x), (*ref)(x), 1e-6, what);
  }
}

// Micro-batches accumulated without sync, the last (synced) one skipping `b`: the sums `b` holds
// from the earlier ones belong to this step. They must reach its stored gradients with the
// others', not wait for a later synced backward that runs `b` (adding them to another step's).
// Likewise for HSDP's sums kept for a later all-reduce (set_requires_all_reduce(false)).
// `hsdp`: every micro-batch reduce-scatters, only the last all-reduces across replicas; `b`,
// skipped by the last, has nothing new to reduce-scatter then (its sums are reduce-scattered
// already), only the all-reduce of its kept sums: it issues no reduce-scatter of zeros.
void expect_skipped_group_keeps_its_sums(const DeviceMesh& mesh, bool hsdp) {
  const std::string what = hsdp ? "all-reduce kept for later" : "gradient sync off";
  auto ref = std::make_shared<SkippableBlock>();
  auto net = std::make_shared<SkippableBlock>();
  fully_shard(net->a, mesh);
  auto b = fully_shard(net->b, mesh);
  auto root = fully_shard(net, mesh);
  auto micro_batch = [&](int m, bool skip_b, bool last) {
    if (hsdp)
      root->set_requires_all_reduce(last);
    else
      root->set_requires_gradient_sync(last);
    ref->skip_b = net->skip_b = skip_b;
    Tensor total;
    for (int r = 0; r < world_size(); ++r) {
      Generator gen(uint64_t(600 + 11 * m + r));
      Tensor l = mean(square((*ref)(randn({3, 6}, gen))));
      total = total.defined() ? add(total, l) : l;
    }
    backward(mul(total, 1.0 / world_size()));
    Generator gen(uint64_t(600 + 11 * m + world_rank()));
    backward(mean(square((*net)(randn({3, 6}, gen)))));
  };
  auto expect_grads = [&](const std::string& when) {
    const auto want = ref->named_parameters(), got = net->named_parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      const std::string where = what + ", " + when + ": " + want[i].first;
      const Tensor& w = want[i].second->grad();
      ASSERT_EQ(got[i].second->grad().defined(), w.defined()) << where;
      if (w.defined())
        tessera::testing::expect_close(got[i].second->grad_dtensor().full_tensor(), w, 1e-5, where);
    }
  };
  micro_batch(0, /*skip_b=*/false, /*last=*/false);
  micro_batch(1, /*skip_b=*/false, /*last=*/false);
  const int64_t reduce_scatters = b->comm_stats().reduce_scatters;
  micro_batch(2, /*skip_b=*/true, /*last=*/true);
  expect_grads("b skipped by the last micro-batch");
  EXPECT_EQ(b->comm_stats().reduce_scatters - reduce_scatters, hsdp ? 0 : 1)
      << what << ": b's reduce-scatters in the last micro-batch";
  for (Module* m : {static_cast<Module*>(ref.get()), static_cast<Module*>(net.get())})
    for (Parameter* p : m->parameters())
      p->zero_grad();
  micro_batch(3, /*skip_b=*/false, /*last=*/true);
  expect_grads("the next step, b in its one micro-batch");
}

TEST(FSDPSkipped, GroupSkippedByTheSyncedMicroBatchKeepsItsSums) {
  expect_skipped_group_keeps_its_sums(dp_mesh(), /*hsdp=*/false);
  if (world_size() == 4) {
    const DeviceMesh hsdp(Shape{2, 2}, {"replicate", "shard"});
    expect_skipped_group_keeps_its_sums(hsdp, /*hsdp=*/false);
    expect_skipped_group_keeps_its_sums(hsdp, /*hsdp=*/true);
  }
}

// A block that passes its input through when told to (a gate switched off), here with that
// input a leaf that requires grad (trainable input embeddings).
class Gate : public Module {
 public:
  Gate() : Module("Gate") {
    Generator gen(53);
    fc = std::make_shared<Linear>(6, 6, true, gen);
    register_module("fc", fc);
  }
  Tensor forward(const Tensor& x) override { return pass ? x : (*fc)(x); }
  bool pass = false;
  std::shared_ptr<Linear> fc;
};

class GatedNet : public Module {
 public:
  GatedNet() : Module("GatedNet") {
    Generator gen(59);
    gate = std::make_shared<Gate>();
    head = std::make_shared<Linear>(6, 2, true, gen);
    register_module("gate", gate);
    register_module("head", head);
  }
  Tensor forward(const Tensor& x) override { return (*head)((*gate)(x)); }
  std::shared_ptr<Gate> gate;
  std::shared_ptr<Linear> head;
};

// A group's output that is a leaf (its input passed through) has no graph node whose end says
// that its forward was dropped: the group waited for that backward forever (its next forward
// kept the stale pending state), and the hook on the leaf fired in a later step's backward.
// Steps alternate passing through and not, with forwards dropped in between; gradients and
// parameters match an unsharded run.
TEST(FSDPSchedule, AGroupWhoseOutputIsALeafForgetsADroppedForward) {
  auto net = std::make_shared<GatedNet>(), ref = std::make_shared<GatedNet>();
  fully_shard(net->gate, dp_mesh());
  fully_shard(net, dp_mesh());
  Generator gen(61);
  Tensor x = randn({4, 6}, gen), x_ref = x.clone();
  x.set_requires_grad(true);
  x_ref.set_requires_grad(true);
  SGD opt(net->parameters(), {.lr = 0.1}), ref_opt(ref->parameters(), {.lr = 0.1});
  for (int step = 0; step < 4; ++step) {
    const std::string what = "step " + std::to_string(step);
    for (bool pass : {true, step % 2 == 1}) {
      net->gate->pass = ref->gate->pass = pass;
      (void)(*net)(x);  // dropped, never backpropagated
    }
    opt.zero_grad();
    ref_opt.zero_grad();
    x.set_grad(Tensor());
    x_ref.set_grad(Tensor());
    backward(mean(square((*net)(x))));
    backward(mean(square((*ref)(x_ref))));
    ASSERT_TRUE(x.grad().defined()) << what;
    tessera::testing::expect_close(x.grad(), x_ref.grad(), 1e-5, what + ": the input's gradient");
    opt.step();
    ref_opt.step();
  }
  auto want = ref->named_parameters();
  for (auto& [name, p] : net->named_parameters())
    for (auto& [ref_name, q] : want)
      if (name == ref_name) tessera::testing::expect_close(p->full(), q->full(), 1e-5, name);
}

}  // namespace
