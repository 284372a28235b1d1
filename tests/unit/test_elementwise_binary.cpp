// Binary and comparison kernels: every op over broadcast shapes, dtypes and layouts, promotion,
// NaN, integer and scalar operands. Expected values are computed here with plain loops and std::
// math in double; broadcasting references use their own index arithmetic. The in-place and
// selection kernels (elementwise_binary_in_place.cpp) and the autograd of these ops
// (elementwise_binary_autograd.cpp) are compiled into this same binary.
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

// --- binary ---

namespace {

double ref_binary(BinaryOp op, double a, double b) {
  switch (op) {
    case BinaryOp::Add:
      return a + b;
    case BinaryOp::Sub:
      return a - b;
    case BinaryOp::Mul:
      return a * b;
    case BinaryOp::Div:
      return a / b;
    case BinaryOp::Pow:
      return std::pow(a, b);
    case BinaryOp::Maximum:
      return std::isnan(a) || std::isnan(b) ? kNaN : std::max(a, b);
    case BinaryOp::Minimum:
      return std::isnan(a) || std::isnan(b) ? kNaN : std::min(a, b);
  }
  return kNaN;
}

const std::vector<BinaryOp> kAllBinary = {BinaryOp::Add,    BinaryOp::Sub, BinaryOp::Mul,
                                          BinaryOp::Div,    BinaryOp::Pow, BinaryOp::Maximum,
                                          BinaryOp::Minimum};

// Positive operands keep pow real and div away from 0.
struct BinaryCase {
  Shape as, bs, out;
};
const std::vector<BinaryCase> kBroadcastCases = {
    {{300}, {300}, {300}},              // same shape, long enough to vectorise
    {{2, 3, 4}, {3, 1}, {2, 3, 4}},     // inner broadcast
    {{4}, {2, 3, 4}, {2, 3, 4}},        // leading broadcast of a
    {{2, 1, 4}, {1, 3, 1}, {2, 3, 4}},  // both broadcast
    {{3, 4}, {}, {3, 4}},               // 0-d operand
    {{0, 4}, {4}, {0, 4}},              // empty
};

}  // namespace

TEST(Binary, AllOpsBroadcastFloat32AndFloat64) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    for (BinaryOp op : kAllBinary) {
      for (const BinaryCase& c : kBroadcastCases) {
        const auto a = rounded(wavy(shape_numel(c.as), 0.5, 2.5), dt);
        const auto b = rounded(wavy(shape_numel(c.bs), 0.5, 2.5, 1.0), dt);
        Tensor y = kernels::binary(op, tensor_of(a, c.as, dt), tensor_of(b, c.bs, dt));
        EXPECT_EQ(y.shape(), c.out);
        EXPECT_EQ(y.dtype(), dt);
        const double tol = dt == DType::Float32 ? 1e-6 : 1e-15;
        expect_close(y,
                     ref_broadcast(a, c.as, b, c.bs, c.out,
                                   [op](double u, double v) { return ref_binary(op, u, v); }),
                     tol, tol,
                     std::string(dtype_name(dt)) + " op " + std::to_string(int(op)) + " " +
                         shape_str(c.as) + " with " + shape_str(c.bs));
      }
    }
  }
}

// dst + alpha * src rounds the product before the sum on every machine, never a fused
// multiply-add (which the compiler would choose where the CPU has one): the device kernels,
// built without FMA, must give the same bits. With u = 1 + 2^-12, u * u = 1 + 2^-11 + 2^-24
// rounds to 1 + 2^-11, so -(1 + 2^-11) + u * u is 0 rounded twice and 2^-24 fused.
TEST(Binary, AddWithAlphaRoundsTheProductBeforeTheSum) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    const int e = dt == DType::Float32 ? 12 : 27;  // 2^-24 and 2^-54 below one ulp at 1
    const double u = 1.0 + std::ldexp(1.0, -e), c = -(1.0 + std::ldexp(1.0, 1 - e));
    for (const Shape& src_shape : {Shape{67}, Shape{}}) {  // vector loop, broadcast scalar
      Tensor dst = full({67}, c, dt);
      kernels::add_(dst, full(src_shape, u, dt), u);
      for (double v : dst.to(DType::Float64).to_vector<double>())
        ASSERT_EQ(v, 0.0) << dtype_name(dt) << " source " << shape_str(src_shape)
                          << ": a fused multiply-add gives " << std::ldexp(1.0, -2 * e);
    }
  }
}

