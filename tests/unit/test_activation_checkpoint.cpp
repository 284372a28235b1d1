// Activation checkpointing: the same gradients as without it (dropout included, from the default
// generator, one of the caller's, one the function owns, and after a reseed), less memory held
// between forward and backward, and clear errors for a recomputation that differs, a tensor the
// region read or saved written in place (also between two backwards of a retained graph), a
// module whose state changed, and a second backward without retain_graph; nested regions;
// generators that moved, were copied or were kept by the function, hooks on the input, and no
// activations held by a retained graph.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/small_decoder.h"
#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::expect_close;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;

namespace {

struct Leaves {
  Tensor x, w1, w2;
  Leaves() {
    x = random_tensor({16, 32}, 1, DType::Float32).set_requires_grad(true);
    w1 = random_tensor({64, 32}, 2, DType::Float32).set_requires_grad(true);
    w2 = random_tensor({32, 64}, 3, DType::Float32).set_requires_grad(true);
  }
};

// An in-place write as an optimizer step or a load makes it: outside grad mode (in grad mode a
// write to a tensor that requires grad is refused).
void overwrite(const Tensor& t, double value) {
  NoGradGuard no_grad;
  Tensor(t).fill_(value);
}

// Four layers' worth of activations, two dropouts (the default generator and `gen`).
Tensor body(const Leaves& l, Generator& gen, const Tensor& x) {
  Tensor h = x;
  for (int i = 0; i < 4; ++i) {
    h = dropout(gelu(linear(h, l.w1)), 0.25, true, default_generator());
    h = tanh(linear(dropout(h, 0.1, true, gen), l.w2));
  }
  return h;
}

// The loss's gradients with respect to x, w1 and w2.
std::vector<Tensor> grads_of(const Leaves& l, bool checkpointed) {
  manual_seed(11);
  Generator gen(5);
  auto f = [&](const Tensor& in) { return body(l, gen, in); };
  for (const Tensor* t : {&l.x, &l.w1, &l.w2})
    const_cast<Tensor&>(*t).set_grad(Tensor());
  Tensor y = checkpointed ? checkpoint(f, l.x) : f(l.x);
  backward(sum(mul(y, y)));
  EXPECT_EQ(gen.offset(), uint64_t(4 * 16 * 64)) << "the recomputation left the generator moved";
  return {l.x.grad(), l.w1.grad(), l.w2.grad()};
}

}  // namespace

TEST(ActivationCheckpoint, GradientsEqualThoseWithoutItDropoutIncluded) {
  Leaves l;
  const auto plain = grads_of(l, false);
  const auto checkpointed = grads_of(l, true);
  for (size_t i = 0; i < plain.size(); ++i)
    expect_close(checkpointed[i], plain[i], 0, "gradient " + std::to_string(i));
}

// A reseed between the forward and the backward (a sampling helper, say) does not reach the
// recomputation, and the seed it set is what the generator holds afterwards.
TEST(ActivationCheckpoint, AReseedBeforeTheBackwardChangesNoMask) {
  Leaves l;
  const auto plain = grads_of(l, false);
  manual_seed(11);
  Generator gen(5);
  Tensor y = checkpoint([&](const Tensor& in) { return body(l, gen, in); }, l.x);
  manual_seed(123);
  gen.manual_seed(77);
  for (const Tensor* t : {&l.x, &l.w1, &l.w2})
    const_cast<Tensor&>(*t).set_grad(Tensor());
  backward(sum(mul(y, y)));
  expect_close(l.w1.grad(), plain[1], 0, "dW1 after a reseed");
  EXPECT_EQ(default_generator().seed(), 123u);
  EXPECT_EQ(default_generator().offset(), 0u);
  EXPECT_EQ(gen.seed(), 77u);
}

