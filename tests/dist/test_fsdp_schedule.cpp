// FSDP's scheduling: prefetching all-gathers must not change a single bit of training, groups
// whose gradients exist on some ranks only must still reduce-scatter in the same order on every
// rank, and a group used twice, frozen or unsharded by hand keeps its place in that order.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <optional>
#include <string>

#include "dist/fsdp_parity.h"
#include "dist/fsdp_tiny_decoder.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/tessera.h"
#include "tessera/testing.h"

using namespace tessera;
using namespace tessera::fsdp_test;

namespace {

constexpr int kSteps = 4;

struct TrainRun {
  tessera::testing::Trajectory trajectory;  // losses of each step, parameters after the last
  int64_t all_gathers = 0;                  // finished into the groups (comm_stats)
  int64_t issued = 0;                       // all-gathers issued, used or not
};

// `configure` sets prefetch on the groups (blocks first, root last) before training;
// `async_unshard` names the group whose unshard(async_op) the loop calls before each forward.
TrainRun train_decoder(
    FSDPOptions opts,
    const std::function<void(std::vector<std::shared_ptr<FSDPState>>&)>& configure,
    std::optional<size_t> async_unshard = std::nullopt) {
  auto net = std::make_shared<Decoder>(tiny_config());
  std::vector<std::shared_ptr<FSDPState>> states;
  for (auto& block : net->layers)
    states.push_back(fully_shard(block, dp_mesh(), opts));
  states.push_back(fully_shard(net, dp_mesh(), opts));
  if (configure) configure(states);
  AdamW opt(net->parameters(), AdamWOptions{.lr = 1e-2});
  TrainRun run;
  reset_comm_op_counts();
  for (int s = 0; s < kSteps; ++s) {
    auto [ids, targets] = tokens(s);
    if (async_unshard) states.at(*async_unshard)->unshard(/*async_op=*/true);
    Tensor loss = cross_entropy((*net)(ids), targets);
    backward(loss);
    opt.step();
    opt.zero_grad();
    run.trajectory.losses.push_back(loss.item<float>());
  }
  run.issued = comm_op_counts()["all_gather_runs"];
  for (auto& st : states)
    run.all_gathers += st->comm_stats().all_gathers;
  run.trajectory.parameters[kSteps - 1] = net->state_dict();
  return run;
}

// Bit for bit: the same losses and final parameters.
void expect_identical(const TrainRun& got, const TrainRun& want, const std::string& what) {
  const tessera::testing::ParityOptions exact{.steps = kSteps, .loss = {}, .parameters = {}};
  const tessera::testing::ParityResult r =
      tessera::testing::compare_trajectories(got.trajectory, want.trajectory, exact);
  EXPECT_FALSE(r.divergence) << what << ": " << r.str();
}

TEST(FSDPSchedule, PrefetchChangesNoBitAndGathersNothingTwice) {
  FSDPOptions off;
  off.forward_prefetch = off.backward_prefetch = false;
  const TrainRun reference = train_decoder(off, {});
  const TrainRun implicit = train_decoder(FSDPOptions{}, {});
  expect_identical(implicit, reference, "implicit prefetch");
  // Explicit targets: each block prefetches the next in forward and the previous in backward;
  // the root prefetches the first block.
  const TrainRun explicit_targets = train_decoder(off, [](auto& st) {
    const size_t blocks = st.size() - 1;
    st.back()->set_modules_to_forward_prefetch({st[0]});
    st.back()->set_modules_to_backward_prefetch({st[blocks - 1]});
    for (size_t b = 0; b < blocks; ++b) {
      if (b + 1 < blocks) st[b]->set_modules_to_forward_prefetch({st[b + 1]});
      if (b > 0) st[b]->set_modules_to_backward_prefetch({st[b - 1]});
    }
  });
  expect_identical(explicit_targets, reference, "explicit prefetch");
  // unshard(async_op) by hand before the forward, of the root and of a block: the forward uses
  // that all-gather (PyTorch's UnshardHandle), it issues none of its own.
  const TrainRun async_root = train_decoder(FSDPOptions{}, {}, /*async_unshard=*/3);
  expect_identical(async_root, reference, "unshard(async_op) of the root before forward");
  const TrainRun async_block = train_decoder(FSDPOptions{}, {}, /*async_unshard=*/1);
  expect_identical(async_block, reference, "unshard(async_op) of a block before forward");
  // Per step: each group once before forward, each block again before its backward.
  const int64_t per_step = 3 + 1 + 3;
  for (const auto& [run, what] : {std::pair{&reference, "no prefetch"},
                                  {&implicit, "implicit"},
                                  {&explicit_targets, "explicit"},
                                  {&async_root, "async root"},
                                  {&async_block, "async block"}}) {
    EXPECT_EQ(run->all_gathers, kSteps * per_step) << what;
    EXPECT_EQ(run->issued, kSteps * per_step) << what << ": all-gathers issued";
  }
}

// A trunk of three groups and two heads, each its own group under the root. Odd ranks put both
// heads in their loss, even ranks only head_a: head_b's gradients exist on some ranks only, and it
// is the first group in reduce-scatter order. Even ranks issue head_b's reduce-scatter only at the
// end of backward, and meanwhile wait for the trunk's all-gathers: an odd rank that blocked on
// head_b's reduce-scatter before issuing them would deadlock (schedule.h).
class Branches : public Module {
 public:
  Branches() : Module("Branches") {
    Generator gen(21);
    stem = std::make_shared<Linear>(6, 6, true, gen);
    t1 = std::make_shared<Linear>(6, 8, true, gen);
    t2 = std::make_shared<Linear>(8, 8, true, gen);
    t3 = std::make_shared<Linear>(8, 8, true, gen);
    head_a = std::make_shared<Linear>(8, 3, true, gen);
    head_b = std::make_shared<Linear>(8, 5, false, gen);
    register_module("stem", stem);
    register_module("t1", t1);
    register_module("t2", t2);
    register_module("t3", t3);
    register_module("head_a", head_a);
    register_module("head_b", head_b);
  }
  Tensor forward(const Tensor& x) override {
    return silu((*t3)(silu((*t2)(silu((*t1)((*stem)(x)))))));
  }
  std::shared_ptr<Linear> stem, t1, t2, t3, head_a, head_b;
};

Tensor branch_loss(Branches& net, int rank, int step) {
  Generator gen(uint64_t(500 + 7 * step + rank));
  Tensor x = randn({3, 6}, gen);
  Tensor h = net(x);
  Tensor loss = mean(square((*net.head_a)(h)));
  Tensor b = mean(square((*net.head_b)(h)));  // runs forward on every rank
  if (rank % 2 == 1) loss = add(loss, b);
  return loss;
}

using BranchLoss = std::function<Tensor(Branches&, int rank, int step)>;

// `steps` AdamW steps of `net` (sharded) on this rank's loss and of `ref` (one process) on the
// mean of every rank's loss; the two must end alike.
void train_against_reference(Branches& ref, Branches& net, const BranchLoss& loss_of, int steps) {
  AdamW ref_opt(ref.parameters(), AdamWOptions{.lr = 1e-2});
  AdamW opt(net.parameters(), AdamWOptions{.lr = 1e-2});
  for (int s = 0; s < steps; ++s) {
    Tensor total;
    for (int r = 0; r < world_size(); ++r) {
      Tensor l = loss_of(ref, r, s);
      total = total.defined() ? add(total, l) : l;
    }
    backward(mul(total, 1.0 / world_size()));
    ref_opt.step();
    ref_opt.zero_grad();
    backward(loss_of(net, world_rank(), s));
    opt.step();
    opt.zero_grad();
  }
  const auto got = net.state_dict(), want = ref.state_dict();
  for (const auto& [name, t] : want)
    tessera::testing::expect_close(got.at(name), t, 1e-5, name);
}

// With set_reshard_after_backward(false) too: head_b, whose backward runs on odd ranks only,
// must stay gathered on every rank alike, or the next forward's collectives would differ between
// ranks (a check of the shards on some, an all-gather on others).
class GroupWithGradientsOnSomeRanksOnly : public ::testing::TestWithParam<bool> {};

TEST_P(GroupWithGradientsOnSomeRanksOnly, StaysInStep) {
  const bool keep_gathered = GetParam();
  auto ref = std::make_shared<Branches>();
  auto net = std::make_shared<Branches>();
  for (auto& m : {net->t1, net->t2, net->t3, net->head_a})
    fully_shard(m, dp_mesh());
  fully_shard(net->head_b, dp_mesh());
  auto root = fully_shard(net, dp_mesh());
  root->set_reshard_after_backward(!keep_gathered);
  train_against_reference(*ref, *net, branch_loss, 2);
  // One rank alone never uses head_b: it gets no gradient and AdamW leaves it untouched.
  if (world_size() == 1) {
    auto fresh = std::make_shared<Branches>();
    EXPECT_EQ(net->state_dict().at("head_b.weight").to_vector<float>(),
              fresh->state_dict().at("head_b.weight").to_vector<float>());
  }
  EXPECT_EQ(root->is_unsharded(), keep_gathered);
}

// head_b frozen, run before head_a (so after it in backward order) and in the loss of odd ranks
// only: on even ranks its input's gradient (from head_a) makes it ready before its backward
// gather was issued, which odd ranks issue in its backward. Without backward prefetch nothing
// else issues it there: the group must issue it itself, or the ranks' all-gathers would no
// longer match.
TEST_P(GroupWithGradientsOnSomeRanksOnly, FrozenGroupStillGathersForBackward) {
  const bool keep_gathered = GetParam();
  auto loss_of = [](Branches& net, int rank, int step) {
    Generator gen(uint64_t(800 + 7 * step + rank));
    Tensor h = net(randn({3, 6}, gen));
    Tensor b = mean(square((*net.head_b)(h)));
    Tensor loss = mean(square((*net.head_a)(h)));
    return rank % 2 == 1 ? add(loss, b) : loss;
  };
  auto ref = std::make_shared<Branches>();
  auto net = std::make_shared<Branches>();
  for (auto& m : {ref, net})
    m->head_b->weight.set_requires_grad(false);
  FSDPOptions opts;
  opts.backward_prefetch = false;
  for (auto& m : {net->t1, net->t2, net->t3, net->head_a, net->head_b})
    fully_shard(m, dp_mesh(), opts);
  auto root = fully_shard(net, dp_mesh(), opts);
  root->set_reshard_after_backward(!keep_gathered);
  train_against_reference(*ref, *net, loss_of, 3);
}

INSTANTIATE_TEST_SUITE_P(FSDPSchedule, GroupWithGradientsOnSomeRanksOnly, ::testing::Bool(),
                         [](const auto& info) {
                           return info.param ? "KeptGatheredAfterBackward" : "Default";
                         });

// A group used twice in one forward, as PyTorch's FSDP2 allows: both uses must add to its
// gradients. `mode` 0: blk(blk(stem(x))); 1: blk(h) + blk(h) on one input; 2: blk(blk(x)) on an
// input that needs no gradient.
class Reuse : public Module {
 public:
  explicit Reuse(int mode) : Module("Reuse"), mode_(mode) {
    Generator gen(33);
    stem = std::make_shared<Linear>(6, 6, true, gen);
    blk = std::make_shared<Linear>(6, 6, true, gen);
    head = std::make_shared<Linear>(6, 3, true, gen);
    register_module("stem", stem);
    register_module("blk", blk);
    register_module("head", head);
  }
  Tensor forward(const Tensor& x) override {
    Tensor h;
    if (mode_ == 0) h = (*blk)(silu((*blk)((*stem)(x))));
    if (mode_ == 1) {
      Tensor s = (*stem)(x);
      h = add((*blk)(s), silu((*blk)(s)));
    }
    if (mode_ == 2) h = (*blk)(silu((*blk)(x)));
    return (*head)(h);
  }
  std::shared_ptr<Linear> stem, blk, head;