TEST(Binary, NonContiguousOperands) {
  const auto av = wavy(12, -2, 2), bv = wavy(18, -2, 2, 0.7);
  Tensor a = kernels::transpose(tensor_of(av, {3, 4}, DType::Float32), 0, 1);    // [4, 3]
  Tensor b = kernels::slice(tensor_of(bv, {3, 6}, DType::Float32), 1, 0, 6, 2);  // [3, 3]
  Tensor b_row = kernels::select(b, 0, 1);                                       // [3]
  Tensor y = kernels::binary(BinaryOp::Mul, a, b_row);
  ASSERT_EQ(y.shape(), (Shape{4, 3}));
  std::vector<double> want;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j)
      want.push_back(double(float(av[size_t(j * 4 + i)])) * double(float(bv[size_t(6 + 2 * j)])));
  expect_close(y, want, 1e-6, 1e-7);
}

TEST(Binary, PermutedOperandsAcrossManyTiles) {
  // [3, 37, 21] read through permutations, so the unit-stride dim of an operand is not the
  // output's innermost: exercises the tiled path with partial tiles and an outer dim.
  const Shape s = {3, 37, 21};
  const auto av = wavy(shape_numel(s), -2, 2), bv = wavy(shape_numel(s), -2, 2, 0.9);
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    const auto ar = rounded(av, dt), br = rounded(bv, dt);
    Tensor a = tensor_of(ar, s, dt);
    Tensor b = tensor_of(br, s, dt);
    Tensor ap = kernels::permute(a, {2, 0, 1});  // [21, 3, 37]
    Tensor bp = kernels::permute(b, {2, 0, 1});
    Tensor bt = kernels::permute(kernels::transpose(b, 1, 2), {1, 0, 2});  // [21, 3, 37]
    auto at = [&](const std::vector<double>& v, int64_t i, int64_t j, int64_t k) {
      return v[size_t((i * 37 + j) * 21 + k)];
    };
    std::vector<double> want_sub, want_exp;
    for (int64_t k = 0; k < 21; ++k)
      for (int64_t i = 0; i < 3; ++i)
        for (int64_t j = 0; j < 37; ++j) {
          want_sub.push_back(double(float(at(ar, i, j, k) - at(br, i, j, k))));
          want_exp.push_back(double(float(std::exp(at(ar, i, j, k)))));
        }
    const double tol = dt == DType::Float32 ? 1e-6 : 1.0 / 128;
    Tensor d = kernels::binary(BinaryOp::Sub, ap, bp);
    EXPECT_EQ(d.shape(), (Shape{21, 3, 37}));
    expect_close(d, rounded(want_sub, dt), tol, 1e-6, "permuted sub");
    expect_close(kernels::binary(BinaryOp::Sub, ap, bt), rounded(want_sub, dt), tol, 1e-6,
                 "mixed layouts");
    expect_close(kernels::unary(UnaryOp::Exp, ap), rounded(want_exp, dt), tol, 1e-6,
                 "permuted exp");
  }
}

TEST(Binary, MixedDtypesPromote) {
  Tensor f32 = from_vector<float>({1.5f, -2.f});
  Tensor f64 = from_vector<double>({0.25, 4.0});
  Tensor i64 = from_vector<int64_t>({3, -7});
  Tensor i32 = from_vector<int32_t>({10, 20});
  Tensor bf = from_vector<float>({1.f, 2.f}).to(DType::BFloat16);
  Tensor hf = from_vector<float>({0.5f, 3.f}).to(DType::Float16);
  Tensor mask = from_vector<bool>({true, false});

  Tensor y = kernels::binary(BinaryOp::Add, f32, f64);
  EXPECT_EQ(y.dtype(), DType::Float64);
  EXPECT_EQ(y.to_vector<double>(), (std::vector<double>{1.75, 2.0}));
  y = kernels::binary(BinaryOp::Mul, i64, f32);
  EXPECT_EQ(y.dtype(), DType::Float32);
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{4.5f, 14.f}));
  y = kernels::binary(BinaryOp::Add, bf, hf);
  EXPECT_EQ(y.dtype(), DType::Float32);
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{1.5f, 5.f}));
  y = kernels::binary(BinaryOp::Mul, bf, i64);
  EXPECT_EQ(y.dtype(), DType::BFloat16);
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{3.f, -14.f}));
  y = kernels::binary(BinaryOp::Add, i32, i64);
  EXPECT_EQ(y.dtype(), DType::Int64);
  EXPECT_EQ(y.to_vector<int64_t>(), (std::vector<int64_t>{13, 13}));
  y = kernels::binary(BinaryOp::Mul, mask, f32);
  EXPECT_EQ(y.dtype(), DType::Float32);
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{1.5f, 0.f}));
}

