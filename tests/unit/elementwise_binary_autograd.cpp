// The autograd of the binary and selection ops: gradchecks with broadcasting and scalars, ties,
// edge cases of pow, the dtype and shape of gradients, and no graph without requires_grad. Part of
// the test_elementwise_binary binary.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "unit/kernel_test_util.h"

using namespace tessera;
using namespace tessera::kernel_test;
using kernels::BinaryOp;
using kernels::CompareOp;
using kernels::UnaryOp;
using tessera::testing::error_of;
using tessera::testing::expect_error;

// --- autograd ---

TEST(BinaryAutograd, GradcheckWithBroadcasting) {
  using Op = std::function<Tensor(const Tensor&, const Tensor&)>;
  const std::vector<std::pair<std::string, Op>> ops = {
      {"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }},
      {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }},
      {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }},
      {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }},
      {"pow", [](const Tensor& a, const Tensor& b) { return tessera::pow(a, b); }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }},
      {"operator+", [](const Tensor& a, const Tensor& b) { return a + b; }},
      {"operator-", [](const Tensor& a, const Tensor& b) { return a - b; }},
      {"operator*", [](const Tensor& a, const Tensor& b) { return a * b; }},
      {"operator/", [](const Tensor& a, const Tensor& b) { return a / b; }},
  };
  const std::vector<std::pair<Shape, Shape>> shapes = {
      {{2, 3}, {2, 3}}, {{2, 3}, {3}}, {{2, 1}, {1, 3}}, {{4}, {2, 3, 4}}, {{2, 3}, {}}};
  for (const auto& [name, f] : ops) {
    for (const auto& [as, bs] : shapes) {
      // Positive, well-separated operands: pow stays real, max/min have no ties.
      Tensor a = leaf(wavy(shape_numel(as), 0.5, 2.0), as);
      Tensor b = leaf(wavy(shape_numel(bs), 0.6, 2.1, 2.0), bs);
      expect_gradcheck([&f](const std::vector<Tensor>& in) { return f(in[0], in[1]); }, {a, b},
                       name + " " + shape_str(as) + " with " + shape_str(bs));
    }
  }
}

TEST(BinaryAutograd, ScalarOverloadsGradcheck) {
  using Op = std::function<Tensor(const Tensor&)>;
  const std::vector<std::pair<std::string, Op>> ops = {
      {"add", [](const Tensor& a) { return add(a, 1.5); }},
      {"sub", [](const Tensor& a) { return sub(a, 1.5); }},
      {"mul", [](const Tensor& a) { return mul(a, -2.5); }},
      {"div", [](const Tensor& a) { return div(a, 4.0); }},
      {"pow 3", [](const Tensor& a) { return tessera::pow(a, 3.0); }},
      {"pow 2", [](const Tensor& a) { return tessera::pow(a, 2.0); }},
      {"pow -0.5", [](const Tensor& a) { return tessera::pow(a, -0.5); }},
      {"operator+", [](const Tensor& a) { return a + 2.0; }},
      {"operator-", [](const Tensor& a) { return a - 2.0; }},
      {"operator*", [](const Tensor& a) { return a * 3.0; }},
      {"operator/", [](const Tensor& a) { return a / 3.0; }},
      {"s*a", [](const Tensor& a) { return 3.0 * a; }},
  };
  for (const auto& [name, f] : ops) {
    Tensor a = leaf(wavy(6, 0.5, 2.0), {2, 3});
    expect_gradcheck([&f](const std::vector<Tensor>& in) { return f(in[0]); }, {a}, name);
  }
  // a^0 has zero gradient even at a == 0, where a^-1 is infinite.
  Tensor z = leaf({0.0, 2.0}, {2});
  backward(sum(tessera::pow(z, 0.0)));
  EXPECT_EQ(z.grad().to_vector<double>(), (std::vector<double>{0.0, 0.0}));
}