 private:
  int mode_;
};

TEST(FSDPSchedule, GroupUsedTwiceInOneForwardGetsBothGradients) {
  for (int mode = 0; mode < 3; ++mode) {
    for (bool reshard : {true, false}) {
      auto ref = std::make_shared<Reuse>(mode);
      auto net = std::make_shared<Reuse>(mode);
      FSDPOptions opts;
      opts.reshard_after_forward = reshard;
      fully_shard(net->blk, dp_mesh(), opts);
      fully_shard(net->head, dp_mesh(), opts);
      fully_shard(net, dp_mesh(), opts);
      SGD ref_opt(ref->parameters(), SGDOptions{.lr = 0.1});
      SGD opt(net->parameters(), SGDOptions{.lr = 0.1});
      for (int s = 0; s < 2; ++s) {
        Generator gen(uint64_t(700 + s));  // the same batch on every rank
        Tensor x = randn({4, 6}, gen);
        backward(mean(square((*ref)(x))));
        ref_opt.step();
        ref_opt.zero_grad();
        backward(mean(square((*net)(x))));
        opt.step();
        opt.zero_grad();
      }
      const auto got = net->state_dict();
      for (const auto& [name, t] : ref->state_dict())
        tessera::testing::expect_close(got.at(name), t, 1e-5,
                                       "mode " + std::to_string(mode) + ", reshard_after_forward " +
                                           std::to_string(reshard) + ": " + name);
    }
  }
}

// unshard() called by the user between forward and backward gathers into the leaves the graph
// saved (their bytes were released after forward), not into fresh ones the graph never sees.
TEST(FSDPSchedule, UnshardBetweenForwardAndBackwardKeepsTheSavedWeights) {
  for (bool async : {false, true}) {
    auto ref = std::make_shared<Reuse>(0);
    auto net = std::make_shared<Reuse>(0);
    auto blk = fully_shard(net->blk, dp_mesh());
    fully_shard(net, dp_mesh());
    Generator gen(71);
    Tensor x = randn({4, 6}, gen);
    backward(mean(square((*ref)(x))));
    Tensor loss = mean(square((*net)(x)));
    EXPECT_FALSE(blk->is_unsharded()) << "resharded after forward";
    blk->unshard(async);
    backward(loss);
    tessera::testing::expect_close(net->blk->weight.grad_dtensor().full_tensor(),
                                   ref->blk->weight.grad(), 1e-6,
                                   async ? "async unshard" : "unshard");
  }
}

// unshard(async_op)'s handle, as PyTorch's UnshardHandle: wait() finishes the all-gather and
// unshards the parameters, and the forward then gathers nothing for the group; a wait() after
// the forward used the all-gather, or a second wait(), does nothing (no communication at all).
TEST(FSDPSchedule, UnshardHandleWaitsForItsOwnGatherOnly) {
  auto net = std::make_shared<Reuse>(0);
  auto blk = fully_shard(net->blk, dp_mesh());
  fully_shard(net, dp_mesh());
  Generator gen(73);
  Tensor x = randn({4, 6}, gen);
  auto ops = [] {
    int64_t n = 0;
    for (const auto& [op, count] : comm_op_counts())
      n += count;
    return n;
  };
  auto expect_no_communication = [&](UnshardHandle& handle, const std::string& what) {
    const int64_t before = ops();
    handle.wait();
    EXPECT_EQ(ops(), before) << what;
  };
  auto gathers_of_a_step = [&](const std::function<void()>& before_forward,
                               const std::function<void()>& after_forward) {
    reset_comm_op_counts();
    before_forward();
    Tensor loss = mean(square((*net)(x)));
    after_forward();
    backward(loss);
    return comm_op_counts()["all_gather_runs"];
  };
  const int64_t plain = gathers_of_a_step([] {}, [] {});
  UnshardHandle handle;
  const int64_t waited_before = gathers_of_a_step(
      [&] {
        handle = blk->unshard(/*async_op=*/true);
        EXPECT_FALSE(blk->is_unsharded());
        handle.wait();
        EXPECT_TRUE(blk->is_unsharded());
        const Tensor gathered = net->blk->weight.local().clone();
        EXPECT_EQ(gathered.shape(), (Shape{6, 6}));
        tessera::testing::expect_close(gathered, net->blk->weight.full(), 0, "waited weight");
        expect_no_communication(handle, "a second wait()");
      },
      [] {});
  EXPECT_EQ(waited_before, plain) << "wait() before the forward";
  const int64_t waited_after =
      gathers_of_a_step([&] { handle = blk->unshard(/*async_op=*/true); },
                        [&] { expect_no_communication(handle, "wait() after the forward"); });
  EXPECT_EQ(waited_after, plain) << "wait() after the forward used the all-gather";
}

// A frozen group between trainable ones has nothing to reduce, but must not hold back the
// reduce-scatters after it in backward order: the block below it reduces, and frees its gathered
// weights, as soon as its own backward is done, not at the end of backward.
class FrozenMiddle : public Module {
 public:
  FrozenMiddle() : Module("FrozenMiddle") {
    Generator gen(41);
    stem = std::make_shared<Linear>(6, 6, true, gen);
    low = std::make_shared<Linear>(6, 6, true, gen);
    frozen = std::make_shared<Linear>(6, 6, true, gen);
    high = std::make_shared<Linear>(6, 6, true, gen);
    register_module("stem", stem);
    register_module("low", low);
    register_module("frozen", frozen);
    register_module("high", high);
    for (Parameter* p : frozen->parameters())
      p->set_requires_grad(false);
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*stem)(x);
    // Runs once `low`'s backward is done (its own input-gradient hook goes first).
    register_hook(h, [this](const Tensor&) {
      low_unsharded_after_its_backward = low_state->is_unsharded();
      return Tensor();
    });
    return (*high)(silu((*frozen)(silu((*low)(h)))));
  }
  std::shared_ptr<Linear> stem, low, frozen, high;
  std::shared_ptr<FSDPState> low_state;
  bool low_unsharded_after_its_backward = true;
};

