// The engine, Function, hooks and callbacks, exercised with Functions defined here so the test
// depends on nothing but the engine itself.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;

namespace {

Tensor leaf(std::vector<double> v, Shape s = {}) {
  Tensor t = from_vector<double>(v, s);
  t.set_requires_grad(true);
  return t;
}

// y = x * x, elementwise, with loops so the test does not depend on the kernels under test.
class Square final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    save_for_backward({in[0]});
    Tensor y = in[0].clone();
    double* p = y.data<double>();
    for (int64_t i = 0; i < y.numel(); ++i)
      p[i] *= p[i];
    return {y};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    Tensor x = saved_tensors()[0].contiguous();
    Tensor gx = g[0].clone();
    double* p = gx.data<double>();
    const double* xp = x.data<double>();
    for (int64_t i = 0; i < gx.numel(); ++i)
      p[i] *= 2 * xp[i];
    ++calls;
    return {gx};
  }
  static inline int calls = 0;
};

// Two outputs: (a + b, a - b).
class SumDiff final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    Tensor s = in[0].clone(), d = in[0].clone();
    const double* b = in[1].contiguous().data<double>();
    for (int64_t i = 0; i < s.numel(); ++i) {
      s.data<double>()[i] += b[i];
      d.data<double>()[i] -= b[i];
    }
    return {s, d};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    Tensor ga = g[0].clone(), gb = g[0].clone();
    for (int64_t i = 0; i < ga.numel(); ++i) {
      ga.data<double>()[i] += g[1].contiguous().data<double>()[i];
      gb.data<double>()[i] -= g[1].contiguous().data<double>()[i];
    }
    return {ga, gb};
  }
};

Tensor loop_square(const Tensor& x) {
  return autograd::Function::apply<Square>({x})[0];
}

}  // namespace

TEST(AutogradEngine, ChainAndAccumulationIntoLeaves) {
  Tensor x = leaf({3.0});
  Tensor y = loop_square(loop_square(x));  // x^4
  backward(y);
  EXPECT_DOUBLE_EQ(x.grad().item<double>(), 4 * 27.0);
  // A second graph accumulates into the same .grad.
  backward(loop_square(x));
  EXPECT_DOUBLE_EQ(x.grad().item<double>(), 108.0 + 6.0);
}

TEST(AutogradEngine, DiamondSumsBothPathsAndRunsEachNodeOnce) {
  Tensor x = leaf({1.0, 2.0});
  Tensor y = loop_square(x);
  auto sd = autograd::Function::apply<SumDiff>({y, y});  // (2y, 0)
  Square::calls = 0;
  backward({sd[0], sd[1]}, {ones({2}, DType::Float64), ones({2}, DType::Float64)});
  // d/dx [(y + y) + (y - y)] = 2 * 2x
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{4.0, 8.0}));
  EXPECT_EQ(Square::calls, 1);
}

TEST(AutogradEngine, UnusedOutputGetsZeroGradient) {
  Tensor a = leaf({1.0}), b = leaf({2.0});
  auto sd = autograd::Function::apply<SumDiff>({a, b});
  backward(sd[1]);  // only a - b
  EXPECT_DOUBLE_EQ(a.grad().item<double>(), 1.0);
  EXPECT_DOUBLE_EQ(b.grad().item<double>(), -1.0);
}

namespace {

// Identity forward; backward returns no gradient for its input.
class DropsGradient final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override { return {in[0].clone()}; }
  std::vector<Tensor> backward(const std::vector<Tensor>&) override { return {Tensor()}; }
};

// Identity forward; backward returns what `make` gives for the incoming gradient.
class ReturnsGradient final : public autograd::Function {
 public:
  explicit ReturnsGradient(std::function<Tensor(const Tensor&)> make) : make_(std::move(make)) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override { return {in[0].clone()}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override { return {make_(g[0])}; }

 private:
  std::function<Tensor(const Tensor&)> make_;
};

}  // namespace