// PyTorch's rule for 0-dim operands: one raises the result dtype only when it is of a higher
// category (bool < integer < floating) than every operand with dims; among 0-dim operands
// alone, or among operands with dims, the usual promotion applies.
TEST(Binary, ZeroDimOperandPromotesOnlyAcrossCategories) {
  struct Case {
    DType a;
    Shape as;
    DType b;
    Shape bs;
    DType want;
  };
  const std::vector<Case> cases = {
      {DType::Float32, {3}, DType::Float64, {}, DType::Float32},
      {DType::Float64, {}, DType::Float32, {3}, DType::Float32},
      {DType::BFloat16, {3}, DType::Float32, {}, DType::BFloat16},
      {DType::Float16, {3}, DType::BFloat16, {}, DType::Float16},
      {DType::Int64, {3}, DType::Float32, {}, DType::Float32},
      {DType::Int32, {3}, DType::BFloat16, {}, DType::BFloat16},
      {DType::Int32, {3}, DType::Int64, {}, DType::Int32},
      {DType::Bool, {3}, DType::Int64, {}, DType::Int64},
      {DType::Int64, {3}, DType::Bool, {}, DType::Int64},
      {DType::Float32, {}, DType::Float64, {}, DType::Float64},
      {DType::Float32, {1}, DType::Float64, {3}, DType::Float64},
      {DType::Float32, {0}, DType::Float64, {}, DType::Float32},
  };
  for (const Case& c : cases) {
    const Tensor a = ones(c.as, c.a), b = full(c.bs, 2.0, c.b);
    const std::string what =
        std::string(dtype_name(c.a)) + shape_str(c.as) + " * " + dtype_name(c.b) + shape_str(c.bs);
    EXPECT_EQ(result_type(a, b), c.want) << what;
    const Tensor y = kernels::binary(BinaryOp::Mul, a, b);
    EXPECT_EQ(y.dtype(), c.want) << what;
    const double want = c.b == DType::Bool ? 1.0 : 2.0;  // full(2.0) of bool is true
    EXPECT_EQ(y.to_vector<double>(), std::vector<double>(size_t(y.numel()), want)) << what;
  }
  // Comparisons compute in that dtype too: 0.1f equals 0.1 rounded to float32.
  Tensor eq = kernels::compare(CompareOp::Eq, full({2}, 0.1), scalar_tensor(0.1, DType::Float64));
  EXPECT_EQ(eq.to_vector<bool>(), std::vector<bool>(2, true));
  eq = kernels::compare(CompareOp::Eq, full({1}, 0.1), full({1}, 0.1, DType::Float64));
  EXPECT_EQ(eq.to_vector<bool>(), std::vector<bool>{false});
}

TEST(BinaryAutograd, ZeroDimOperandGradientsKeepTheirDtype) {
  Tensor a = from_vector<float>({1, 2, 3}).to(DType::BFloat16);
  a.set_requires_grad(true);
  Tensor b = scalar_tensor(0.5, DType::Float64);
  b.set_requires_grad(true);
  Tensor y = mul(a, b);
  EXPECT_EQ(y.dtype(), DType::BFloat16);
  backward(sum(y));
  EXPECT_EQ(a.grad().dtype(), DType::BFloat16);
  EXPECT_EQ(a.grad().to_vector<float>(), std::vector<float>(3, 0.5f));
  EXPECT_EQ(b.grad().dtype(), DType::Float64);
  EXPECT_EQ(b.grad().shape(), Shape{});
  EXPECT_EQ(b.grad().item<double>(), 6.0);
  Tensor c = from_vector<float>({1, -2});
  c.set_requires_grad(true);
  Tensor d = scalar_tensor(4.0, DType::Float64);
  d.set_requires_grad(true);
  Tensor w = where(from_vector<bool>({true, false}), c, d);
  EXPECT_EQ(w.dtype(), DType::Float32);
  backward(sum(div(w, d)));
  EXPECT_EQ(c.grad().dtype(), DType::Float32);
  EXPECT_EQ(c.grad().to_vector<float>(), (std::vector<float>{0.25f, 0}));
  EXPECT_EQ(d.grad().dtype(), DType::Float64);
  // d/dd of (c0 + d) / d = 1/d - (c0 + d)/d^2 = 0.25 - 5/16
  EXPECT_DOUBLE_EQ(d.grad().item<double>(), 0.25 - 5.0 / 16.0);
}