// A generator the function owns (captured by value) lives in the region's one copy of the
// function, which the recomputation runs again.
TEST(ActivationCheckpoint, AGeneratorTheFunctionOwnsDrawsTheSameMasks) {
  Leaves l;
  std::vector<Tensor> grads[2];
  for (int on : {0, 1}) {
    for (const Tensor* t : {&l.x, &l.w1})
      const_cast<Tensor&>(*t).set_grad(Tensor());
    Generator gen(9);
    auto f = [&l, gen](const Tensor& in) mutable {
      return tanh(linear(dropout(in, 0.5, true, gen), l.w1));
    };
    Tensor y = on ? checkpoint(f, l.x) : f(l.x);
    backward(sum(mul(y, y)));
    grads[on] = {l.x.grad(), l.w1.grad()};
  }
  expect_close(grads[1][0], grads[0][0], 0, "dx");
  expect_close(grads[1][1], grads[0][1], 0, "dW1");
}

// The gradients of sum(y * y) with respect to x and w1, with y = f(x) run plainly or
// checkpointed, and then `between` run before the backward.
std::vector<Tensor> grads_with(const Leaves& l, const std::function<Tensor(const Tensor&)>& f,
                               bool checkpointed, const std::function<void()>& between = {}) {
  for (const Tensor* t : {&l.x, &l.w1})
    const_cast<Tensor&>(*t).set_grad(Tensor());
  Tensor y = checkpointed ? checkpoint(f, l.x) : f(l.x);
  if (between) between();
  backward(sum(mul(y, y)));
  return {l.x.grad(), l.w1.grad()};
}

// Generators kept in a vector that grows while the regions run move to new places; the
// regions follow them there instead of writing where they were.
TEST(ActivationCheckpoint, GeneratorsThatMovedAreFollowed) {
  Leaves l;
  std::vector<Tensor> grads[2];
  for (int on : {0, 1}) {
    std::vector<Generator> gens;
    Tensor total;
    for (int i = 0; i < 4; ++i) {
      gens.emplace_back(100 + i);
      auto f = [&gens, &l, i](const Tensor& in) {
        return tanh(linear(dropout(in, 0.5, true, gens[i]), l.w1));
      };
      Tensor y = on ? checkpoint(f, l.x) : f(l.x);
      total = i == 0 ? sum(y) : add(total, sum(y));
    }
    for (const Tensor* t : {&l.x, &l.w1})
      const_cast<Tensor&>(*t).set_grad(Tensor());
    backward(total);
    grads[on] = {l.x.grad(), l.w1.grad()};
  }
  expect_close(grads[1][0], grads[0][0], 0, "dx");
  expect_close(grads[1][1], grads[0][1], 0, "dW1");
}

// A generator the function copies (PyTorch's fork_rng pattern) or makes and keeps draws the
// same masks on the recomputation, even after the source was drawn from in between.
TEST(ActivationCheckpoint, GeneratorsTheFunctionCopiesOrKeepsDrawTheSameMasks) {
  Leaves l;
  auto forked = [&](const Tensor& in) {
    Generator g = default_generator();
    return tanh(linear(dropout(in, 0.5, true, g), l.w1));
  };
  std::optional<Generator> kept;
  auto lazy = [&](const Tensor& in) {
    if (!kept) kept.emplace(default_generator().seed() + 17);
    return tanh(linear(dropout(in, 0.5, true, *kept), l.w1));
  };
  auto draw_elsewhere = [] {
    Tensor noise = empty({64}, DType::Float32);
    uniform_(noise, 0, 1, default_generator());
  };
  const std::function<Tensor(const Tensor&)> fns[] = {forked, lazy};
  for (int which = 0; which < 2; ++which) {
    std::vector<Tensor> grads[2];
    for (int on : {0, 1}) {
      manual_seed(3);
      kept.reset();
      grads[on] = grads_with(l, fns[which], on, draw_elsewhere);
    }
    const std::string what = which == 0 ? "a copied generator: " : "a kept generator: ";
    expect_close(grads[1][0], grads[0][0], 0, what + "dx");
    expect_close(grads[1][1], grads[0][1], 0, what + "dW1");
  }
}

