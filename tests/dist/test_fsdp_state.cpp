// fully_shard's state: the sharded state dict and its loading into other layouts, micro-batches,
// tied weights, what stays gathered, misuse (writes to the shards between forward and backward
// are in test_fsdp_writes.cpp). One test binary with test_fsdp.cpp, test_fsdp_precision.cpp and
// test_fsdp_writes.cpp, whose helpers it shares (fsdp_parity.h, fsdp_mlp.h).
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "dist/fsdp_mlp.h"
#include "dist/fsdp_parity.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::fsdp_test;
using tessera::testing::expect_close;
using tessera::testing::expect_error;

namespace {

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
  // A dict that is wrong on the last rank only stops every rank (the others went on into the
  // collectives of the load and waited there), and nothing is written.
  if (world_size() > 1) {
    const int last = world_size() - 1;
    auto partly = sharded;
    if (world_rank() == last) partly.erase("norm.weight");
    expect_error([&] { fsdp->load_sharded_state_dict(partly); },
                 {"load_sharded_state_dict into Decoder", "[rank " + std::to_string(last) + "]",
                  "missing keys: norm.weight"});
    check_loaded(*fsdp, "after a load refused on one rank");
  }
}

// HSDP micro-batches with set_requires_all_reduce(false) but on the last: each backward
// reduce-scatters within its replica, no all-reduce crosses replicas until the last, which then
// sets the stored gradients to what all-reducing every micro-batch gives (to float32 rounding:
// the sums are added in another order).
TEST(FullyShard, HsdpMicroBatchesAllReduceAcrossReplicasOnce) {
  if (world_size() != 4 && world_size() != 8) GTEST_SKIP() << "HSDP runs on 4 or 8 ranks";
  DeviceMesh mesh(Shape{2, world_size() / 2}, {"replicate", "shard"});
  constexpr int kMicro = 3;
  constexpr int64_t kGroups = 3;  // b0, b1 and the root's head
  auto grads = [&](bool all_reduce_each) {
    auto net = std::make_shared<Mlp>();
    fully_shard(net->b0, mesh);
    fully_shard(net->b1, mesh);
    auto root = fully_shard(net, mesh);
    for (int m = 0; m < kMicro; ++m) {
      const bool last = m == kMicro - 1;
      root->set_requires_all_reduce(all_reduce_each || last);
      Generator gen(uint64_t(500 + 31 * m + world_rank()));
      Tensor x = randn({4, 16}, gen), t = randn({4, 5}, gen);
      Tensor loss = mean(square(sub((*net)(x), t)));
      reset_comm_op_counts();
      backward(loss);
      auto counts = comm_op_counts();
      EXPECT_EQ(counts["reduce_scatter_tensor"], kGroups) << "micro-batch " << m;
      EXPECT_EQ(counts["all_reduce"], all_reduce_each || last ? kGroups : 0) << "micro-batch " << m;
      if (!all_reduce_each && !last) {
        for (Parameter* p : net->parameters())
          EXPECT_FALSE(p->grad().defined()) << "stored gradients set before the all-reduce";
      }
    }
    std::map<std::string, Tensor> out;
    for (auto& [name, p] : net->named_parameters())
      out[name] = p->grad_dtensor().full_tensor();
    return out;
  };
  const auto each = grads(true), once = grads(false);
  for (const auto& [name, want] : each)
    expect_close(once.at(name), want, 1e-5, name);

  // Freezing a parameter while sums wait is an error on every rank, which drops them: the next
  // backward's gradients are its own.
  auto net = std::make_shared<Mlp>();
  fully_shard(net->b0, mesh);
  fully_shard(net->b1, mesh);
  auto root = fully_shard(net, mesh);
  Generator gen(uint64_t(900 + world_rank()));
  const Tensor x = randn({4, 16}, gen);
  root->set_requires_all_reduce(false);
  backward(mean(square((*net)(x))));
  // b1 is the first group in backward order: refused before any collective of this backward.
  net->b1->fc1->bias.set_requires_grad(false);
  expect_error([&] { backward(mean(square((*net)(x)))); },
               {"which parameters require gradients changed"});
  net->b1->fc1->bias.set_requires_grad(true);
  root->set_requires_all_reduce(true);
  backward(mean(square((*net)(x))));
  std::map<std::string, Tensor> after_error;
  for (auto& [name, p] : net->named_parameters()) {
    after_error[name] = p->grad_dtensor().full_tensor();
    p->zero_grad();
  }
  backward(mean(square((*net)(x))));
  for (auto& [name, p] : net->named_parameters())
    expect_close(after_error.at(name), p->grad_dtensor().full_tensor(), 1e-6,
                 "after the error, one backward's gradient: " + name);
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

// Two layers whose weight is one tensor, tied by assignment (`b->weight = a->weight`).
struct TiedPair : Module {
  std::shared_ptr<Linear> a, b;
  TiedPair() : Module("TiedPair") {
    Generator g(21);
    a = std::make_shared<Linear>(4, 4, false, g);
    b = std::make_shared<Linear>(4, 4, false, g);
    b->weight = a->weight;
    register_module("a", a);
    register_module("b", b);
  }
  Tensor forward(const Tensor& x) override { return (*b)(relu((*a)(x))); }
};

// Trains the pair with SGD on `rows` rows from `first` of a batch of 4 per rank; returns the
// final weight.
Tensor train_tied_pair(const std::shared_ptr<TiedPair>& m, int64_t first, int64_t rows) {
  SGD opt(m->parameters(), {.lr = 0.1});
  Generator g(22);
  const Tensor x_all = randn({4 * int64_t(world_size()), 4}, g);
  const Tensor x = kernels::narrow(x_all, 0, first, rows);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    Tensor y = (*m)(x);
    backward(mean(mul(y, y)));
    opt.step();
  }
  return m->a->weight.full();
}

