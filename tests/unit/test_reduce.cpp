// Reduction kernels and their autograd ops. References iterate over every element with their own
// index arithmetic and accumulate in double (or exactly, for integers).
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
using tessera::testing::error_of;
using tessera::testing::expect_error;

namespace {

// Folds the row-major values `v` of `shape` over `dims` (empty = all) with `f`, starting from
// `init`; returns the keepdim-shaped result in row-major order.
std::vector<double> ref_reduce(const std::vector<double>& v, const Shape& shape,
                               const std::vector<int64_t>& dims, double init,
                               const std::function<double(double, double)>& f) {
  const size_t nd = shape.size();
  std::vector<bool> red(nd, dims.empty());
  for (int64_t d : dims)
    red[size_t(d < 0 ? d + int64_t(nd) : d)] = true;
  Shape keep = shape;
  for (size_t d = 0; d < nd; ++d)
    if (red[d]) keep[d] = 1;
  std::vector<double> out(static_cast<size_t>(shape_numel(keep)), init);
  for (int64_t flat = 0; flat < shape_numel(shape); ++flat) {
    int64_t rem = flat, oidx = 0, mul = 1;
    for (size_t k = 0; k < nd; ++k) {
      const size_t d = nd - 1 - k;
      const int64_t c = rem % shape[d];
      rem /= shape[d];
      if (!red[d]) oidx += c * mul;
      mul *= keep[d];
    }
    out[size_t(oidx)] = f(out[size_t(oidx)], v[size_t(flat)]);
  }
  return out;
}

double plus(double a, double b) {
  return a + b;
}
double nan_max(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? kNaN : std::max(a, b);
}
double nan_min(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? kNaN : std::min(a, b);
}

Shape squeeze_dims(const Shape& shape, const std::vector<int64_t>& dims) {
  Shape out;
  for (size_t d = 0; d < shape.size(); ++d) {
    bool red = dims.empty();
    for (int64_t r : dims)
      red = red || size_t(r < 0 ? r + int64_t(shape.size()) : r) == d;
    if (!red) out.push_back(shape[d]);
  }
  return out;
}

Shape keep_dims(const Shape& shape, const std::vector<int64_t>& dims) {
  Shape out = shape;
  for (size_t d = 0; d < shape.size(); ++d) {
    bool red = dims.empty();
    for (int64_t r : dims)
      red = red || size_t(r < 0 ? r + int64_t(shape.size()) : r) == d;
    if (red) out[d] = 1;
  }
  return out;
}

const Shape kShape = {3, 4, 5};
const std::vector<std::vector<int64_t>> kDimSets = {{},     {0},    {1},    {2},      {-1},
                                                    {0, 2}, {1, 2}, {0, 1}, {2, 0, 1}};

}  // namespace

TEST(Sum, AllDimSetsFloatDtypes) {
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16}) {
    const auto v = rounded(wavy(60, -2, 3), dt);
    Tensor x = tensor_of(v, kShape, dt);
    for (const auto& dims : kDimSets) {
      for (bool keepdim : {false, true}) {
        Tensor s = kernels::sum(x, dims, keepdim);
        Tensor m = kernels::mean(x, dims, keepdim);
        EXPECT_EQ(s.dtype(), dt);
        EXPECT_EQ(m.dtype(), dt);
        const auto want = ref_reduce(v, kShape, dims, 0.0, plus);
        EXPECT_EQ(s.shape(), keepdim ? keep_dims(kShape, dims) : squeeze_dims(kShape, dims));
        EXPECT_EQ(m.shape(), s.shape());
        const double count = 60.0 / double(want.size());
        std::vector<double> want_mean;
        for (double w : want)
          want_mean.push_back(w / count);
        // One rounding of the exact result into the output dtype.
        const double tol = dt == DType::Float64    ? 1e-14
                           : dt == DType::Float32  ? 1e-6
                           : dt == DType::BFloat16 ? 1.0 / 128
                                                   : 1.0 / 1024;
        const std::string what = std::string(dtype_name(dt)) + " dims " + shape_str(dims);
        expect_close(s, want, tol, tol, what);
        expect_close(m, want_mean, tol, tol, what);
      }
    }
  }
}

