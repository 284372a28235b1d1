// FSDP's errors in the middle of a step (an optimizer step during backward, a second backward
// through one forward, a backward that throws) and the lifetime of its state: it goes with the
// model. One test binary with test_fsdp_schedule.cpp.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "dist/fsdp_parity.h"
#include "dist/fsdp_tiny_decoder.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/tessera.h"
#include "tessera/testing.h"

using namespace tessera;
using namespace tessera::fsdp_test;
using tessera::testing::expect_error;

namespace {

TEST(FSDPSchedule, OptimizerDuringBackwardIsAnError) {
  auto net = std::make_shared<Decoder>(tiny_config());
  for (auto& block : net->layers)
    fully_shard(block, dp_mesh());
  fully_shard(net, dp_mesh());
  AdamW opt(net->parameters(), {});
  auto [ids, targets] = tokens(0);
  // Runs when backward reaches the first block's output: the later blocks' reduce-scatters are
  // in flight, the first block's and the root's are not issued yet.
  bool armed = true;
  net->layers[0]->register_forward_hook([&](Module&, const Tensor&, const Tensor& y) {
    if (armed)
      register_hook(y, [&](const Tensor&) {
        opt.step();
        return Tensor();
      });
    return Tensor();
  });
  Tensor logits = (*net)(ids);
  armed = false;
  expect_error([&] { backward(cross_entropy(logits, targets)); },
               {"AdamW.step", "still waiting for FSDP's reduce-scatter", "after backward()"});
  // The failed backward left collectives and unsharded groups behind; the next step cleans up
  // and trains normally.
  for (int again = 0; again < 2; ++again) {
    backward(cross_entropy((*net)(ids), targets));
    for (Parameter* p : net->parameters()) {
      EXPECT_FALSE(p->grad_pending());
      EXPECT_TRUE(p->grad().defined());
      EXPECT_FALSE(p->is_unsharded());
    }
    opt.step();
    opt.zero_grad();
  }

  auto net2 = std::make_shared<Decoder>(tiny_config());
  fully_shard(net2, dp_mesh());
  std::vector<Parameter*> params = net2->parameters();
  Tensor logits2 = (*net2)(ids);
  register_hook(logits2, [&](const Tensor&) {
    clip_grad_norm_(params, 1.0);
    return Tensor();
  });
  expect_error([&] { backward(cross_entropy(logits2, targets)); },
               {"clip_grad_norm_", "still waiting"});
}

// A backward that throws while micro-batches accumulate without sync drops the sums whole: the
// groups whose backward ended before the throw used to keep part of the failed micro-batch, the
// others none. The next synced micro-batch then gives what it gives alone.
TEST(FSDPSchedule, AThrowingBackwardDropsTheUnsyncedSums) {
  auto build = [] {
    auto net = std::make_shared<Decoder>(tiny_config());
    for (auto& block : net->layers)
      fully_shard(block, dp_mesh());
    return std::make_pair(net, fully_shard(net, dp_mesh()));
  };
  auto [net, state] = build();
  state->set_requires_gradient_sync(false);
  backward(cross_entropy((*net)(tokens(0).first), tokens(0).second));
  // Throws when backward reaches the first block's output: the later blocks are done.
  bool armed = true;
  net->layers[0]->register_forward_hook([&](Module&, const Tensor&, const Tensor& y) {
    if (armed) register_hook(y, [](const Tensor&) -> Tensor { throw Error("a user hook failed"); });
    return Tensor();
  });
  Tensor logits = (*net)(tokens(1).first);
  armed = false;
  expect_error([&] { backward(cross_entropy(logits, tokens(1).second)); }, {"a user hook failed"});
  state->set_requires_gradient_sync(true);
  backward(cross_entropy((*net)(tokens(2).first), tokens(2).second));

  auto [ref, ref_state] = build();
  backward(cross_entropy((*ref)(tokens(2).first), tokens(2).second));
  const auto want = ref->named_parameters();
  for (const auto& [name, p] : net->named_parameters()) {
    const Parameter* r = nullptr;
    for (const auto& [n, q] : want)
      if (n == name) r = q;
    ASSERT_NE(r, nullptr) << name;
    tessera::testing::expect_close(p->grad(), r->grad(), 1e-6, name);
  }
}

TEST(FSDPSchedule, SecondBackwardThroughOneForwardIsAnError) {
  auto net = std::make_shared<Decoder>(tiny_config());
  for (auto& block : net->layers)
    fully_shard(block, dp_mesh());
  fully_shard(net, dp_mesh());
  auto [ids, targets] = tokens(0);
  Tensor loss = cross_entropy((*net)(ids), targets);
  backward(loss, {}, /*retain_graph=*/true);
  expect_error([&] { backward(loss); },
               {"fully_shard(Decoder)", "second backward through the same forward"});
  // The model is still usable.
  backward(cross_entropy((*net)(ids), targets));
  for (Parameter* p : net->parameters())
    EXPECT_TRUE(p->grad().defined());
}

// A trainable input kept across steps (an input being optimised, a learned prompt) passed to a
// frozen group that also runs, before it, on a computed tensor. Each forward's hook that marks
// the end of a group's backward (its input's gradient) stays with that forward's graph: on the
// kept tensor itself, every step added one more, and from the second step on they ended the
// frozen group's backward at the kept input's gradient, freeing its weights before its first
// use's backward read them.
class FrozenTwiceOnKeptInput : public Module {
 public:
  FrozenTwiceOnKeptInput() : Module("FrozenTwiceOnKeptInput") {
    Generator gen(43);
    stem = std::make_shared<Linear>(6, 6, true, gen);
    frozen = std::make_shared<Linear>(6, 6, true, gen);
    head = std::make_shared<Linear>(6, 3, true, gen);
    register_module("stem", stem);
    register_module("frozen", frozen);
    register_module("head", head);
    for (Parameter* p : frozen->parameters())
      p->set_requires_grad(false);
    z_ = randn({4, 6}, gen);
  }
  // The kept input's gradient node is made by its first use, the frozen group's second: the
  // engine runs it (and its hooks) before the first use's backward.
  Tensor forward(const Tensor& x) override {
    Tensor first = (*frozen)(silu((*stem)(z_)));
    Tensor second = (*frozen)(x);
    return (*head)(add(first, second));
  }
  std::shared_ptr<Linear> stem, frozen, head;