TEST(FSDPSchedule, FrozenGroupDoesNotHoldBackTheReducesAfterIt) {
  auto net = std::make_shared<FrozenMiddle>();
  net->low_state = fully_shard(net->low, dp_mesh());
  fully_shard(net->frozen, dp_mesh());
  fully_shard(net->high, dp_mesh());
  fully_shard(net, dp_mesh());
  Generator gen(9);
  Tensor x = randn({4, 6}, gen);
  backward(mean(square((*net)(x))));
  EXPECT_FALSE(net->low_unsharded_after_its_backward)
      << "the group below the frozen one kept its gathered weights after its backward";
  EXPECT_TRUE(net->low->weight.grad().defined());
}

// A stem (the root's), a trunk of two blocks and two heads, each block and head its own group.
// Every rank runs every forward, but rank r's loss uses head 0 only (r % 4 == 0), head 1 only
// (1), both (2) or neither (3): the ranks skip different groups, and the first group in
// reduce-scatter order (head 1) is one some ranks skip.
class TwoHeads : public Module {
 public:
  TwoHeads() : Module("TwoHeads") {
    Generator gen(33);
    stem = std::make_shared<Linear>(5, 8, true, gen);
    block0 = std::make_shared<Linear>(8, 8, true, gen);
    block1 = std::make_shared<Linear>(8, 8, true, gen);
    head0 = std::make_shared<Linear>(8, 3, true, gen);
    head1 = std::make_shared<Linear>(8, 7, true, gen);
    register_module("stem", stem);
    register_module("block0", block0);
    register_module("block1", block1);
    register_module("head0", head0);
    register_module("head1", head1);
  }
  Tensor forward(const Tensor& x) override {
    return silu((*block1)(silu((*block0)(silu((*stem)(x))))));
  }
  std::shared_ptr<Linear> stem, block0, block1, head0, head1;
};