TEST(Sum, NonContiguousInputs) {
  const auto v = wavy(60, -2, 3);
  Tensor base = tensor_of(v, kShape, DType::Float32);
  const auto vf = rounded(v, DType::Float32);
  // permute to [5, 3, 4]: memory order differs from logical order.
  Tensor p = kernels::permute(base, {2, 0, 1});
  std::vector<double> pv;
  for (int k = 0; k < 5; ++k)
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 4; ++j)
        pv.push_back(vf[size_t((i * 4 + j) * 5 + k)]);
  for (const auto& dims : kDimSets) {
    expect_close(kernels::sum(p, dims), ref_reduce(pv, {5, 3, 4}, dims, 0.0, plus), 1e-6, 1e-6,
                 "permuted sum " + shape_str(dims));
    expect_close(kernels::amax(p, dims), ref_reduce(pv, {5, 3, 4}, dims, -INFINITY, nan_max), 0, 0,
                 "permuted amax " + shape_str(dims));
  }
  // Strided slice [3, 2, 5] (every other column of dim 1).
  Tensor s = kernels::slice(base, 1, 0, 4, 2);
  std::vector<double> sv;
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; j += 2)
      for (int k = 0; k < 5; ++k)
        sv.push_back(vf[size_t((i * 4 + j) * 5 + k)]);
  for (const auto& dims : kDimSets) {
    expect_close(kernels::sum(s, dims, true), ref_reduce(sv, {3, 2, 5}, dims, 0.0, plus), 1e-6,
                 1e-6, "sliced sum " + shape_str(dims));
  }
  // Expanded input (stride 0): sum over the broadcast dim multiplies.
  Tensor e = kernels::expand(from_vector<float>({1.5f, -2.f}, {2, 1}), {2, 7});
  EXPECT_EQ(kernels::sum(e, {1}).to_vector<float>(), (std::vector<float>{10.5f, -14.f}));
}

TEST(Sum, IntegerAndBoolGiveInt64) {
  Tensor i32 = from_vector<int32_t>({2000000000, 2000000000, -5, 7}, {2, 2});
  Tensor s = kernels::sum(i32);
  EXPECT_EQ(s.dtype(), DType::Int64);
  EXPECT_EQ(s.item<int64_t>(), 4000000002);
  EXPECT_EQ(kernels::sum(i32, {0}).to_vector<int64_t>(),
            (std::vector<int64_t>{1999999995, 2000000007}));
  Tensor mask = from_vector<bool>({true, false, true, true, false, true}, {2, 3});
  Tensor c = kernels::sum(mask, {1});
  EXPECT_EQ(c.dtype(), DType::Int64);
  EXPECT_EQ(c.to_vector<int64_t>(), (std::vector<int64_t>{2, 2}));
  const std::string msg = error_of([&] { kernels::mean(i32); });
  EXPECT_NE(msg.find("int32"), std::string::npos) << msg;
}

TEST(Sum, IntegerTotalsPastInt64WrapAround) {
  // As torch.sum: two's complement wrap-around, where adding in int64 was undefined behaviour.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(kernels::sum(from_vector<int64_t>({kMax, 1})).item<int64_t>(), kMin);
  // A contiguous run long enough for the independent lanes: 40 * (2^63 - 1) = -40 mod 2^64.
  const Tensor run = from_vector<int64_t>(std::vector<int64_t>(40, kMax));
  EXPECT_EQ(kernels::sum(run).item<int64_t>(), -40);
  // Over a strided dim, downwards: kMin - 1 = kMax.
  const Tensor cols = from_vector<int64_t>({kMin, 3, -1, 4}, {2, 2});
  EXPECT_EQ(kernels::sum(cols, {0}).to_vector<int64_t>(), (std::vector<int64_t>{kMax, 7}));
}