 private:
  Tensor z_;
};

TEST(FSDPLifetime, KeptInputCarriesNoHookOfEarlierSteps) {
  auto net = std::make_shared<FrozenTwiceOnKeptInput>();
  auto ref = std::make_shared<FrozenTwiceOnKeptInput>();
  fully_shard(net->frozen, dp_mesh());
  fully_shard(net, dp_mesh());
  Generator gen(45);
  Tensor x = randn({4, 6}, gen).set_requires_grad(true);
  Tensor x_ref = x.detach().clone().set_requires_grad(true);
  auto hooks_on = [](const Tensor& t) {
    const AutogradMeta* m = t.autograd_meta_if_exists();
    return m ? m->grad_hooks.size() : size_t(0);
  };
  for (int step = 0; step < 3; ++step) {
    x.set_grad(Tensor());
    x_ref.set_grad(Tensor());
    backward(mean(square((*net)(x))));
    backward(mean(square((*ref)(x_ref))));
    const std::string what = "step " + std::to_string(step);
    EXPECT_EQ(hooks_on(x), 0u) << what;
    tessera::testing::expect_close(x.grad(), x_ref.grad(), 1e-6, what + ": input gradient");
    tessera::testing::expect_close(net->stem->weight.grad_dtensor().full_tensor(),
                                   ref->stem->weight.grad(), 1e-6, what + ": stem gradient");
    net->zero_grad();
    ref->zero_grad();
  }
}

// A long-running program shards and drops models: each dropped model's groups go with it (the
// module's hooks own them), a handle that outlives its model keeps only its own groups, and a
// new model, wherever it is allocated, is sharded afresh.
TEST(FSDPLifetime, DroppedModelsLeaveNothingBehind) {
  auto [ids, targets] = tokens(0);
  auto step = [&] {
    auto net = std::make_shared<Decoder>(tiny_config());
    std::shared_ptr<FSDPState> root;
    for (auto& block : net->layers)
      fully_shard(block, dp_mesh());
    root = fully_shard(net, dp_mesh());
    backward(cross_entropy((*net)(ids), targets));
    EXPECT_TRUE(is_fully_sharded(net->tok_embeddings->weight));
    return root;
  };
  step();  // first use: whatever is made once (FSDP's communicators) exists from here on
  const int64_t baseline = memory_stats().current_bytes;
  std::shared_ptr<FSDPState> kept = step();
  const int64_t with_kept = memory_stats().current_bytes;
  EXPECT_GE(with_kept, baseline + int64_t(kept->flat_buffer().nbytes()));
  for (int i = 0; i < 10; ++i)
    step();
  EXPECT_EQ(memory_stats().current_bytes, with_kept);
  expect_error([&] { kept->unshard(); }, {"FSDPState::unshard", "module was destroyed"});
  kept.reset();
  EXPECT_EQ(memory_stats().current_bytes, baseline);
}

// Models dropped on other threads while this one asks whether a live model's parameter is
// sharded: the registry of live groups is shared by all threads.
TEST(FSDPLifetime, ModelsDroppedOnOtherThreads) {
  auto shard = [] {
    auto net = std::make_shared<Decoder>(tiny_config());
    for (auto& block : net->layers)
      fully_shard(block, dp_mesh());  // collective: on this thread
    fully_shard(net, dp_mesh());
    return net;
  };
  auto keeper = shard();
  std::vector<std::shared_ptr<Decoder>> nets;
  for (int i = 0; i < 8; ++i)
    nets.push_back(shard());
  std::vector<std::thread> droppers;
  for (auto& n : nets)
    droppers.emplace_back([m = std::move(n)]() mutable { m.reset(); });
  int sharded = 0;
  for (int i = 0; i < 200; ++i)
    sharded += is_fully_sharded(keeper->layers[0]->attention->wq->weight) ? 1 : 0;
  for (auto& t : droppers)
    t.join();
  EXPECT_EQ(sharded, 200);
  EXPECT_TRUE(is_fully_sharded(keeper->norm->weight));
}

// Host memory that claims to be a GPU's: enough to build a tensor on another device here.
class FakeCudaAllocator final : public Allocator {
 public:
  void* allocate(size_t n) override { return std::malloc(n == 0 ? 1 : n); }
  void deallocate(void* p, size_t) override { std::free(p); }
  Device device() const override { return Device::cuda(0); }
};

class OnDevice : public Module {
 public:
  OnDevice() : Module("OnDevice") {
    w = Parameter(empty({4, 4}, TensorOptions(DType::Float32, Device::cuda(0))));
    register_parameter("w", &w);
  }
  Tensor forward(const Tensor& x) override { return x; }
  Parameter w;
};

TEST(FSDPSchedule, ParameterOnAnotherDeviceIsAnError) {
  FakeCudaAllocator fake;
  Allocator* previous = set_allocator(DeviceType::CUDA, &fake);
  {
    auto m = std::make_shared<OnDevice>();
    expect_error([&] { fully_shard(m, dp_mesh()); },
                 {"fully_shard(OnDevice)", "parameter 'w'", "cuda:0", "holds its shards on cpu"});
  }
  set_allocator(DeviceType::CUDA, previous);
}

}  // namespace