TEST(AutogradEngine, ANodeThatReceivedNoGradientPassesNoneOn) {
  // As in PyTorch: x -> square -> (backward returns None) leaves x.grad None; the square node
  // is not run with zeros (which gave x a zero gradient).
  Tensor x = leaf({3.0});
  Square::calls = 0;
  Tensor y = autograd::Function::apply<DropsGradient>({loop_square(x)})[0];
  backward(y);
  EXPECT_FALSE(x.grad().defined());
  EXPECT_EQ(Square::calls, 0);
  // A node with one output's gradient still gets zeros for the other.
  Tensor a = leaf({1.0}), b = leaf({2.0});
  auto sd = autograd::Function::apply<SumDiff>({loop_square(a), b});
  backward(autograd::Function::apply<DropsGradient>({sd[0]})[0] + sd[1]);
  EXPECT_DOUBLE_EQ(a.grad().item<double>(), 2.0);
  EXPECT_DOUBLE_EQ(b.grad().item<double>(), -1.0);
}

TEST(AutogradEngine, ANodesGradientsAreChecked) {
  // PyTorch's engine validates every node's outputs: a gradient of the wrong shape is an error
  // naming the node and the index (it reached the next node silently), one of another dtype is
  // cast to the input's.
  Tensor x = leaf({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor y = autograd::Function::apply<ReturnsGradient>(
      {loop_square(x)}, [](const Tensor&) { return ones({3}, DType::Float64); })[0];
  tessera::testing::expect_error(
      [&] {
        backward(y, ones({2, 3}, DType::Float64));
      },
      {"ReturnsGradient", "invalid gradient at index 0", "[3]", "[2, 3]"});
  EXPECT_FALSE(x.grad().defined());

  Tensor z = autograd::Function::apply<ReturnsGradient>(
      {loop_square(x)}, [](const Tensor& g) { return g.to(DType::Float32); })[0];
  backward(z, ones({2, 3}, DType::Float64));
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{2, 4, 6, 8, 10, 12}));
}

TEST(AutogradEngine, NoGradGuardRecordsNothing) {
  Tensor x = leaf({2.0});
  Tensor y;
  {
    NoGradGuard g;
    y = loop_square(x);
  }
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(y.is_leaf());
  EXPECT_THROW(backward(y), Error);
}

TEST(AutogradEngine, SavedTensorsFreedUnlessRetained) {
  Tensor x = leaf({2.0});
  Tensor y = loop_square(x);
  backward(y, {}, /*retain_graph=*/true);
  backward(y);
  EXPECT_DOUBLE_EQ(x.grad().item<double>(), 8.0);
  try {
    backward(y);
    FAIL() << "second backward without retain_graph must fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("retain_graph"), std::string::npos);
  }
}

TEST(AutogradEngine, LeafHookCanReplaceGradientAndPostHookSeesResult) {
  Tensor x = leaf({1.0});
  register_hook(x, [](const Tensor& g) {
    Tensor r = g.clone();
    r.data<double>()[0] *= 10;
    return r;
  });
  double seen = 0;
  register_post_accumulate_grad_hook(x, [&](Tensor& t) { seen = t.grad().item<double>(); });
  backward(loop_square(x));
  EXPECT_DOUBLE_EQ(x.grad().item<double>(), 20.0);
  EXPECT_DOUBLE_EQ(seen, 20.0);
}

TEST(AutogradEngine, NonLeafHookAndRetainGrad) {
  Tensor x = leaf({3.0});
  Tensor y = loop_square(x);
  double seen = 0;
  register_hook(y, [&](const Tensor& g) {
    seen = g.item<double>();
    return Tensor();
  });
  retain_grad(y);
  backward(loop_square(y));  // d(y^2)/dy = 2y = 18
  EXPECT_DOUBLE_EQ(seen, 18.0);
  EXPECT_DOUBLE_EQ(y.grad().item<double>(), 18.0);
  EXPECT_DOUBLE_EQ(x.grad().item<double>(), 18.0 * 6.0);
}

