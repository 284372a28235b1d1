// The Module machinery through the layers: names, state dicts (strict and not), submodule
// replacement, hooks, train/eval, wrapping a Linear, and zero_grad. Part of the test_layers
// binary.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"
#include "unit/layers_test_util.h"

using namespace tessera;
using namespace tessera::layers_test;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;

// --- Module machinery through the layers ---

TEST(LayerModules, NamesInRegistrationOrder) {
  Generator gen(1);
  auto block = std::make_shared<Block>(gen);
  EXPECT_EQ(names_of(*block),
            (std::vector<std::string>{"proj.weight", "proj.bias", "norm.weight"}));
  EXPECT_EQ(block->get_submodule("proj")->type_name(), "Linear");
  EXPECT_EQ(block->named_modules().size(), 3u);
}

TEST(LayerModules, StateDictRoundTrip) {
  Generator g1(1), g2(2);
  auto a = std::make_shared<Block>(g1);
  auto b = std::make_shared<Block>(g2);
  a->norm->weight.copy_from_full(from_vector<float>({0.5f, 2.f, -1.f}));
  Tensor x = random_tensor({2, 4}, 5, DType::Float32);
  Tensor ya = (*a)(x);
  auto sd = a->state_dict();
  ASSERT_EQ(sd.size(), 3u);
  expect_equal(sd.at("proj.weight"), a->proj->weight.local(), "state_dict value");
  b->load_state_dict(sd);
  expect_equal((*b)(x), ya, "output after load");
  // The loaded values are copies, not aliases of the source.
  a->proj->weight.fill_(0.0);
  EXPECT_NE(b->proj->weight.local().to_vector<double>()[0], 0.0);
}

TEST(LayerModules, StrictLoadNamesMissingUnexpectedAndMisshapedKeys) {
  Generator g1(1);
  auto m = std::make_shared<Block>(g1);
  auto sd = m->state_dict();
  Tensor before = m->proj->weight.local().clone();

  auto missing = sd;
  missing.erase("proj.bias");
  expect_error([&] { m->load_state_dict(missing); }, {"missing keys: proj.bias"});
  m->load_state_dict(missing, /*strict=*/false);  // allowed when not strict

  auto unexpected = sd;
  unexpected["proj.scale"] = zeros({3});
  expect_error([&] { m->load_state_dict(unexpected); }, {"unexpected keys: proj.scale"});

  auto misshaped = sd;
  misshaped["proj.weight"] = zeros({4, 3});
  misshaped["norm.weight"] = zeros({9});
  expect_error([&] { m->load_state_dict(misshaped, /*strict=*/false); },
               {"mis-shaped keys", "proj.weight (expected [3, 4], got [4, 3])",
                "norm.weight (expected [3], got [9])"});
  // A failed load writes nothing.
  expect_equal(m->proj->weight.local(), before, "weight after failed load");
}

TEST(LayerModules, ReplaceSubmoduleChecksType) {
  Generator gen(1);
  auto block = std::make_shared<Block>(gen);
  expect_error([&] { block->replace_submodule("proj", std::make_shared<RMSNorm>(4)); },
               {"'proj'", "Linear", "RMSNorm"});
  Generator g2(99);
  auto other = std::make_shared<Linear>(4, 3, false, g2);
  block->replace_submodule("proj", other);
  EXPECT_EQ(block->proj, other);
  EXPECT_EQ(names_of(*block), (std::vector<std::string>{"proj.weight", "norm.weight"}));
  Tensor x = random_tensor({2, 4}, 5, DType::Float32);
  expect_equal((*block)(x), (*block->norm)((*other)(x)), "forward through the new child");
}

