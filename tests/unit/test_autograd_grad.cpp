// autograd::grad, PyTorch's torch.autograd.grad: gradients returned, not accumulated, from the
// part of the graph between the outputs and the inputs only.
#include <gtest/gtest.h>

#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;

namespace {

Tensor leaf(std::vector<double> v) {
  Tensor t = from_vector<double>(v);
  t.set_requires_grad(true);
  return t;
}

// y = 3 x, counting its backward calls.
class Triple final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override { return {mul(in[0], 3.0)}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    ++calls;
    return {mul(g[0], 3.0)};
  }
  static inline int calls = 0;
};

Tensor triple(const Tensor& x) {
  return autograd::Function::apply<Triple>({x})[0];
}

}  // namespace

TEST(AutogradGrad, ReturnsGradientsOfLeavesAndNonLeavesAndAccumulatesNothing) {
  Tensor x = leaf({1.0, 2.0}), w = leaf({3.0, 5.0});
  bool post_hook_ran = false;
  register_post_accumulate_grad_hook(w, [&](Tensor&) { post_hook_ran = true; });
  Tensor h = mul(x, w);
  Tensor y = sum(mul(h, h));  // sum (x w)^2
  std::vector<Tensor> g = autograd::grad({y}, {x, h, w});
  ASSERT_EQ(g.size(), 3u);
  EXPECT_EQ(g[0].to_vector<double>(), (std::vector<double>{18.0, 100.0}));  // 2 x w^2
  EXPECT_EQ(g[1].to_vector<double>(), (std::vector<double>{6.0, 20.0}));    // 2 h
  EXPECT_EQ(g[2].to_vector<double>(), (std::vector<double>{6.0, 40.0}));    // 2 x^2 w
  EXPECT_FALSE(x.grad().defined());
  EXPECT_FALSE(w.grad().defined());
  EXPECT_FALSE(post_hook_ran);
}

TEST(AutogradGrad, RunsOnlyTheNodesBetweenTheOutputsAndTheInputs) {
  Tensor x = leaf({1.0}), z = leaf({2.0});
  Triple::calls = 0;
  Tensor y = add(sum(mul(x, 2.0)), sum(triple(z)));
  std::vector<Tensor> g = autograd::grad({y}, {x}, {}, /*retain_graph=*/true);
  EXPECT_EQ(g[0].to_vector<double>(), std::vector<double>{2.0});
  EXPECT_EQ(Triple::calls, 0);
  EXPECT_FALSE(z.grad().defined());
  // The same graph, asked about z, runs that branch; a backward afterwards accumulates both.
  EXPECT_EQ(autograd::grad({y}, {z}, {}, true)[0].to_vector<double>(), std::vector<double>{3.0});
  EXPECT_EQ(Triple::calls, 1);
  backward(y);
  EXPECT_EQ(x.grad().to_vector<double>(), std::vector<double>{2.0});
  EXPECT_EQ(z.grad().to_vector<double>(), std::vector<double>{3.0});
}

TEST(AutogradGrad, AnInputsHooksRunBeforeItsGradientIsTaken) {
  Tensor x = leaf({1.0, 2.0});
  register_hook(x, [](const Tensor& g) { return mul(g, 10.0); });
  Tensor h = mul(x, 2.0);
  register_hook(h, [](const Tensor& g) { return add(g, 1.0); });
  Tensor y = sum(mul(h, 3.0));
  std::vector<Tensor> g = autograd::grad({y}, {x, h}, {}, true);
  EXPECT_EQ(g[1].to_vector<double>(), (std::vector<double>{4.0, 4.0}));    // 3, then + 1
  EXPECT_EQ(g[0].to_vector<double>(), (std::vector<double>{80.0, 80.0}));  // 4 * 2, then * 10
  EXPECT_FALSE(x.grad().defined());
}

