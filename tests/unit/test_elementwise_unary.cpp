// Unary elementwise kernels and their autograd ops. Expected values are computed here with plain
// loops and std:: math in double; broadcasting references use their own index arithmetic.
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

namespace {

double ref_unary(UnaryOp op, double x) {
  switch (op) {
    case UnaryOp::Neg:
      return -x;
    case UnaryOp::Exp:
      return std::exp(x);
    case UnaryOp::Log:
      return std::log(x);
    case UnaryOp::Sqrt:
      return std::sqrt(x);
    case UnaryOp::Rsqrt:
      return 1.0 / std::sqrt(x);
    case UnaryOp::Tanh:
      return std::tanh(x);
    case UnaryOp::Sigmoid:
      return 1.0 / (1.0 + std::exp(-x));
    case UnaryOp::Relu:
      return x > 0 ? x : 0.0;
    case UnaryOp::Gelu:
      return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case UnaryOp::GeluTanh:
      return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case UnaryOp::Silu:
      return x / (1.0 + std::exp(-x));
    case UnaryOp::Abs:
      return std::abs(x);
    case UnaryOp::Sin:
      return std::sin(x);
    case UnaryOp::Cos:
      return std::cos(x);
    case UnaryOp::Square:
      return x * x;
    case UnaryOp::Reciprocal:
      return 1.0 / x;
  }
  return kNaN;
}

// f'(x) by central differences of ref_unary: independent of the kernels' derivative formulas.
double ref_derivative(UnaryOp op, double x) {
  const double h = 1e-5 * std::max(1.0, std::abs(x));
  return (ref_unary(op, x + h) - ref_unary(op, x - h)) / (2 * h);
}

const std::vector<UnaryOp> kAllUnary = {
    UnaryOp::Neg,   UnaryOp::Exp,      UnaryOp::Log,     UnaryOp::Sqrt,
    UnaryOp::Rsqrt, UnaryOp::Tanh,     UnaryOp::Sigmoid, UnaryOp::Relu,
    UnaryOp::Gelu,  UnaryOp::GeluTanh, UnaryOp::Silu,    UnaryOp::Abs,
    UnaryOp::Sin,   UnaryOp::Cos,      UnaryOp::Square,  UnaryOp::Reciprocal};

bool positive_domain(UnaryOp op) {
  return op == UnaryOp::Log || op == UnaryOp::Sqrt || op == UnaryOp::Rsqrt ||
         op == UnaryOp::Reciprocal;
}

std::vector<double> unary_inputs(UnaryOp op, int64_t n) {
  return positive_domain(op) ? wavy(n, 0.2, 4.0) : wavy(n, -4.0, 4.0);
}

}  // namespace

// --- unary ---

TEST(Unary, Float32MatchesReference) {
  for (UnaryOp op : kAllUnary) {
    const auto x = rounded(unary_inputs(op, 300), DType::Float32);  // long enough to vectorise
    Tensor y = kernels::unary(op, tensor_of(x, {300}, DType::Float32));
    EXPECT_EQ(y.dtype(), DType::Float32);
    expect_close(y, map(x, [op](double v) { return ref_unary(op, v); }), 4e-6, 1e-6,
                 "op " + std::to_string(int(op)));
  }
}

TEST(Unary, SqrtIsCorrectlyRounded) {
  // IEEE sqrt is exact-then-rounded; float(sqrt(double(x))) is that value (no double rounding
  // issue for sqrt), so the kernel must match it bit for bit, vector body and tail alike.
  const auto x = rounded(wavy(1003, 1e-3, 1e3), DType::Float32);
  const auto got =
      kernels::unary(UnaryOp::Sqrt, tensor_of(x, {1003}, DType::Float32)).to_vector<float>();
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_EQ(got[i], float(std::sqrt(x[i]))) << x[i];
  const auto got64 =
      kernels::unary(UnaryOp::Sqrt, tensor_of(x, {1003}, DType::Float64)).to_vector<double>();
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_EQ(got64[i], std::sqrt(x[i])) << x[i];
}

TEST(Unary, Float64MatchesReference) {
  for (UnaryOp op : kAllUnary) {
    const auto x = unary_inputs(op, 37);
    Tensor y = kernels::unary(op, tensor_of(x, {37}, DType::Float64));
    EXPECT_EQ(y.dtype(), DType::Float64);
    expect_close(y, map(x, [op](double v) { return ref_unary(op, v); }), 1e-13, 1e-14,
                 "op " + std::to_string(int(op)));
  }
}

TEST(Unary, HalfDtypesComputeInFloatAndRound) {
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    for (UnaryOp op : kAllUnary) {
      const auto x = rounded(unary_inputs(op, 40), dt);
      Tensor y = kernels::unary(op, tensor_of(x, {5, 8}, dt));
      EXPECT_EQ(y.dtype(), dt);
      const auto want = rounded(map(x, [op](double v) { return ref_unary(op, v); }), dt);
      // One unit in the last place of the 16-bit format.
      const double ulp = dt == DType::BFloat16 ? 1.0 / 128 : 1.0 / 1024;
      expect_close(y, want, ulp, 1e-6,
                   std::string(dtype_name(dt)) + " op " + std::to_string(int(op)));
    }
  }
}