TEST(LayerModules, HooksReplaceInputAndOutput) {
  Generator gen(1);
  Linear lin(3, 2, true, gen);
  Tensor x = random_tensor({2, 3}, 6, DType::Float32);
  Tensor doubled = lin(mul(x, 2.0));
  int pre_calls = 0;
  lin.register_forward_pre_hook([&](Module& m, const Tensor& in) {
    EXPECT_EQ(&m, &lin);
    ++pre_calls;
    return mul(in, 2.0);
  });
  expect_equal(lin(x), doubled, "pre-hook replaced input");
  Tensor seen_input;
  lin.register_forward_hook([&](Module&, const Tensor& in, const Tensor& out) {
    seen_input = in;
    return add(out, 1.0);
  });
  Tensor y = lin(x);
  expect_equal(seen_input, mul(x, 2.0), "forward hook sees the replaced input");
  expect_near_all(y, add(doubled, 1.0).to_vector<double>(), 0, "hook replaced output");
  // A pre-hook returning an undefined tensor keeps the input.
  Linear lin2(3, 2, true, gen);
  lin2.register_forward_pre_hook([](Module&, const Tensor&) { return Tensor(); });
  Tensor y2 = lin2(x);
  lin2.register_forward_hook([](Module&, const Tensor&, const Tensor&) { return Tensor(); });
  expect_equal(lin2(x), y2, "undefined hook results keep values");
  EXPECT_EQ(pre_calls, 2);
}

// A hook may register hooks on its own module (a lazy set-up on the first call): as in PyTorch,
// a call runs the pre-hooks there were when it started and the hooks there were when its forward
// returned (the loops ran on over the vector the registration had reallocated, and crashed).
TEST(LayerModules, HooksRegisteredByAHookRunFromTheNextCall) {
  Generator gen(1);
  auto lin = std::make_shared<Linear>(3, 2, true, gen);
  std::vector<std::string> calls;
  bool set_up = false;
  lin->register_forward_pre_hook([&](Module& m, const Tensor&) {
    calls.push_back("pre 0");
    if (!set_up) {
      set_up = true;
      for (int i = 0; i < 4; ++i) {
        m.register_forward_pre_hook([&calls, i](Module&, const Tensor&) {
          calls.push_back("new pre " + std::to_string(i));
          return Tensor();
        });
        m.register_forward_hook([&calls, i](Module&, const Tensor&, const Tensor&) {
          calls.push_back("new hook " + std::to_string(i));
          return Tensor();
        });
      }
    }
    return Tensor();
  });
  lin->register_forward_pre_hook([&](Module&, const Tensor&) {
    calls.push_back("pre 1");
    return Tensor();
  });
  lin->register_forward_hook([&](Module& m, const Tensor&, const Tensor&) {
    calls.push_back("hook 0");
    if (calls.size() < 4)
      m.register_forward_hook([&calls](Module&, const Tensor&, const Tensor&) {
        calls.push_back("late hook");
        return Tensor();
      });
    return Tensor();
  });
  lin->register_forward_hook([&](Module&, const Tensor&, const Tensor&) {
    calls.push_back("hook 1");
    return Tensor();
  });
  const Tensor x = random_tensor({2, 3}, 6, DType::Float32);
  (*lin)(x);
  EXPECT_EQ(calls, (std::vector<std::string>{"pre 0", "pre 1", "hook 0", "hook 1", "new hook 0",
                                             "new hook 1", "new hook 2", "new hook 3"}));
  calls.clear();
  (*lin)(x);
  EXPECT_EQ(calls,
            (std::vector<std::string>{"pre 0", "pre 1", "new pre 0", "new pre 1", "new pre 2",
                                      "new pre 3", "hook 0", "hook 1", "new hook 0", "new hook 1",
                                      "new hook 2", "new hook 3", "late hook"}));
}

TEST(LayerModules, TrainEvalIsRecursive) {
  Generator gen(1);
  auto block = std::make_shared<Block>(gen);
  EXPECT_TRUE(block->is_training());
  EXPECT_TRUE(block->proj->is_training());
  block->eval();
  EXPECT_FALSE(block->is_training());
  EXPECT_FALSE(block->proj->is_training());
  EXPECT_FALSE(block->norm->is_training());
  block->proj->train();
  EXPECT_TRUE(block->proj->is_training());
  EXPECT_FALSE(block->is_training());
  block->train();
  EXPECT_TRUE(block->norm->is_training());
}

namespace {

// A layer that takes another over, as the LoRA wrapper does, through Linear's wrapping
// constructor.
class WrappingLinear : public Linear {
 public:
  explicit WrappingLinear(const Linear& base) : Linear("WrappingLinear", base) {}
};

}  // namespace

// The wrapper runs in the training mode of the layer it replaces (layers with dropout behave
// differently in each).
TEST(LayerModules, WrappingALinearKeepsItsMode) {
  Generator gen(1);
  auto lin = std::make_shared<Linear>(3, 2, true, gen);
  lin->eval();
  EXPECT_FALSE(std::make_shared<WrappingLinear>(*lin)->is_training());
  lin->train();
  EXPECT_TRUE(std::make_shared<WrappingLinear>(*lin)->is_training());
}