TEST(Sum, Float32IsAccurateOverLongRuns) {
  // 0.1f summed 2^22 times: float32 running sums drift by percent; the kernel must not.
  const int64_t n = int64_t(1) << 22;
  Tensor x = full({n}, 0.1, DType::Float32);
  const double exact = double(0.1f) * double(n);
  EXPECT_NEAR(kernels::sum(x).item<float>(), exact, exact * 1e-7);
  EXPECT_NEAR(kernels::mean(x).item<float>(), double(0.1f), 1e-8);
  // Same along the outer dim (the vertical path) and along a strided inner dim.
  Tensor m = full({n / 4, 4}, 0.1, DType::Float32);
  for (float v : kernels::sum(m, {0}).to_vector<float>())
    EXPECT_NEAR(v, exact / 4, exact * 1e-7);
  Tensor t = kernels::transpose(m, 0, 1);  // [4, n/4], dim 1 has stride 4
  for (float v : kernels::sum(t, {1}).to_vector<float>())
    EXPECT_NEAR(v, exact / 4, exact * 1e-7);
}

TEST(Sum, EmptyAndZeroDim) {
  Tensor e = zeros({0, 3});
  EXPECT_EQ(kernels::sum(e, {0}).to_vector<float>(), (std::vector<float>{0, 0, 0}));
  EXPECT_EQ(kernels::sum(e, {1}).shape(), (Shape{0}));
  EXPECT_TRUE(std::isnan(kernels::mean(e).item<float>()));
  Tensor s = scalar_tensor(2.5, DType::Float64);
  EXPECT_EQ(kernels::sum(s).item<double>(), 2.5);
  EXPECT_EQ(kernels::sum(s, {0}).shape(), Shape{});
  EXPECT_EQ(kernels::mean(s, {-1}, true).item<double>(), 2.5);
}

TEST(Sum, DimErrors) {
  Tensor x = zeros({2, 3});
  std::string msg = error_of([&] { kernels::sum(x, {2}); });
  EXPECT_NE(msg.find("sum"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2"), std::string::npos) << msg;
  msg = error_of([&] { kernels::sum(x, {1, -1}); });
  EXPECT_NE(msg.find("more than once"), std::string::npos) << msg;
}

TEST(AmaxAmin, AllDimSetsAndDtypes) {
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16, DType::Int64,
                   DType::Int32}) {
    std::vector<double> v = rounded(wavy(60, -50, 50), dt);
    if (dt == DType::Int64 || dt == DType::Int32)
      for (double& e : v)
        e = std::round(e);
    Tensor x = tensor_of(v, kShape, dt);
    for (const auto& dims : kDimSets) {
      for (bool keepdim : {false, true}) {
        Tensor mx = kernels::amax(x, dims, keepdim), mn = kernels::amin(x, dims, keepdim);
        EXPECT_EQ(mx.dtype(), dt);
        EXPECT_EQ(mx.shape(), keepdim ? keep_dims(kShape, dims) : squeeze_dims(kShape, dims));
        const std::string what = std::string(dtype_name(dt)) + " dims " + shape_str(dims);
        // Selection is exact.
        expect_close(mx, ref_reduce(v, kShape, dims, -INFINITY, nan_max), 0, 0, what);
        expect_close(mn, ref_reduce(v, kShape, dims, INFINITY, nan_min), 0, 0, what);
      }
    }
  }
}

TEST(AmaxAmin, NaNPropagatesAndEmptyIsAnError) {
  std::vector<double> v = wavy(200, -1, 1);
  v[123] = kNaN;  // row 1 of [2, 100]; long rows exercise the vectorised lanes
  Tensor x = tensor_of(v, {2, 100}, DType::Float32);
  const auto mx = kernels::amax(x, {1}).to_vector<double>();
  EXPECT_FALSE(std::isnan(mx[0]));
  EXPECT_TRUE(std::isnan(mx[1]));
  EXPECT_TRUE(std::isnan(kernels::amin(x).item<double>()));
  const std::string msg = error_of([] { kernels::amax(zeros({3, 0}), {1}); });
  EXPECT_NE(msg.find("[3, 0]"), std::string::npos) << msg;
  EXPECT_EQ(kernels::amax(zeros({0, 3}), {1}).shape(), (Shape{0}));
}