// As in PyTorch, a hook may replace a gradient but not change its shape, dtype or device: a
// non-leaf's replacement of another shape reached its node's backward, which computed with it.
TEST(AutogradEngine, AHookThatChangesTheGradientsShapeOrDtypeIsAnError) {
  Tensor x = leaf({3.0});
  Tensor y = loop_square(x);
  register_hook(y, [](const Tensor&) { return zeros({2}, DType::Float64); });
  tessera::testing::expect_error([&] { backward(loop_square(y)); },
                                 {"a gradient hook on output 0 of", "not change its shape"});
  Tensor a = leaf({3.0});
  Tensor b = loop_square(a);
  register_hook(b, [](const Tensor& g) { return g.to(DType::Float32); });
  tessera::testing::expect_error([&] { backward(loop_square(b)); },
                                 {"not change its shape, dtype"});
  Tensor c = leaf({3.0});
  register_hook(c, [](const Tensor& g) { return g.to(DType::Float32); });
  tessera::testing::expect_error([&] { backward(loop_square(c)); },
                                 {"a gradient hook on a leaf", "not change its shape, dtype"});
}

// As in PyTorch, .grad of a non-leaf is the gradient after all of its hooks, also those
// registered (or prepended) after retain_grad.
TEST(AutogradEngine, RetainedGradIsTheGradientAfterEveryHook) {
  Tensor x = leaf({3.0});
  Tensor y = loop_square(x);
  retain_grad(y);
  register_hook(y, [](const Tensor& g) { return mul(g, 10.0); });
  register_hook(
      y, [](const Tensor& g) { return add(g, 1.0); }, /*prepend=*/true);
  backward(loop_square(y));  // 2y = 18, then + 1, then * 10
  EXPECT_DOUBLE_EQ(y.grad().item<double>(), 190.0);
  EXPECT_DOUBLE_EQ(x.grad().item<double>(), 190.0 * 6.0);
}

// Backward records no history: a hook computing with a tensor that requires grad builds no graph.
TEST(AutogradEngine, BackwardRecordsNoHistory) {
  Tensor x = leaf({3.0});
  Tensor scale = leaf({2.0});
  bool recorded = true;
  register_hook(x, [&](const Tensor& g) {
    Tensor scaled = mul(g, scale);
    recorded = scaled.requires_grad() || grad_enabled();
    return scaled;
  });
  backward(loop_square(x));
  EXPECT_FALSE(recorded);
  EXPECT_DOUBLE_EQ(x.grad().item<double>(), 12.0);
  EXPECT_TRUE(grad_enabled()) << "grad mode is back on after backward";
}

TEST(AutogradEngine, HooksRunInRegistrationOrderAndPrependGoesFirst) {
  // On a non-leaf (hooks of its grad_fn) and on a leaf (its own list).
  for (bool on_leaf : {false, true}) {
    SCOPED_TRACE(on_leaf ? "leaf" : "non-leaf");
    Tensor x = leaf({3.0});
    Tensor y = on_leaf ? x : loop_square(x);
    std::string order;
    auto mark = [&](char c) {
      return [&order, c](const Tensor&) {
        order += c;
        return Tensor();
      };
    };
    register_hook(y, mark('a'));
    register_hook(y, mark('b'));
    register_hook(y, mark('c'), /*prepend=*/true);
    register_hook(y, mark('d'));
    register_hook(y, mark('e'), /*prepend=*/true);
    backward(loop_square(y));
    EXPECT_EQ(order, "ecabd");
  }
}