TEST(Binary, HalfInputsRoundOnce) {
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    const auto a = rounded(wavy(64, -3, 3), dt), b = rounded(wavy(64, 0.5, 3, 0.4), dt);
    for (BinaryOp op : {BinaryOp::Add, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Maximum}) {
      Tensor y = kernels::binary(op, tensor_of(a, {8, 8}, dt), tensor_of(b, {8, 8}, dt));
      EXPECT_EQ(y.dtype(), dt);
      std::vector<double> want;
      for (size_t i = 0; i < a.size(); ++i)
        want.push_back(double(float(ref_binary(op, a[i], b[i]))));
      const double ulp = dt == DType::BFloat16 ? 1.0 / 128 : 1.0 / 1024;
      expect_close(y, rounded(want, dt), ulp, 1e-6, dtype_name(dt));
    }
  }
}

TEST(Binary, IntegerOps) {
  for (DType dt : {DType::Int32, DType::Int64}) {
    Tensor a = from_vector<int64_t>({5, -3, 7, 0, 2, 9}, {2, 3}).to(dt);
    Tensor b = from_vector<int64_t>({2, -4, 1}).to(dt);
    auto check = [&](BinaryOp op, std::vector<int64_t> want) {
      Tensor y = kernels::binary(op, a, b);
      EXPECT_EQ(y.dtype(), dt);
      EXPECT_EQ(y.to_vector<int64_t>(), want) << dtype_name(dt) << " op " << int(op);
    };
    check(BinaryOp::Add, {7, -7, 8, 2, -2, 10});
    check(BinaryOp::Sub, {3, 1, 6, -2, 6, 8});
    check(BinaryOp::Mul, {10, 12, 7, 0, -8, 9});
    check(BinaryOp::Maximum, {5, -3, 7, 2, 2, 9});
    check(BinaryOp::Minimum, {2, -4, 1, 0, -4, 1});
    for (BinaryOp op : {BinaryOp::Div, BinaryOp::Pow}) {
      const std::string msg = error_of([&] { kernels::binary(op, a, b); });
      EXPECT_NE(msg.find(dtype_name(dt)), std::string::npos) << msg;
    }
  }
  // Wraps instead of trapping, like PyTorch.
  Tensor big = from_vector<int32_t>({std::numeric_limits<int32_t>::max()});
  EXPECT_EQ(kernels::binary(BinaryOp::Add, big, from_vector<int32_t>({1})).item<int32_t>(),
            std::numeric_limits<int32_t>::min());
}

TEST(Binary, MaximumMinimumPropagateNaN) {
  Tensor a = from_vector<float>({float(kNaN), 1.f, 2.f});
  Tensor b = from_vector<float>({0.f, float(kNaN), 3.f});
  expect_close(kernels::binary(BinaryOp::Maximum, a, b), {kNaN, kNaN, 3}, 0, 0);
  expect_close(kernels::binary(BinaryOp::Minimum, a, b), {kNaN, kNaN, 2}, 0, 0);
}

// The gradients through a NaN, as torch gives them: maximum/minimum pass the gradient to both
// operands where either is NaN (neither loses), ties split it; relu passes it at NaN.
TEST(Binary, MaximumMinimumAndReluGradientsThroughNaN) {
  for (const bool is_max : {true, false}) {
    Tensor a = from_vector<float>({float(kNaN), 1.f, 2.f, 4.f}).set_requires_grad(true);
    Tensor b = from_vector<float>({0.f, float(kNaN), 2.f, 3.f}).set_requires_grad(true);
    backward(sum(is_max ? tessera::maximum(a, b) : tessera::minimum(a, b)));
    const std::vector<float> a_wins =
        is_max ? std::vector<float>{1, 1, 0.5f, 1} : std::vector<float>{1, 1, 0.5f, 0};
    const std::vector<float> b_wins =
        is_max ? std::vector<float>{1, 1, 0.5f, 0} : std::vector<float>{1, 1, 0.5f, 1};
    EXPECT_EQ(a.grad().to_vector<float>(), a_wins) << (is_max ? "maximum" : "minimum");
    EXPECT_EQ(b.grad().to_vector<float>(), b_wins) << (is_max ? "maximum" : "minimum");
  }
  Tensor x = from_vector<float>({float(kNaN), -1.f, 0.f, 2.f}).set_requires_grad(true);
  backward(sum(tessera::relu(x)));
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{1, 0, 0, 1}));
}