// A tie within one fully_shard call holds: both slots share the sharded parameter, and training
// matches one process training the tied pair.
// autograd::grad through a sharded model (an input's gradient, say) gathers what its backward
// needs and accumulates nothing: it equals the unsharded model's, and training afterwards is as
// if it had not been called.
TEST(FullyShard, AutogradGradThroughAShardedModelLeavesTrainingAsItWas) {
  DeviceMesh mesh = dp_mesh();
  const int64_t n = kBatch / world_size(), row = mesh.local_rank(0) * n;
  Generator gen(5);
  Tensor x = kernels::narrow(randn({kBatch, 16}, gen), 0, row, n).contiguous();
  auto input_gradient = [&](Module& m) {
    Tensor xi = x.clone().set_requires_grad(true);
    std::vector<Tensor> g = autograd::grad({sum(square(m(xi)))}, {xi});
    return g[0];
  };
  auto ref = std::make_shared<Mlp>();
  const Tensor want = input_gradient(*ref);
  auto net = std::make_shared<Mlp>();
  fully_shard(net->b0, mesh);
  fully_shard(net->b1, mesh);
  fully_shard(net, mesh);
  expect_close(input_gradient(*net), want, 1e-5, "input gradient");
  for (Parameter* p : net->parameters())
    EXPECT_FALSE(p->grad().defined());
  const std::vector<double> want_losses = train_mlp(ref, 3, 0, 1);
  const std::vector<double> got = train_mlp(net, 3, mesh.local_rank(0), world_size());
  for (size_t s = 0; s < want_losses.size(); ++s)
    EXPECT_NEAR(got[s], want_losses[s], 1e-5 * want_losses[s]) << "step " << s;
}

TEST(FullyShard, WeightsTiedByAssignmentStayTied) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<TiedPair>();
  fully_shard(net, mesh);
  EXPECT_TRUE(net->a->weight.stored().is_same(net->b->weight.stored()));
  EXPECT_EQ(net->parameters().size(), 1u);
  const Tensor got = train_tied_pair(net, 4 * mesh.local_rank(0), 4);
  EXPECT_TRUE(net->a->weight.stored().is_same(net->b->weight.stored()));
  // The reference sees every rank's rows: the mean over them is the mean of the ranks' means.
  const Tensor want = train_tied_pair(std::make_shared<TiedPair>(), 0, 4 * int64_t(world_size()));
  expect_close(got, want, 1e-6, "tied weight after 3 steps");
  // Tied across two calls (one slot inside a module sharded on its own): refused, naming both
  // slots, rather than sharding the other slot as a second parameter.
  auto split = std::make_shared<TiedPair>();
  fully_shard(split->a, mesh);
  expect_error([&] { fully_shard(split, mesh); },
               {"fully_shard(TiedPair): parameter 'b.weight' holds the tensor that "
                "fully_shard(Linear) sharded as 'weight'",
                "shard both uses in one call"});
}