// A hook that registers hooks on the tensor it runs for: the loop went on over the leaf's list
// that the registration had reallocated (a crash, or hooks run from freed memory), and on a
// non-leaf the new hook joined the pass that added it, so a hook adding one each time never
// ended. As the module hooks do, a pass runs the hooks there were when it started; the new ones
// run from the next backward.
TEST(AutogradEngine, AHookThatRegistersHooksOnItsTensorRunsTheOnesThereWereWhenItStarted) {
  for (bool on_leaf : {false, true}) {
    SCOPED_TRACE(on_leaf ? "leaf" : "non-leaf");
    Tensor x = leaf({3.0});
    Tensor y = on_leaf ? x : loop_square(x);
    int runs = 0, added_runs = 0, post_runs = 0;
    std::function<Tensor(const Tensor&)> adder = [&](const Tensor&) {
      ++runs;
      // Enough to move the leaf's list; each added hook adds another when it runs.
      for (int i = 0; i < 16; ++i)
        register_hook(y, [&](const Tensor& g) {
          ++added_runs;
          register_hook(y, [](const Tensor&) { return Tensor(); });
          return kernels::binary_scalar(kernels::BinaryOp::Mul, g, 1.0);
        });
      return Tensor();
    };
    register_hook(y, adder);
    if (on_leaf) {
      register_post_accumulate_grad_hook(x, [&](Tensor&) {
        ++post_runs;
        for (int i = 0; i < 16; ++i)
          register_post_accumulate_grad_hook(x, [&](Tensor&) { ++post_runs; });
      });
    }
    backward(loop_square(y), {}, /*retain_graph=*/true);
    EXPECT_EQ(runs, 1);
    EXPECT_EQ(added_runs, 0);
    EXPECT_EQ(post_runs, on_leaf ? 1 : 0);
    // The next pass runs them all, once each.
    backward(loop_square(y));
    EXPECT_EQ(runs, 2);
    EXPECT_EQ(added_runs, 16);
    EXPECT_EQ(post_runs, on_leaf ? 2 + 16 : 0);
  }
}

TEST(AutogradEngine, CallbacksRunAfterAllNodes) {
  Tensor x = leaf({1.0});
  std::vector<std::string> order;
  register_post_accumulate_grad_hook(x, [&](Tensor&) {
    order.push_back("accumulate");
    autograd::queue_callback([&] {
      order.push_back("callback");
      autograd::queue_callback([&] { order.push_back("nested"); });
    });
  });
  backward(loop_square(x));
  EXPECT_EQ(order, (std::vector<std::string>{"accumulate", "callback", "nested"}));
  EXPECT_FALSE(autograd::in_backward());
  EXPECT_THROW(autograd::queue_callback([] {}), Error);
}

TEST(AutogradEngine, NonScalarNeedsGradientAndShapesAreChecked) {
  Tensor x = leaf({1.0, 2.0});
  Tensor y = loop_square(x);
  EXPECT_THROW(backward(y), Error);
  EXPECT_THROW(backward(y, ones({3}, DType::Float64)), Error);
}

TEST(AutogradEngine, AGradientOfAnotherDtypeIsCastToTheOutputs) {
  // As torch.autograd.backward(y, grad): the gradient takes the output's dtype before any node
  // sees it (a float64 gradient reached a float32 matmul's backward and failed there).
  Tensor x = ones({2, 3}, DType::Float32).set_requires_grad(true);
  Tensor w = full({3, 4}, 2.0, DType::Float32);
  Tensor y = matmul(x, w);
  DType seen = DType::Bool;
  register_hook(y, [&](const Tensor& g) {
    seen = g.dtype();
    return Tensor();
  });
  backward(y, full({2, 4}, 0.5, DType::Float64));
  EXPECT_EQ(seen, DType::Float32);
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().dtype(), DType::Float32);
  EXPECT_EQ(x.grad().to_vector<float>(), std::vector<float>(6, 4.0f));
}

TEST(AutogradEngine, ViewsAreDifferentiable) {
  Tensor x = leaf({0, 1, 2, 3, 4, 5}, {2, 3});
  Tensor t = transpose(x, 0, 1);            // [3, 2]
  Tensor n = narrow(t, 0, 1, 2);            // rows 1..2 of x^T
  Tensor r = reshape(loop_square(n), {4});  // non-contiguous -> copy
  Tensor e = expand(unsqueeze(r, 0), {3, 4});
  backward(e, ones({3, 4}, DType::Float64));
  // grad = 3 * 2x on x[:, 1:3], 0 on column 0
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{0, 6, 12, 0, 24, 30}));
}