// The recomputation runs on a detached input: a hook the function registers on its input runs
// once, as without checkpointing.
TEST(ActivationCheckpoint, AHookOnTheInputIsRegisteredOnce) {
  Leaves l;
  int calls = 0;
  auto f = [&](const Tensor& in) {
    register_hook(in, [&](const Tensor& g) {
      ++calls;
      return mul(g, 2.0);
    });
    return tanh(linear(in, l.w1));
  };
  std::vector<Tensor> grads[2];
  int hook_calls[2];
  for (int on : {0, 1}) {
    calls = 0;
    const_cast<Tensor&>(l.x).set_grad(Tensor());
    const Tensor h = mul(l.x, 1.0);  // a non-leaf input, as a block's is
    Tensor y = on ? checkpoint(f, h) : f(h);
    backward(sum(mul(y, y)));
    grads[on] = {l.x.grad()};
    hook_calls[on] = calls;
  }
  EXPECT_EQ(hook_calls[1], hook_calls[0]);
  expect_close(grads[1][0], grads[0][0], 0, "dx");
}

// A retained graph holds none of the region's activations between its backwards: the next
// backward recomputes them.
TEST(ActivationCheckpoint, ARetainedGraphHoldsNoActivationsBetweenBackwards) {
  Leaves l;
  Generator gen(5);
  Tensor y = sum(checkpoint([&](const Tensor& in) { return body(l, gen, in); }, l.x));
  const int64_t before = memory_stats().current_bytes;
  backward(y, Tensor(), /*retain_graph=*/true);
  const int64_t grad_bytes = (l.x.numel() + l.w1.numel() + l.w2.numel()) * 4;
  EXPECT_LE(memory_stats().current_bytes - before, grad_bytes)
      << "the recomputed activations outlived the backward";
  const Tensor once = l.w1.grad().clone();
  backward(y);
  expect_close(l.w1.grad(), mul(once, 2.0), 1e-6, "two backwards");
}

// A frozen parameter replaced by assignment (nothing else holds the old one) between the
// forward and the backward is another tensor to the recomputation: refused.
TEST(ActivationCheckpoint, AReplacedFrozenParameterIsRefused) {
  Leaves l;
  Tensor frozen = random_tensor({64, 32}, 8, DType::Float32);
  Tensor y = checkpoint([&](const Tensor& in) { return tanh(linear(in, frozen)); }, l.x);
  frozen = random_tensor({64, 32}, 9, DType::Float32);
  expect_error([&] { backward(sum(y)); }, {"is another tensor than in the forward"});
}

// Between forward and backward the region holds its input and output, not its activations.
TEST(ActivationCheckpoint, HoldsLessMemoryUntilTheBackward) {
  Leaves l;
  Generator gen(5);
  auto f = [&](const Tensor& in) { return body(l, gen, in); };
  auto held = [&](bool checkpointed) {
    const int64_t before = memory_stats().current_bytes;
    Tensor y = checkpointed ? checkpoint(f, l.x) : f(l.x);
    const int64_t after = memory_stats().current_bytes;
    backward(sum(y));
    return after - before;
  };
  const int64_t plain = held(false), checkpointed = held(true);
  EXPECT_LT(checkpointed * 8, plain) << checkpointed << " bytes held against " << plain;
  std::printf("held between forward and backward: %lld bytes checkpointed, %lld without\n",
              (long long)checkpointed, (long long)plain);
}

TEST(ActivationCheckpoint, AModulesForwardIsARegionAndItsKeysStay) {
  const DecoderConfig cfg = tessera::testing::small_decoder_config();
  const Tensor ids = from_vector<int64_t>({1, 4, 2, 9, 3, 3, 0, 7, 5, 10, 6, 8}, {2, 6});
  const Tensor targets = from_vector<int64_t>({4, 2, 9, 3, 3, 0, 7, 5, 10, 6, 8, 1}, {2, 6});
  std::map<std::string, Tensor> grads[2];
  int64_t held[2] = {0, 0};
  for (bool on : {false, true}) {
    auto model = std::make_shared<Decoder>(cfg);
    if (on) {
      for (auto& block : model->layers) {
        EXPECT_TRUE(checkpoint(block)->activation_checkpointing());
      }
    }
    const int64_t before = memory_stats().current_bytes;
    Tensor loss = cross_entropy((*model)(ids), targets);
    held[on] = memory_stats().current_bytes - before;
    backward(loss);
    for (auto& [name, p] : model->named_parameters())
      grads[on][name] = p->grad();
  }
  EXPECT_LT(held[1] * 2, held[0]) << "the blocks' activations were kept: " << held[1]
                                  << " bytes against " << held[0];
  EXPECT_EQ(grads[1].size(), grads[0].size());
  for (const auto& [name, g] : grads[0])
    expect_close(grads[1].at(name), g, 0, name);
}