Tensor two_heads_loss(TwoHeads& net, int rank, int step) {
  Generator gen(uint64_t(900 + 13 * step + rank));
  Tensor h = net(randn({4, 5}, gen));
  Tensor a = mean(square((*net.head0)(h)));  // both heads run forward on every rank
  Tensor b = mean(square((*net.head1)(h)));
  switch (rank % 4) {
    case 0:
      return a;
    case 1:
      return b;
    case 2:
      return add(a, b);
    default:
      return mean(square(h));
  }
}

// Each step's gradients against one process holding every rank's loss (their mean), then the
// step itself; on (replicate, shard) meshes too, where the heads differ across replicas.
void expect_skipped_groups_match_reference(const DeviceMesh& mesh) {
  auto ref = std::make_shared<TwoHeads>();
  AdamW ref_opt(ref->parameters(), AdamWOptions{.lr = 1e-2});
  auto net = std::make_shared<TwoHeads>();
  for (auto& m : {net->block0, net->block1, net->head0, net->head1})
    fully_shard(m, mesh);
  fully_shard(net, mesh);
  AdamW opt(net->parameters(), AdamWOptions{.lr = 1e-2});
  for (int s = 0; s < 3; ++s) {
    Tensor total;
    for (int r = 0; r < world_size(); ++r) {
      Tensor l = two_heads_loss(*ref, r, s);
      total = total.defined() ? add(total, l) : l;
    }
    backward(mul(total, 1.0 / world_size()));
    backward(two_heads_loss(*net, world_rank(), s));
    auto want = ref->named_parameters();
    auto got = net->named_parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const std::string what = "step " + std::to_string(s) + ", grad of " + got[i].first;
      // Undefined exactly where no rank's loss reached the parameter.
      ASSERT_EQ(got[i].second->grad().defined(), want[i].second->grad().defined()) << what;
      if (!want[i].second->grad().defined()) continue;
      auto g = got[i].second->grad_dtensor().full_tensor().to_vector<double>();
      auto w = want[i].second->grad().to_vector<double>();
      ASSERT_EQ(g.size(), w.size()) << what;
      for (size_t k = 0; k < g.size(); ++k)
        EXPECT_NEAR(g[k], w[k], 1e-6 * (1 + std::abs(w[k]))) << what << " element " << k;
    }
    ref_opt.step();
    ref_opt.zero_grad();
    opt.step();
    opt.zero_grad();
  }
  const auto got = net->state_dict(), want = ref->state_dict();
  for (const auto& [name, t] : want) {
    auto g = got.at(name).to_vector<double>(), w = t.to_vector<double>();
    for (size_t i = 0; i < g.size(); ++i)
      EXPECT_NEAR(g[i], w[i], 1e-5) << name << " element " << i;
  }
}

TEST(FSDPSchedule, RanksSkippingDifferentGroupsMatchOneProcess) {
  expect_skipped_groups_match_reference(dp_mesh());
  if (world_size() == 4)
    expect_skipped_groups_match_reference(DeviceMesh(Shape{2, 2}, {"replicate", "shard"}));
}

}  // namespace