TEST(Binary, NonBroadcastableShapesNameBoth) {
  const std::string msg = error_of([] {
    kernels::binary(BinaryOp::Add, zeros({2, 3}), zeros({4}));
  });
  EXPECT_NE(msg.find("add"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4]"), std::string::npos) << msg;
  EXPECT_THROW(kernels::compare(CompareOp::Lt, zeros({3}), zeros({2})), Error);
  EXPECT_THROW(kernels::binary(BinaryOp::Add, from_vector<bool>({true}), from_vector<bool>({true})),
               Error);
}

TEST(BinaryScalar, AllOpsBothOrders) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    const auto a = rounded(wavy(20, 0.5, 3.0), dt);
    Tensor t = kernels::transpose(tensor_of(a, {4, 5}, dt), 0, 1);  // non-contiguous
    std::vector<double> at;
    for (int i = 0; i < 5; ++i)
      for (int j = 0; j < 4; ++j)
        at.push_back(a[size_t(j * 5 + i)]);
    for (BinaryOp op : kAllBinary) {
      for (double s : {1.75, 2.0, 0.5}) {
        const double tol = dt == DType::Float32 ? 1e-6 : 1e-15;
        const double sc = dt == DType::Float32 ? double(float(s)) : s;
        expect_close(kernels::binary_scalar(op, t, s),
                     map(at, [&](double v) { return ref_binary(op, v, sc); }), tol, tol, "a op s");
        expect_close(kernels::rbinary_scalar(op, s, t),
                     map(at, [&](double v) { return ref_binary(op, sc, v); }), tol, tol, "s op a");
      }
    }
  }
}

TEST(BinaryScalar, IntegerTensors) {
  Tensor a = from_vector<int32_t>({4, -2, 9});
  Tensor y = kernels::binary_scalar(BinaryOp::Mul, a, 3);
  EXPECT_EQ(y.dtype(), DType::Int32);
  EXPECT_EQ(y.to_vector<int32_t>(), (std::vector<int32_t>{12, -6, 27}));
  EXPECT_EQ(kernels::rbinary_scalar(BinaryOp::Sub, 10, a).to_vector<int32_t>(),
            (std::vector<int32_t>{6, 12, 1}));
  EXPECT_EQ(kernels::binary_scalar(BinaryOp::Maximum, a, 0).to_vector<int32_t>(),
            (std::vector<int32_t>{4, 0, 9}));
  const std::string msg = error_of([&] { kernels::binary_scalar(BinaryOp::Add, a, 0.5); });
  EXPECT_NE(msg.find("0.5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("int32"), std::string::npos) << msg;
  EXPECT_THROW(kernels::binary_scalar(BinaryOp::Div, a, 2), Error);
}

TEST(BinaryScalar, HalfTensorKeepsDtype) {
  Tensor a = from_vector<float>({1.f, 2.5f, -3.f}).to(DType::BFloat16);
  Tensor y = kernels::binary_scalar(BinaryOp::Mul, a, 0.5);
  EXPECT_EQ(y.dtype(), DType::BFloat16);
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{0.5f, 1.25f, -1.5f}));
}

// --- compare ---