TEST(AutogradEngine, GradcheckOnViews) {
  Tensor x = leaf({0.5, -1, 2, 3, 4, 5, 6, 7}, {2, 2, 2});
  auto r = gradcheck(
      [](const std::vector<Tensor>& in) {
        Tensor p = permute(in[0], {2, 0, 1});
        Tensor s = select(slice(p, 1, 0, 2, 1), 2, 1);
        return loop_square(contiguous(s));
      },
      {x});
  EXPECT_TRUE(r.ok) << r.message;
  Tensor y = leaf({1, 2, 3}, {3, 1});
  auto r2 = gradcheck(
      [](const std::vector<Tensor>& in) {
        return loop_square(contiguous(expand(in[0], {2, 3, 4})));
      },
      {y});
  EXPECT_TRUE(r2.ok) << r2.message;
}

TEST(AutogradEngine, CastIsDifferentiable) {
  Tensor x = leaf({1.5, 2.5});
  Tensor y = cast(x, DType::Float32);
  EXPECT_EQ(y.dtype(), DType::Float32);
  backward(cast(y, DType::Float64), ones({2}, DType::Float64));
  EXPECT_EQ(x.grad().dtype(), DType::Float64);
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{1, 1}));
}

namespace {

// A stand-in for a sum over ranks: "reducing" a term multiplies it by `factor_` (k ranks holding
// the same term sum to k times it) and counts itself.
class Times final : public autograd::GradientReduction {
 public:
  Times(double factor, int* count) : factor_(factor), count_(count) {}
  bool same_as(const autograd::GradientReduction& o) const override {
    const auto* t = dynamic_cast<const Times*>(&o);
    return t != nullptr && t->factor_ == factor_;
  }
  std::function<Tensor()> start(Tensor term) const override {
    ++*count_;
    return [term, f = factor_] { return mul(term.detach(), f); };
  }
  std::string str() const override { return "times " + std::to_string(factor_); }

 private:
  double factor_;
  int* count_;
};

// Identity whose backward hands its gradient back unreduced.
class Deferring final : public autograd::Function {
 public:
  Deferring(double factor, int* count) : factor_(factor), count_(count) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override { return in; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    return {autograd::reduce_later(*this, g[0], std::make_shared<Times>(factor_, count_))};
  }

 private:
  double factor_;
  int* count_;
};

Tensor deferring(const Tensor& x, double factor, int* count) {
  return autograd::Function::apply<Deferring>({x}, factor, count)[0];
}

}  // namespace

// Terms of one reduction arriving at one tensor are added, then reduced once; a term meeting a
// full gradient, or a term of another reduction, is reduced first; the values are those of
// reducing every term on its own.
TEST(AutogradEngine, DeferredReductionsReduceSummedTermsOnce) {
  Tensor x = from_vector<float>({1, 2, 3}).set_requires_grad(true);
  Tensor h = mul(x, 1.0);  // a non-leaf that three "projections" read, as q, k and v read x
  int count = 0;
  Tensor loss = add(add(sum(mul(deferring(h, 3, &count), 2.0)), sum(deferring(h, 3, &count))),
                    sum(mul(deferring(h, 3, &count), 5.0)));
  backward(loss);
  EXPECT_EQ(count, 1);
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{24, 24, 24}));  // 3 * (2 + 1 + 5)

  Tensor y = from_vector<float>({1, 2}).set_requires_grad(true);
  Tensor k = mul(y, 1.0);
  count = 0;
  int other = 0;
  // A full gradient (7), terms of x3 (1 and 2) and a term of x5 (4) at one tensor.
  Tensor l2 =
      add(add(sum(mul(k, 7.0)), sum(deferring(k, 3, &count))),
          add(sum(mul(deferring(k, 3, &count), 2.0)), sum(mul(deferring(k, 5, &other), 4.0))));
  backward(l2);
  EXPECT_EQ(y.grad().to_vector<float>(), (std::vector<float>{36, 36}));  // 7 + 3 + 6 + 20
  EXPECT_GE(count, 1);
  EXPECT_EQ(other, 1);

  // Outside the engine the reduction happens at once.
  count = 0;
  Deferring direct(3, &count);
  EXPECT_EQ(direct.backward({from_vector<float>({2})})[0].to_vector<float>(),
            std::vector<float>{6});
  EXPECT_EQ(count, 1);
}