// PyTorch refuses to reduce an empty dim by max or min even when the result has no elements
// to define; reducing a non-empty dim of an empty tensor is an empty result.
TEST(AmaxAmin, EmptyReducedDimIsAnErrorEvenWithAnEmptyResult) {
  for (bool keepdim : {false, true}) {
    expect_error(
        [&] {
          kernels::amax(zeros({0, 0}), {0}, keepdim);
        },
        {"amax", "[0, 0]", "non-zero size"});
    expect_error(
        [&] {
          kernels::amin(zeros({0, 0}), {1}, keepdim);
        },
        {"amin", "[0, 0]", "non-zero size"});
    expect_error([&] { kernels::amax(zeros({2, 0, 0}), {}, keepdim); }, {"amax", "[2, 0, 0]"});
    expect_error([&] { tessera::amax(zeros({0, 0}), {0}, keepdim); }, {"amax", "[0, 0]"});
  }
  EXPECT_EQ(kernels::amin(zeros({0, 3}), {1}, true).shape(), (Shape{0, 1}));
  expect_error([&] { kernels::max(zeros({0, 0}), 0); }, {"max", "[0, 0]"});
  expect_error([&] { kernels::argmax(zeros({0, 0}), 1); }, {"max", "[0, 0]"});
  EXPECT_EQ(kernels::max(zeros({3, 0}), 0).values.shape(), (Shape{0}));
  EXPECT_EQ(kernels::argmax(zeros({3, 0}), 0, true).shape(), (Shape{1, 0}));
}

TEST(Max, ValuesAndFirstIndexEveryDim) {
  // Small integers so that ties are common; the first maximum's index must win.
  std::vector<double> v(60);
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = double((i * 7 + 3) % 4);
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Int64}) {
    Tensor x = tensor_of(v, kShape, dt);
    for (int64_t dim = -3; dim < 3; ++dim) {
      const int64_t d = dim < 0 ? dim + 3 : dim;
      for (bool keepdim : {false, true}) {
        auto r = kernels::max(x, dim, keepdim);
        EXPECT_EQ(r.values.dtype(), dt);
        EXPECT_EQ(r.indices.dtype(), DType::Int64);
        EXPECT_EQ(r.values.shape(), keepdim ? keep_dims(kShape, {d}) : squeeze_dims(kShape, {d}));
        EXPECT_EQ(r.indices.shape(), r.values.shape());
        // Reference: scan dim d in index order, strict > keeps the first maximum.
        Shape keep = keep_dims(kShape, {d});
        std::vector<double> best(size_t(shape_numel(keep)), -INFINITY), arg(best.size(), -1);
        for (int i = 0; i < 3; ++i)
          for (int j = 0; j < 4; ++j)
            for (int k = 0; k < 5; ++k) {
              const int64_t c[3] = {i, j, k};
              int64_t o = 0;
              for (int q = 0; q < 3; ++q)
                o = o * keep[size_t(q)] + (q == d ? 0 : c[q]);
              const double e = v[size_t((i * 4 + j) * 5 + k)];
              if (e > best[size_t(o)]) {
                best[size_t(o)] = e;
                arg[size_t(o)] = double(c[d]);
              }
            }
        expect_close(r.values, best, 0, 0, "values dim " + std::to_string(dim));
        expect_close(r.indices, arg, 0, 0, "indices dim " + std::to_string(dim));
        expect_close(kernels::argmax(x, dim, keepdim), arg, 0, 0, "argmax");
      }
    }
  }
}

TEST(Max, NonContiguousUsesLogicalIndices) {
  // Transposed [4, 3] view of a [3, 4] tensor: dim 1 of the view has stride 4 in memory, dim 0
  // stride 1, which sends dim 0 down the unit-stride scan and dim 1 down the slice sweep.
  Tensor base = from_vector<float>({1, 9, 3, 9, 8, 2, 8, 0, 4, 4, 7, 6}, {3, 4});
  Tensor t = kernels::transpose(base, 0, 1);  // rows: {1,8,4} {9,2,4} {3,8,7} {9,0,6}
  auto r1 = kernels::max(t, 1);
  EXPECT_EQ(r1.values.to_vector<float>(), (std::vector<float>{8, 9, 8, 9}));
  EXPECT_EQ(r1.indices.to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 1, 0}));
  auto r0 = kernels::max(t, 0);
  EXPECT_EQ(r0.values.to_vector<float>(), (std::vector<float>{9, 8, 7}));
  EXPECT_EQ(r0.indices.to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 2}));
}