// set_reshard_after_backward(false): after each backward the groups stay gathered, so each
// micro-batch after the first gathers only what reshard_after_forward freed (the blocks'
// backward gathers), and the forward after an optimizer step, which wrote the shards, gathers
// again. Losses and parameters are those of the default run, bit for bit.
TEST(FullyShard, ReshardAfterBackwardOffKeepsGroupsGatheredAcrossMicroBatches) {
  DeviceMesh mesh = dp_mesh();
  constexpr int kSteps = 2, kMicro = 3;
  struct Run {
    std::vector<double> losses;
    std::vector<int64_t> gathers;  // per micro-batch
    std::map<std::string, Tensor> params;
  };
  auto run = [&](bool keep) {
    auto net = std::make_shared<Mlp>();
    auto b0 = fully_shard(net->b0, mesh), b1 = fully_shard(net->b1, mesh);
    auto root = fully_shard(net, mesh);
    root->set_reshard_after_backward(!keep);
    SGD opt(net->parameters(), SGDOptions{.lr = 0.1});
    Run out;
    int64_t before = 0;
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      for (int m = 0; m < kMicro; ++m) {
        root->set_requires_gradient_sync(m == kMicro - 1);
        Generator gen(uint64_t(700 + 13 * (s * kMicro + m) + world_rank()));
        Tensor x = randn({4, 16}, gen), t = randn({4, 5}, gen);
        Tensor loss = mean(square(sub((*net)(x), t)));
        backward(loss);
        out.losses.push_back(world_mean(loss.item<float>()));
        EXPECT_EQ(root->is_unsharded() && b0->is_unsharded() && b1->is_unsharded(), keep);
        const int64_t now = b0->comm_stats().all_gathers + b1->comm_stats().all_gathers +
                            root->comm_stats().all_gathers;
        out.gathers.push_back(now - before);
        before = now;
      }
      opt.step();
    }
    for (auto& [name, p] : net->named_parameters())
      out.params[name] = p->stored().clone();
    return out;
  };
  const Run want = run(false), got = run(true);
  EXPECT_EQ(got.losses, want.losses);
  for (const auto& [name, t] : want.params)
    expect_close(got.params.at(name), t, 0, name);
  // Default: 3 forward gathers and 2 backward ones (the root keeps its own) per micro-batch.
  EXPECT_EQ(want.gathers, std::vector<int64_t>(kSteps * kMicro, 5));
  // Kept: the first micro-batch of each step gathers all 5 (the step wrote the shards), the
  // others the blocks' backward gathers only.
  EXPECT_EQ(got.gathers, (std::vector<int64_t>{5, 2, 2, 5, 2, 2}));
}

// Kept gathered across backwards, a group's leaves follow requires_grad: leaves made while a
// parameter was frozen would give it no gradient once unfrozen, and the other way round.
TEST(FullyShard, KeptGatheredLeavesFollowRequiresGrad) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Mlp>();
  fully_shard(net->b0, mesh);
  fully_shard(net->b1, mesh);
  auto root = fully_shard(net, mesh);
  root->set_reshard_after_backward(false);
  Generator gen(uint64_t(40 + world_rank()));
  const Tensor x = randn({4, 16}, gen);
  auto step = [&] {
    for (Parameter* p : net->parameters())
      p->zero_grad();
    backward(mean(square((*net)(x))));
  };
  std::vector<Parameter*> toggled = {&net->head->bias, &net->b0->fc1->weight};
  for (Parameter* p : toggled)
    p->set_requires_grad(false);
  step();  // the leaves are made with these frozen, and kept
  ASSERT_TRUE(root->is_unsharded());
  for (Parameter* p : toggled)
    EXPECT_FALSE(p->grad().defined()) << "a frozen parameter got a gradient";
  EXPECT_TRUE(net->head->weight.grad().defined());
  for (Parameter* p : toggled)
    p->set_requires_grad(true);
  step();
  for (Parameter* p : toggled)
    EXPECT_TRUE(p->grad().defined()) << "an unfrozen parameter got no gradient";
  for (Parameter* p : toggled)
    p->set_requires_grad(false);
  step();
  for (Parameter* p : toggled)
    EXPECT_FALSE(p->grad().defined()) << "a frozen parameter got a gradient";
}

// PyTorch's set_reshard_after_forward: off (recursively, the root's own included), a loop of
// no_grad forwards gathers once; on for the root itself, the root reshards after a forward with
// grad too. Training afterwards is unaffected.
TEST(FullyShard, SetReshardAfterForwardReachesNoGradForwardsAndTheRoot) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Mlp>();
  auto b0 = fully_shard(net->b0, mesh), b1 = fully_shard(net->b1, mesh);
  auto root = fully_shard(net, mesh);
  Generator gen(5);
  const Tensor x = randn({4, 16}, gen);
  auto gathers = [&] {
    return b0->comm_stats().all_gathers + b1->comm_stats().all_gathers +
           root->comm_stats().all_gathers;
  };
  root->set_reshard_after_forward(false);  // recurse: the blocks too
  {
    NoGradGuard no_grad;
    const Tensor first = (*net)(x);
    const int64_t after_first = gathers();
    EXPECT_TRUE(b0->is_unsharded() && b1->is_unsharded() && root->is_unsharded());
    expect_close((*net)(x), first, 0, "second no_grad forward");
    EXPECT_EQ(gathers(), after_first) << "the second no_grad forward gathered again";
  }
  for (auto& s : {b0, b1, root})
    s->reshard();
  root->set_reshard_after_forward(true, /*recurse=*/false);
  Tensor loss = mean(square((*net)(x)));
  EXPECT_FALSE(root->is_unsharded()) << "the root was told to reshard after forward";
  EXPECT_TRUE(b0->is_unsharded()) << "recurse = false left the blocks as they were";
  backward(loss);
  for (auto& [name, p] : net->named_parameters())
    EXPECT_TRUE(p->grad().defined()) << name;
  for (auto& s : {b0, b1, root})
    EXPECT_FALSE(s->is_unsharded());
}