TEST(ActivationCheckpoint, WithoutGradModeItJustRuns) {
  Leaves l;
  NoGradGuard no_grad;
  int calls = 0;
  Tensor y = checkpoint(
      [&](const Tensor& in) {
        ++calls;
        return linear(in, l.w1);
      },
      l.x);
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(y.requires_grad());
}

TEST(ActivationCheckpoint, ARecomputationThatDiffersIsAnError) {
  Leaves l;
  int calls = 0;
  Tensor y = checkpoint(
      [&](const Tensor& in) {
        Tensor h = linear(in, l.w1);
        return ++calls == 1 ? tanh(h) : tanh(sigmoid(h));  // one more saved tensor the second time
      },
      l.x);
  expect_error([&] { backward(sum(y)); }, {"checkpoint: recomputing the region",
                                           "where its forward kept", "the same operations again"});
}

TEST(ActivationCheckpoint, ASavedParameterWrittenInPlaceIsAnError) {
  Leaves l;
  Tensor y = checkpoint([&](const Tensor& in) { return tanh(linear(in, l.w1)); }, l.x);
  overwrite(l.w1, 0.5);  // an optimizer step between forward and backward
  expect_error([&] { backward(sum(y)); },
               {"modified by an in-place operation", "float32 [64, 32]", "since the forward"});
}

// Tensors the region read but no node saved as they were (its input through a product, a
// parameter through a product) are checked too: the recomputation would read the new values.
TEST(ActivationCheckpoint, ATensorTheRegionReadWrittenInPlaceIsAnError) {
  Leaves l;
  Tensor h = mul(l.x, 1.0);  // an activation from before the region
  Tensor y = checkpoint([&](const Tensor& in) { return linear(mul(in, 2.0), l.w1); }, h);
  overwrite(h, 0.25);
  expect_error([&] { backward(sum(y)); },
               {"a tensor it read from outside (float32 [16, 32]", "modified by an in-place"});
  Tensor z = checkpoint([&](const Tensor& in) { return linear(in, mul(l.w1, 2.0)); }, l.x);
  overwrite(l.w1, 0.5);
  expect_error([&] { backward(sum(z)); },
               {"a tensor it read from outside (float32 [64, 32]", "modified by an in-place"});
}

// The second backward of a retained graph refuses a recomputed tensor written since.
TEST(ActivationCheckpoint, AWriteBetweenTwoBackwardsOfARetainedGraphIsAnError) {
  Leaves l;
  Tensor y = sum(checkpoint([&](const Tensor& in) { return tanh(linear(in, l.w1)); }, l.x));
  backward(y, Tensor(), /*retain_graph=*/true);
  overwrite(l.w1, 0.5);
  expect_error([&] { backward(y, Tensor(), true); },
               {"a tensor it read from outside", "modified by an in-place operation"});
}