TEST(Unary, NonContiguousInput) {
  // A transposed view and a strided slice: the kernel must read through the strides.
  const auto base = wavy(24, -2.0, 2.0);
  Tensor m = tensor_of(base, {4, 6}, DType::Float32);
  Tensor t = kernels::transpose(m, 0, 1);  // [6, 4]
  Tensor y = kernels::unary(UnaryOp::Tanh, t);
  EXPECT_EQ(y.shape(), (Shape{6, 4}));
  std::vector<double> want;
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 4; ++j)
      want.push_back(std::tanh(double(float(base[size_t(j * 6 + i)]))));
  expect_close(y, want, 4e-6, 1e-6);

  Tensor s = kernels::slice(m, 1, 1, 6, 2);  // columns 1, 3, 5
  Tensor e = kernels::unary(UnaryOp::Exp, s);
  want.clear();
  for (int i = 0; i < 4; ++i)
    for (int j = 1; j < 6; j += 2)
      want.push_back(std::exp(double(float(base[size_t(i * 6 + j)]))));
  expect_close(e, want, 4e-6, 1e-6);
}

TEST(Unary, ExtremeInputsStayFinite) {
  Tensor x = from_vector<float>({-100.f, -30.f, 0.f, 30.f, 100.f});
  expect_close(kernels::unary(UnaryOp::Sigmoid, x),
               map({-100, -30, 0, 30, 100}, [](double v) { return 1 / (1 + std::exp(-v)); }), 1e-5,
               1e-38);
  expect_close(kernels::unary(UnaryOp::Tanh, x), {-1, -1, 0, 1, 1}, 0, 1e-7);
  expect_close(kernels::unary(UnaryOp::Silu, x),
               map({-100, -30, 0, 30, 100}, [](double v) { return v / (1 + std::exp(-v)); }), 1e-5,
               1e-30);
  Tensor nan = from_vector<float>({float(kNaN), -1.f, 2.f});
  expect_close(kernels::unary(UnaryOp::Relu, nan), {kNaN, 0, 2}, 0, 0);
}

TEST(Unary, IntegerOpsAndErrors) {
  Tensor x = from_vector<int64_t>({-3, 0, 5});
  EXPECT_EQ(kernels::unary(UnaryOp::Neg, x).to_vector<int64_t>(), (std::vector<int64_t>{3, 0, -5}));
  EXPECT_EQ(kernels::unary(UnaryOp::Abs, x).to_vector<int64_t>(), (std::vector<int64_t>{3, 0, 5}));
  EXPECT_EQ(kernels::unary(UnaryOp::Relu, from_vector<int32_t>({-3, 4})).to_vector<int32_t>(),
            (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(kernels::unary(UnaryOp::Square, x).dtype(), DType::Int64);
  const std::string msg = error_of([&] { kernels::unary(UnaryOp::Exp, x); });
  EXPECT_NE(msg.find("exp"), std::string::npos) << msg;
  EXPECT_NE(msg.find("int64"), std::string::npos) << msg;
}

TEST(UnaryBackward, MatchesNumericDerivative) {
  for (UnaryOp op : kAllUnary) {
    const auto x = unary_inputs(op, 33);
    const auto g = wavy(33, -1.5, 1.5, 2.0);
    for (DType dt : {DType::Float32, DType::Float64}) {
      const auto xr = rounded(x, dt), gr = rounded(g, dt);
      Tensor gx =
          kernels::unary_backward(op, tensor_of(gr, {3, 11}, dt), tensor_of(xr, {3, 11}, dt));
      EXPECT_EQ(gx.dtype(), dt);
      std::vector<double> want;
      for (size_t i = 0; i < xr.size(); ++i)
        want.push_back(gr[i] * ref_derivative(op, xr[i]));
      const double tol = dt == DType::Float32 ? 2e-5 : 1e-7;
      expect_close(gx, want, tol, tol,
                   std::string(dtype_name(dt)) + " op " + std::to_string(int(op)));
    }
  }
}

TEST(UnaryBackward, ShapeMismatchIsAnError) {
  const std::string msg = error_of([] {
    kernels::unary_backward(UnaryOp::Exp, zeros({2, 3}), zeros({3, 2}));
  });
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 2]"), std::string::npos) << msg;
}

TEST(UnaryAutograd, Gradcheck) {
  using Op = std::function<Tensor(const Tensor&)>;
  struct Case {
    std::string name;
    Op f;
    bool positive;  // needs x > 0
  };
  const std::vector<Case> cases = {
      {"neg", [](const Tensor& x) { return neg(x); }, false},
      {"exp", [](const Tensor& x) { return tessera::exp(x); }, false},
      {"log", [](const Tensor& x) { return tessera::log(x); }, true},
      {"sqrt", [](const Tensor& x) { return tessera::sqrt(x); }, true},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, true},
      {"tanh", [](const Tensor& x) { return tessera::tanh(x); }, false},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, false},
      {"relu", [](const Tensor& x) { return relu(x); }, false},
      {"gelu", [](const Tensor& x) { return gelu(x); }, false},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, true); }, false},
      {"silu", [](const Tensor& x) { return silu(x); }, false},
      {"abs", [](const Tensor& x) { return abs(x); }, false},
      {"square", [](const Tensor& x) { return square(x); }, false},
      {"operator-", [](const Tensor& x) { return -x; }, false},
  };
  for (const Case& c : cases) {
    Tensor x = leaf(c.positive ? wavy(12, 0.3, 3.0) : wavy(12, -2.5, 2.5), {3, 4});
    expect_gradcheck([&c](const std::vector<Tensor>& in) { return c.f(in[0]); }, {x}, c.name);
  }
}

TEST(UnaryAutograd, ValuesMatchKernels) {
  Tensor x = tensor_of(wavy(6, -2, 2), {2, 3}, DType::Float32);
  EXPECT_EQ(gelu(x, true).to_vector<float>(),
            kernels::unary(UnaryOp::GeluTanh, x).to_vector<float>());
  EXPECT_EQ(silu(x).to_vector<float>(), kernels::unary(UnaryOp::Silu, x).to_vector<float>());
}