// The wrapper runs through the forward pre-hooks and hooks of the layer it replaces (a parallel
// plan's, or the user's), not only with its parameters.
TEST(LayerModules, WrappingALinearKeepsItsHooks) {
  Generator gen(1);
  auto lin = std::make_shared<Linear>(3, 2, true, gen);
  lin->register_forward_pre_hook([](Module&, const Tensor& in) { return mul(in, 2.0); });
  lin->register_forward_hook(
      [](Module&, const Tensor&, const Tensor& out) { return add(out, 1.0); });
  const Tensor x = random_tensor({2, 3}, 6, DType::Float32);
  expect_equal((*std::make_shared<WrappingLinear>(*lin))(x), (*lin)(x), "the wrapper's forward");
}

// The wrapper's forward is checkpointed when the layer's was (checkpoint(lin) before apply_lora
// kept its activations from then on), and so is the plain layer unwrapped from it.
TEST(LayerModules, WrappingALinearKeepsItsActivationCheckpointing) {
  Generator gen(1);
  auto lin = std::make_shared<Linear>(3, 2, true, gen);
  EXPECT_FALSE(std::make_shared<WrappingLinear>(*lin)->activation_checkpointing());
  checkpoint(lin);
  auto wrapper = std::make_shared<WrappingLinear>(*lin);
  EXPECT_TRUE(wrapper->activation_checkpointing());
  EXPECT_TRUE(Linear::unwrapped(*wrapper)->activation_checkpointing());
}

TEST(LayerModules, ZeroGradClearsEveryLayer) {
  Generator gen(1);
  auto block = std::make_shared<Block>(gen);
  backward(sum((*block)(random_tensor({2, 4}, 7, DType::Float32))));
  for (Parameter* p : block->parameters())
    EXPECT_TRUE(p->grad().defined()) << p->str();
  block->zero_grad();
  for (Parameter* p : block->parameters())
    EXPECT_FALSE(p->grad().defined()) << p->str();
}

// PyTorch's load_state_dict(strict=False) returns the keys it did not take.
TEST(LayerModules, NonStrictLoadReturnsMissingAndUnexpectedKeys) {
  Generator gen(1);
  auto m = std::make_shared<Block>(gen);
  auto sd = m->state_dict();
  EXPECT_TRUE(m->load_state_dict(sd).empty());
  sd.erase("proj.bias");
  sd.erase("norm.weight");
  sd["zz.extra"] = zeros({1});
  sd["aa.extra"] = zeros({1});
  const IncompatibleKeys k = m->load_state_dict(sd, /*strict=*/false);
  EXPECT_EQ(k.missing_keys, (std::vector<std::string>{"norm.weight", "proj.bias"}));
  EXPECT_EQ(k.unexpected_keys, (std::vector<std::string>{"aa.extra", "zz.extra"}));
  EXPECT_TRUE(k.mismatched_keys.empty());
}

// A buffer that requires grad (a running statistic someone differentiates through) loads like
// any: the load runs without grad, as PyTorch's does. It used to be refused by copy_ after the
// parameters had been written.
TEST(LayerModules, LoadStateDictWritesABufferThatRequiresGrad) {
  class WithBuffer : public Module {
   public:
    explicit WithBuffer(Generator& gen) : Module("WithBuffer") {
      proj = std::make_shared<Linear>(2, 2, false, gen);
      register_module("proj", proj);
      stat = zeros({2});
      stat.set_requires_grad(true);
      register_buffer("stat", &stat);
    }
    std::shared_ptr<Linear> proj;
    Tensor stat;
  };
  Generator gen(5);
  auto m = std::make_shared<WithBuffer>(gen);
  std::map<std::string, Tensor> sd{{"proj.weight", full({2, 2}, 3.0)}, {"stat", full({2}, 7.0)}};
  m->load_state_dict(sd);
  EXPECT_EQ(m->proj->weight.local().to_vector<double>(), (std::vector<double>{3, 3, 3, 3}));
  EXPECT_EQ(m->stat.to_vector<double>(), (std::vector<double>{7, 7}));
}