// set_gradient_divide_factor(1): the gradients are summed over the ranks, not averaged.
TEST(FullyShard, GradientDivideFactorReplacesTheAverage) {
  Generator gen(5);
  const Tensor x = randn({4, 16}, gen);
  auto grads = [&](std::optional<double> factor) {
    auto net = std::make_shared<Mlp>();
    auto state = fully_shard(net, dp_mesh());
    if (factor) state->set_gradient_divide_factor(*factor);
    backward(mean(square((*net)(x))));
    std::map<std::string, Tensor> out;
    for (auto& [name, p] : net->named_parameters())
      out[name] = p->grad_dtensor().full_tensor();
    return out;
  };
  const auto mean_grads = grads(std::nullopt), sum_grads = grads(1.0);
  for (const auto& [name, g] : mean_grads)
    expect_close(sum_grads.at(name), mul(g, double(world_size())), 1e-6, name);
  auto net = std::make_shared<Mlp>();
  expect_error([&] { fully_shard(net, dp_mesh())->set_gradient_divide_factor(0); },
               "set_gradient_divide_factor: 0 is not a positive finite number");
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

// Float32 parameters, then a bfloat16 0-dimensional scale: two dtype groups, the second refused.
class ScaledLinear : public Module {
 public:
  ScaledLinear() : Module("ScaledLinear") {
    Generator gen(13);
    offset = Parameter(full({4}, 0.5));
    scale = Parameter(full({}, 2.0, DType::BFloat16));
    fc = std::make_shared<Linear>(4, 4, true, gen);
    register_parameter("offset", &offset);
    register_parameter("scale", &scale);
    register_module("fc", fc);
  }
  Tensor forward(const Tensor& x) override {
    return mul(add((*fc)(x), offset.local()), scale.local().to(x.dtype()));
  }
  Parameter offset, scale;
  std::shared_ptr<Linear> fc;
};

// fully_shard refuses a module, or changes nothing: a group refused after another dtype's was
// built left that one's parameters sharded with no hooks to gather them (the module computed on
// its shards, and a second call, after fixing the cause, found it already fully_shard'ed).
TEST(FullyShard, ARefusedCallShardsNothing) {
  auto net = std::make_shared<ScaledLinear>();
  const auto before = net->state_dict();
  expect_error([&] { fully_shard(net, dp_mesh()); },
               {"fully_shard(ScaledLinear)", "'scale'", "0-dimensional"});
  for (const auto& [name, p] : net->named_parameters()) {
    EXPECT_FALSE(p->is_dtensor()) << name;
    EXPECT_FALSE(is_fully_sharded(*p)) << name;
  }
  for (const auto& [name, t] : net->state_dict())
    expect_close(t, before.at(name), 0, name);
  // The cause removed, the module can be sharded.
  net->scale = Parameter(full({1}, 2.0, DType::BFloat16));
  auto state = fully_shard(net, dp_mesh());
  EXPECT_EQ(state->parameters().size(), 4u);
}

TEST(FullyShard, MisuseErrors) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Decoder>(small_decoder_config());
  fully_shard(net->layers[0], mesh);
  expect_error([&] { fully_shard(net->layers[0], mesh); },
               {"fully_shard", "DecoderBlock", "already fully_shard'ed"});
  expect_error([&] { fully_shard(net, mesh["nope"]); }, {"no mesh dim named 'nope'"});
  // Top-down: the root's group took the block's parameters; the block's call would make a second
  // root inside the first (an empty group of its own, out of the root's collective order).
  auto top_down = std::make_shared<Decoder>(small_decoder_config());
  fully_shard(top_down, mesh);
  for (int attempt = 0; attempt < 2; ++attempt)  // the first made no group: not "already"
    expect_error(
        [&] { fully_shard(top_down->layers[1], mesh); },
        {"fully_shard(DecoderBlock)", "inside fully_shard(Decoder)", "'layers.1'", "bottom-up"});
  // A tied table sharded on its own is resharded after the lookup, before the projection needs it.
  auto tied = std::make_shared<Decoder>(decoder_config(true));
  fully_shard(tied->tok_embeddings, mesh);
  fully_shard(tied, mesh);
  Batch b = rows_of(make_batch(0), mesh.local_rank(0), world_size());
  expect_error([&] { (*tied)(b.ids); },
               {"tie_embeddings", "tok_embeddings.weight", "fully_shard them with the decoder"});
}

}  // namespace