TEST(AutogradGrad, BadInputsAreRefusedBeforeAnythingRuns) {
  Tensor x = leaf({1.0}), unused = leaf({2.0});
  Tensor constant = from_vector<double>({4.0});
  Tensor y = sum(mul(x, x));
  tessera::testing::expect_error([&] { autograd::grad({y}, {constant}); },
                                 {"grad: input 0", "does not require grad"});
  tessera::testing::expect_error(
      [&] {
        autograd::grad({y}, {x, unused});
      },
      {"grad: input 1", "not used in the graph", "allow_unused"});
  tessera::testing::expect_error([&] { autograd::grad({y}, {}); }, {"no inputs"});
  // Nothing ran: the graph is whole, and a backward through it works without retain_graph.
  std::vector<Tensor> g = autograd::grad({y}, {x, unused}, {}, false, /*allow_unused=*/true);
  EXPECT_EQ(g[0].to_vector<double>(), std::vector<double>{2.0});
  EXPECT_FALSE(g[1].defined());
  // That call freed the saved tensors (no retain_graph), as a backward would.
  tessera::testing::expect_error([&] { autograd::grad({y}, {x}); }, {"already freed"});
}

TEST(AutogradGrad, NonScalarOutputsTakeGradientsAsBackwardDoes) {
  Tensor x = leaf({1.0, 2.0});
  Tensor y = mul(x, x);
  tessera::testing::expect_error([&] { autograd::grad({y}, {x}); },
                                 {"grad: output 0", "non-scalar"});
  std::vector<Tensor> g = autograd::grad({y}, {x}, {from_vector<double>({1.0, 0.5})});
  EXPECT_EQ(g[0].to_vector<double>(), (std::vector<double>{2.0, 2.0}));
}

// backward(inputs): PyTorch's backward(inputs=...). Only the inputs accumulate, and only the
// nodes that lead to them run.
TEST(AutogradBackwardInputs, OnlyTheInputsAccumulate) {
  Tensor x = leaf({1.0, 2.0}), w = leaf({3.0, 5.0}), z = leaf({2.0});
  Triple::calls = 0;
  Tensor h = mul(x, w);
  Tensor y = add(sum(mul(h, h)), sum(triple(z)));
  backward({y}, {}, /*retain_graph=*/true, {w, h});
  EXPECT_EQ(w.grad().to_vector<double>(), (std::vector<double>{6.0, 40.0}));  // 2 x^2 w
  EXPECT_EQ(h.grad().to_vector<double>(), (std::vector<double>{6.0, 20.0}));  // 2 h
  EXPECT_FALSE(x.grad().defined());
  EXPECT_FALSE(z.grad().defined());
  EXPECT_EQ(Triple::calls, 0);
  // Accumulates as any backward; a repeated input counts once.
  backward({y}, {}, true, {h, w, h});
  EXPECT_EQ(w.grad().to_vector<double>(), (std::vector<double>{12.0, 80.0}));
  EXPECT_EQ(h.grad().to_vector<double>(), (std::vector<double>{12.0, 40.0}));
  // A retained non-leaf gets its gradient once, through retain_grad.
  retain_grad(h);
  backward({y}, {}, true, {h});
  EXPECT_EQ(h.grad().to_vector<double>(), (std::vector<double>{18.0, 60.0}));
  backward({y}, {}, false, {z});
  EXPECT_EQ(z.grad().to_vector<double>(), std::vector<double>{3.0});
  EXPECT_EQ(Triple::calls, 1);
  EXPECT_FALSE(x.grad().defined());
}

TEST(AutogradBackwardInputs, AnInputMustRequireGrad) {
  Tensor x = leaf({1.0});
  Tensor y = sum(mul(x, x));
  tessera::testing::expect_error([&] { backward({y}, {}, false, {from_vector<double>({1.0})}); },
                                 {"backward: input 0", "does not require grad"});
  // Refused before anything ran.
  backward({y}, {}, false, {x});
  EXPECT_EQ(x.grad().to_vector<double>(), std::vector<double>{2.0});
}