// An adapter switched between a checkpointed forward and its backward: the recomputation would
// train the other adapter; it saves another parameter than the forward did, which is refused.
TEST(ActivationCheckpoint, AModuleWhoseStateChangedIsRefused) {
  const DecoderConfig cfg = tessera::testing::small_decoder_config();
  auto model = std::make_shared<Decoder>(cfg);
  LoraConfig lc;
  lc.r = 2;
  lc.target_modules = {"wq", "wv"};
  lc.init_lora_weights = LoraInit::Random;
  auto lora = apply_lora(model, lc, "a", {.max_adapters = 2, .max_rank = 2});
  lc.seed = 5;
  lora->add_adapter("b", lc);
  checkpoint(model->layers[0]);
  const Tensor ids = from_vector<int64_t>({1, 4, 2, 9, 3, 3}, {1, 6});
  lora->set_adapter("a");
  Tensor la = sum((*model)(ids));
  lora->set_adapter("b");
  expect_error([&] { backward(la); }, {"is another tensor than in the forward", "set_adapter"});
}

// Regions nest (a block checkpointed whole, its attention checkpointed again): the same
// gradients as without checkpointing, dropout in both regions included, and the generators end
// where the plain run leaves them.
TEST(ActivationCheckpoint, NestedRegionsGiveTheSameGradients) {
  Leaves l;
  for (int depth : {2, 3}) {
    std::vector<Tensor> grads[2];
    uint64_t offsets[2];
    for (int on : {0, 1}) {
      manual_seed(21);
      Generator gen(4);
      const auto wrap = [&](const std::function<Tensor(const Tensor&)>& f) {
        return [f, on](const Tensor& in) { return on ? checkpoint(f, in) : f(in); };
      };
      // innermost: [16, 64] -> [16, 32]; middle: [16, 64] -> [16, 32], around it when depth 3.
      auto innermost =
          wrap([&](const Tensor& in) { return tanh(linear(dropout(in, 0.1, true, gen), l.w2)); });
      auto middle = wrap([&](const Tensor& in) {
        Tensor a = dropout(gelu(in), 0.2, true, default_generator());
        return mul(innermost(a), 0.5);
      });
      auto inner = depth == 3 ? middle : innermost;
      auto outer = wrap([&](const Tensor& in) {
        Tensor b = inner(gelu(linear(in, l.w1)));
        Tensor c = dropout(gelu(linear(b, l.w1)), 0.25, true, default_generator());
        return tanh(linear(c, l.w2));
      });
      grads[on] = grads_with(l, outer, false);
      offsets[on] = default_generator().offset() + gen.offset();
    }
    for (size_t i = 0; i < 2; ++i)
      expect_close(grads[1][i], grads[0][i], 0,
                   "depth " + std::to_string(depth) + " gradient " + std::to_string(i));
    EXPECT_EQ(offsets[1], offsets[0]) << "the recomputations left a generator moved";
  }
}

// A tensor only the inner region reads, written in place before the backward, is refused by the
// outer region's recomputation (which would run the inner function on it), before the outer
// region's nodes compute anything from it.
TEST(ActivationCheckpoint, AWriteToWhatOnlyAnInnerRegionReadsIsAnError) {
  Leaves l;
  Tensor w3 = random_tensor({32, 64}, 12, DType::Float32).set_requires_grad(true);
  Tensor y = checkpoint(
      [&](const Tensor& in) {
        Tensor a = gelu(linear(in, l.w1));
        Tensor b = checkpoint([&](const Tensor& h) { return tanh(linear(h, w3)); }, a);
        return tanh(linear(gelu(linear(b, l.w1)), l.w2));
      },
      l.x);
  overwrite(w3, 0.5);
  expect_error([&] { backward(sum(y)); },
               {"a tensor it read from outside (float32 [32, 64]", "modified by an in-place"});
  EXPECT_FALSE(l.w2.grad().defined())
      << "the outer region's nodes ran on a recomputation from the written tensor";
}

TEST(ActivationCheckpoint, ASecondBackwardNeedsRetainGraph) {
  Leaves l;
  Tensor y = sum(checkpoint([&](const Tensor& in) { return tanh(linear(in, l.w1)); }, l.x));
  backward(y, Tensor(), /*retain_graph=*/true);
  const Tensor once = l.w1.grad().clone();
  backward(y);
  expect_close(l.w1.grad(), mul(once, 2.0), 1e-6, "two backwards");
  expect_error([&] { backward(y); }, {"retain_graph"});
}