TEST(BinaryAutograd, MaximumTiesSplitGradient) {
  Tensor a = leaf({1, 5, 3}, {3});
  Tensor b = leaf({2, 5, 1}, {3});
  backward(sum(maximum(a, b)));
  EXPECT_EQ(a.grad().to_vector<double>(), (std::vector<double>{0, 0.5, 1}));
  EXPECT_EQ(b.grad().to_vector<double>(), (std::vector<double>{1, 0.5, 0}));
  Tensor c = leaf({1, 5, 3}, {3});
  Tensor d = leaf({2, 5, 1}, {3});
  backward(sum(minimum(c, d)));
  EXPECT_EQ(c.grad().to_vector<double>(), (std::vector<double>{1, 0.5, 0}));
  EXPECT_EQ(d.grad().to_vector<double>(), (std::vector<double>{0, 0.5, 1}));
}

TEST(BinaryAutograd, PowExponentGradientAtZeroBase) {
  Tensor a = leaf({0.0, 2.0}, {2});
  Tensor b = leaf({2.0, 3.0}, {2});
  backward(sum(tessera::pow(a, b)));
  // d/db a^b = a^b log a: 0 at a == 0 (torch's convention), 8 log 2 at a == 2.
  expect_close(b.grad(), {0.0, 8.0 * std::log(2.0)}, 1e-14, 0);
  expect_close(a.grad(), {0.0, 12.0}, 1e-14, 0);
}

TEST(BinaryAutograd, GradientsKeepOperandDtypeAndShape) {
  Tensor a = from_vector<float>({1, 2, 3}, {3});
  a.set_requires_grad(true);
  Tensor b = from_vector<double>({2, 4}, {2, 1});
  b.set_requires_grad(true);
  Tensor y = mul(a, b);  // [2, 3] float64
  EXPECT_EQ(y.dtype(), DType::Float64);
  backward(sum(y));
  ASSERT_TRUE(a.grad().defined());
  EXPECT_EQ(a.grad().dtype(), DType::Float32);
  EXPECT_EQ(a.grad().shape(), (Shape{3}));
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{6, 6, 6}));
  EXPECT_EQ(b.grad().shape(), (Shape{2, 1}));
  EXPECT_EQ(b.grad().to_vector<double>(), (std::vector<double>{6, 6}));
}

TEST(SelectionAutograd, WhereAndMaskedFillGradcheck) {
  Tensor cond = from_vector<bool>({true, false, false, true, true, false}, {2, 3});
  for (const auto& [as, bs] :
       std::vector<std::pair<Shape, Shape>>{{{2, 3}, {2, 3}}, {{3}, {2, 1}}, {{}, {2, 3}}}) {
    Tensor a = leaf(wavy(shape_numel(as), -1, 1), as);
    Tensor b = leaf(wavy(shape_numel(bs), -1, 1, 1.0), bs);
    expect_gradcheck([&cond](const std::vector<Tensor>& in) { return where(cond, in[0], in[1]); },
                     {a, b}, "where " + shape_str(as) + " " + shape_str(bs));
  }
  Tensor mask = from_vector<bool>({false, true, false}, {3});
  Tensor x = leaf(wavy(6, -1, 1), {2, 3});
  expect_gradcheck([&mask](const std::vector<Tensor>& in) { return masked_fill(in[0], mask, 7.0); },
                   {x}, "masked_fill");
  Tensor x2 = leaf(wavy(6, -1, 1), {2, 3});
  Tensor y = masked_fill(x2, mask, 7.0);
  backward(sum(y));
  EXPECT_EQ(x2.grad().to_vector<double>(), (std::vector<double>{1, 0, 1, 1, 0, 1}));
  EXPECT_EQ(y.to_vector<double>()[1], 7.0);
}

TEST(BinaryAutograd, NoGraphWithoutRequiresGrad) {
  Tensor a = ones({2});
  Tensor y = add(a, a);
  EXPECT_FALSE(y.requires_grad());
  Tensor l = leaf({1, 2}, {2});
  {
    NoGradGuard guard;
    EXPECT_FALSE(mul(l, l).requires_grad());
  }
  EXPECT_TRUE(mul(l, l).requires_grad());
}