namespace {

// y = a + b, whose backward hands the one incoming gradient to both inputs, as an add does.
class SharedGradAdd final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    Tensor y = in[0].clone();
    for (int64_t i = 0; i < y.numel(); ++i)
      y.data<double>()[i] += in[1].contiguous().data<double>()[i];
    return {y};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override { return {g[0], g[0]}; }
};

// y = x, whose backward returns a window of a larger buffer (as a split's does).
class WindowGrad final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override { return {in[0].clone()}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    Tensor big = zeros({2 * g[0].numel()}, g[0].dtype());
    Tensor window = big.as_strided(g[0].shape(), {1}, 0);
    window.copy_(g[0]);
    return {window};
  }
};

}  // namespace

// As PyTorch's AccumulateGrad: a first gradient nothing else holds becomes .grad as it is.
TEST(AutogradEngine, AFirstGradientNobodyElseHoldsBecomesGradWithoutACopy) {
  Tensor x = leaf({1.0, 2.0});
  const void* arrived = nullptr;
  register_hook(x, [&](const Tensor& g) {
    arrived = g.raw_data();
    return Tensor();
  });
  backward(loop_square(x), {ones({2}, DType::Float64)});
  ASSERT_NE(arrived, nullptr);
  EXPECT_EQ(x.grad().raw_data(), arrived);
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{2.0, 4.0}));
  // The next backward accumulates into that buffer.
  const void* grad_buffer = x.grad().raw_data();
  backward(loop_square(x), {ones({2}, DType::Float64)});
  EXPECT_EQ(x.grad().raw_data(), grad_buffer);
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{4.0, 8.0}));
}

// Whoever else holds the gradient (another leaf's slot, the caller of backward, a larger buffer
// it is a window of) keeps its values when .grad is later accumulated into in place.
TEST(AutogradEngine, AGradientOthersCanSeeIsCopiedIntoGrad) {
  Tensor a = leaf({1.0, 2.0}), b = leaf({3.0, 4.0});
  Tensor given = from_vector<double>({1.0, 1.0});
  backward(autograd::Function::apply<SharedGradAdd>({a, b})[0], {given});
  EXPECT_NE(a.grad().raw_data(), given.raw_data());
  EXPECT_NE(b.grad().raw_data(), given.raw_data());
  EXPECT_NE(a.grad().raw_data(), b.grad().raw_data());

  // Without the caller's reference one of the two may own the buffer, never both.
  Tensor c = leaf({1.0, 2.0}), d = leaf({3.0, 4.0});
  backward(loop_square(autograd::Function::apply<SharedGradAdd>({c, d})[0]),
           {ones({2}, DType::Float64)});
  EXPECT_NE(c.grad().raw_data(), d.grad().raw_data());
  backward(loop_square(autograd::Function::apply<SharedGradAdd>({c, d})[0]),
           {ones({2}, DType::Float64)});
  EXPECT_EQ(c.grad().to_vector<double>(), (std::vector<double>{16.0, 24.0}));
  EXPECT_EQ(d.grad().to_vector<double>(), (std::vector<double>{16.0, 24.0}));
  EXPECT_EQ(given.to_vector<double>(), (std::vector<double>{1.0, 1.0}));

  // A window of a larger buffer is copied: .grad keeps only its own bytes alive.
  Tensor w = leaf({1.0, 2.0});
  backward(autograd::Function::apply<WindowGrad>({w})[0], {ones({2}, DType::Float64)});
  EXPECT_EQ(w.grad().storage().nbytes(), w.grad().nbytes());
}