TEST(Compare, AllOpsBroadcastAndDtypes) {
  const std::vector<std::pair<CompareOp, std::function<bool(double, double)>>> ops = {
      {CompareOp::Eq, [](double a, double b) { return a == b; }},
      {CompareOp::Ne, [](double a, double b) { return a != b; }},
      {CompareOp::Lt, [](double a, double b) { return a < b; }},
      {CompareOp::Le, [](double a, double b) { return a <= b; }},
      {CompareOp::Gt, [](double a, double b) { return a > b; }},
      {CompareOp::Ge, [](double a, double b) { return a >= b; }},
  };
  // Small integers so that ties occur.
  const std::vector<double> a = {1, 2, 3, 2, 1, 0, 3, 3, 1, 2, 2, 0};
  const std::vector<double> b = {2, 1, 3};
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16, DType::Int64,
                   DType::Int32}) {
    for (const auto& [op, f] : ops) {
      Tensor y = kernels::compare(op, tensor_of(a, {4, 3}, dt), tensor_of(b, {3}, DType::Int64));
      EXPECT_EQ(y.dtype(), DType::Bool);
      const auto want = ref_broadcast(a, {4, 3}, b, {3}, {4, 3},
                                      [&f](double u, double v) { return f(u, v) ? 1.0 : 0.0; });
      EXPECT_EQ(y.to_vector<double>(), want) << dtype_name(dt) << " op " << int(op);
      Tensor ys = kernels::compare_scalar(op, tensor_of(a, {4, 3}, dt), 2.0);
      EXPECT_EQ(ys.to_vector<double>(), map(a, [&f](double u) { return f(u, 2.0) ? 1.0 : 0.0; }))
          << "scalar " << dtype_name(dt) << " op " << int(op);
    }
  }
}

// A 16-bit tensor compares against the scalar rounded to its own dtype, as torch converts it:
// bfloat16(0.1) holds 0.10009765625, and x == 0.1 is true, as is the comparison with a 0-d
// tensor of 0.1.
TEST(Compare, SixteenBitTensorsAgainstAScalarRoundedToTheirDtype) {
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    const Tensor x = full({1}, 0.1, dt);
    for (CompareOp op : {CompareOp::Eq, CompareOp::Le, CompareOp::Ge})
      EXPECT_TRUE(kernels::compare_scalar(op, x, 0.1).item<bool>())
          << dtype_name(dt) << " op " << int(op);
    EXPECT_FALSE(kernels::compare_scalar(CompareOp::Lt, x, 0.1).item<bool>()) << dtype_name(dt);
    EXPECT_TRUE(kernels::compare(CompareOp::Eq, x, full({}, 0.1, DType::Float64)).item<bool>())
        << dtype_name(dt);
  }
}

TEST(Compare, IntegerAgainstFractionalScalarAndBool) {
  Tensor a = from_vector<int64_t>({0, 1, 2});
  EXPECT_EQ(kernels::compare_scalar(CompareOp::Lt, a, 0.5).to_vector<bool>(),
            (std::vector<bool>{true, false, false}));
  EXPECT_EQ(kernels::compare_scalar(CompareOp::Eq, a, 1.0).to_vector<bool>(),
            (std::vector<bool>{false, true, false}));
  Tensor m = from_vector<bool>({true, false});
  EXPECT_EQ(kernels::compare(CompareOp::Eq, m, from_vector<bool>({true, true})).to_vector<bool>(),
            (std::vector<bool>{true, false}));
  Tensor nan = from_vector<float>({float(kNaN)});
  EXPECT_FALSE(kernels::compare_scalar(CompareOp::Eq, nan, kNaN).item<bool>());
  EXPECT_TRUE(kernels::compare(CompareOp::Ne, nan, nan).item<bool>());
}

TEST(Compare, Int64AgainstAScalarJustPastItsRange) {
  // 2^63 is the double nearest INT64_MAX: it is not an int64, so the tensor compares against it
  // as a double (converted to int64 it became INT64_MIN, and 5 < 2^63 read false).
  const double two63 = 9223372036854775808.0;
  Tensor a = from_vector<int64_t>({5, -5, std::numeric_limits<int64_t>::min()});
  EXPECT_EQ(kernels::compare_scalar(CompareOp::Lt, a, two63).to_vector<bool>(),
            (std::vector<bool>{true, true, true}));
  EXPECT_EQ(kernels::compare_scalar(CompareOp::Eq, a, -two63).to_vector<bool>(),
            (std::vector<bool>{false, false, true}));
  // The largest double below 2^63 is an int64 and compares exactly.
  Tensor big = from_vector<int64_t>({int64_t(9223372036854774784LL), 9223372036854774785LL});
  EXPECT_EQ(kernels::compare_scalar(CompareOp::Eq, big, 9223372036854774784.0).to_vector<bool>(),
            (std::vector<bool>{true, false}));
  // Arithmetic with it is refused rather than wrapping by INT64_MIN.
  EXPECT_THROW(kernels::binary_scalar(BinaryOp::Add, a, two63), Error);
  Tensor m = a.clone();
  EXPECT_THROW(kernels::mul_scalar_(m, two63), Error);
  EXPECT_EQ(m.to_vector<int64_t>(), a.to_vector<int64_t>());
}