TEST(Max, NaNWinsAndErrors) {
  Tensor x = from_vector<double>({1, kNaN, 5, kNaN, 2, 0}, {2, 3});
  auto r = kernels::max(x, 1);
  EXPECT_TRUE(std::isnan(r.values.to_vector<double>()[0]));
  EXPECT_EQ(r.indices.to_vector<int64_t>(), (std::vector<int64_t>{1, 0}));
  auto c = kernels::max(x, 0);
  EXPECT_EQ(c.indices.to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 0}));
  EXPECT_THROW(kernels::max(x, 2), Error);
  const std::string msg = error_of([] { kernels::argmax(zeros({2, 0}), 1); });
  EXPECT_NE(msg.find("[2, 0]"), std::string::npos) << msg;
  auto s = kernels::max(scalar_tensor(3.0), 0);
  EXPECT_EQ(s.values.item<float>(), 3.f);
  EXPECT_EQ(s.indices.item<int64_t>(), 0);
}

// --- autograd ---

TEST(ReduceAutograd, Gradcheck) {
  for (const auto& dims : kDimSets) {
    for (bool keepdim : {false, true}) {
      const std::string what = shape_str(dims) + (keepdim ? " keepdim" : "");
      Tensor x = leaf(wavy(60, -2, 2), kShape);
      GradcheckResult r = gradcheck(
          [&](const std::vector<Tensor>& in) { return tessera::sum(in[0], dims, keepdim); }, {x});
      EXPECT_TRUE(r.ok) << "sum " << what << ": " << r.message;
      r = gradcheck(
          [&](const std::vector<Tensor>& in) { return tessera::mean(in[0], dims, keepdim); }, {x});
      EXPECT_TRUE(r.ok) << "mean " << what << ": " << r.message;
      // wavy values are distinct, so amax is differentiable at them.
      r = gradcheck(
          [&](const std::vector<Tensor>& in) { return tessera::amax(in[0], dims, keepdim); }, {x});
      EXPECT_TRUE(r.ok) << "amax " << what << ": " << r.message;
    }
  }
}

TEST(ReduceAutograd, AmaxSplitsGradientAmongTies) {
  Tensor x = leaf({3, 1, 3, 2, 2, 2, 0, 5, 1}, {3, 3});
  backward(tessera::amax(x, {1}), from_vector<double>({6, 3, 2}));
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{3, 0, 3, 1, 1, 1, 0, 2, 0}));
  Tensor y = leaf({4, 4, 1, 4}, {2, 2});
  backward(tessera::amax(y));
  expect_close(y.grad(), {1.0 / 3, 1.0 / 3, 0, 1.0 / 3}, 1e-15, 0);
}

TEST(ReduceAutograd, AmaxOfASliceHoldingNaNHasNaNGradients) {
  // torch's amax backward is (g / mask.sum(dims)) * mask with mask = (x == amax): a NaN maximum
  // equals no element, so the whole slice gets g / 0 * 0 = NaN rather than a silent zero.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor x = leaf({1, 2, nan, 0, 3, 3}, {3, 2});
  backward(tessera::amax(x, {1}), from_vector<double>({4, 5, 6}));
  const std::vector<double> g = x.grad().to_vector<double>();
  EXPECT_EQ(g[0], 0.0);
  EXPECT_EQ(g[1], 4.0);
  EXPECT_TRUE(std::isnan(g[2]));
  EXPECT_TRUE(std::isnan(g[3]));
  EXPECT_EQ(g[4], 3.0);
  EXPECT_EQ(g[5], 3.0);
  Tensor y = leaf({2, nan, 1}, {3});
  backward(tessera::amax(y));
  for (double v : y.grad().to_vector<double>())
    EXPECT_TRUE(std::isnan(v)) << v;
}

TEST(ReduceAutograd, ValuesAndGradientShapes) {
  Tensor x = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  x.set_requires_grad(true);
  Tensor m = tessera::mean(x, {0});
  EXPECT_EQ(m.to_vector<float>(), (std::vector<float>{2.5f, 3.5f, 4.5f}));
  backward(tessera::sum(m));
  EXPECT_EQ(x.grad().shape(), (Shape{2, 3}));
  EXPECT_EQ(x.grad().dtype(), DType::Float32);
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>(6, 0.5f)));
  EXPECT_TRUE(x.grad().is_contiguous());
}
