// RMSNorm and LayerNorm: values against plain-loop references, gradients by finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "common/near.h"
#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::expect_error;
using tessera::testing::expect_near_all;
using tessera::testing::random_tensor;

namespace {

// Reference over rows of length d, in double. weight/bias may be empty (no affine).
std::vector<double> ref_rms_norm(const std::vector<double>& x, int64_t d,
                                 const std::vector<double>& w, double eps,
                                 std::vector<double>* rstd = nullptr) {
  std::vector<double> out(x.size());
  for (size_t r = 0; r < x.size() / size_t(d); ++r) {
    double ss = 0;
    for (int64_t j = 0; j < d; ++j)
      ss += x[r * d + j] * x[r * d + j];
    double rs = 1.0 / std::sqrt(ss / double(d) + eps);
    if (rstd) rstd->push_back(rs);
    for (int64_t j = 0; j < d; ++j)
      out[r * d + j] = x[r * d + j] * rs * (w.empty() ? 1.0 : w[size_t(j)]);
  }
  return out;
}

std::vector<double> ref_layer_norm(const std::vector<double>& x, int64_t d,
                                   const std::vector<double>& w, const std::vector<double>& b,
                                   double eps, std::vector<double>* mean = nullptr,
                                   std::vector<double>* rstd = nullptr) {
  std::vector<double> out(x.size());
  for (size_t r = 0; r < x.size() / size_t(d); ++r) {
    double mu = 0, var = 0;
    for (int64_t j = 0; j < d; ++j)
      mu += x[r * d + j];
    mu /= double(d);
    for (int64_t j = 0; j < d; ++j)
      var += (x[r * d + j] - mu) * (x[r * d + j] - mu);
    var /= double(d);
    double rs = 1.0 / std::sqrt(var + eps);
    if (mean) mean->push_back(mu);
    if (rstd) rstd->push_back(rs);
    for (int64_t j = 0; j < d; ++j) {
      double y = (x[r * d + j] - mu) * rs;
      if (!w.empty()) y *= w[size_t(j)];
      if (!b.empty()) y += b[size_t(j)];
      out[r * d + j] = y;
    }
  }
  return out;
}

std::vector<double> values(const Tensor& t) {
  return t.to_vector<double>();
}

}  // namespace

TEST(RmsNorm, MatchesReferenceWithAndWithoutWeight) {
  Tensor x = random_tensor({3, 4, 16}, 1, DType::Float32);
  Tensor w = random_tensor({16}, 2, DType::Float32);
  const double eps = 1e-6;

  kernels::NormResult r = kernels::rms_norm(x, w, eps);
  std::vector<double> rstd;
  std::vector<double> want = ref_rms_norm(values(x), 16, values(w), eps, &rstd);
  EXPECT_EQ(r.out.shape(), x.shape());
  EXPECT_EQ(r.out.dtype(), DType::Float32);
  EXPECT_EQ(r.rstd.shape(), (Shape{3, 4}));
  EXPECT_EQ(r.rstd.dtype(), DType::Float32);
  expect_near_all(values(r.out), want, 1e-5, "rms_norm out");
  expect_near_all(values(r.rstd), rstd, 1e-5, "rms_norm rstd");

  kernels::NormResult plain = kernels::rms_norm(x, Tensor(), eps);
  expect_near_all(values(plain.out), ref_rms_norm(values(x), 16, {}, eps), 1e-5,
                  "rms_norm without weight");
}

TEST(RmsNorm, NonContiguousInputAndFloat64) {
  // [16, 5] transposed: every row of the [5, 16] view is strided.
  Tensor base = random_tensor({16, 5}, 3, DType::Float64);
  Tensor x = kernels::transpose(base, 0, 1);
  ASSERT_FALSE(x.is_contiguous());
  Tensor w = random_tensor({16}, 4, DType::Float64);
  kernels::NormResult r = kernels::rms_norm(x, w, 1e-5);
  EXPECT_EQ(r.rstd.dtype(), DType::Float64);
  expect_near_all(values(r.out), ref_rms_norm(values(x), 16, values(w), 1e-5), 1e-12,
                  "rms_norm float64 strided");
}

TEST(RmsNorm, BFloat16InputComputesInFloat32) {
  Tensor x32 = random_tensor({4, 64}, 5, DType::Float32);
  Tensor x = x32.to(DType::BFloat16);
  Tensor w = random_tensor({64}, 6, DType::Float32).to(DType::BFloat16);
  kernels::NormResult r = kernels::rms_norm(x, w, 1e-6);
  EXPECT_EQ(r.out.dtype(), DType::BFloat16);
  EXPECT_EQ(r.rstd.dtype(), DType::Float32);
  // Reference on the bf16-rounded inputs; the only error left is the final bf16 rounding.
  expect_near_all(values(r.out), ref_rms_norm(values(x), 64, values(w), 1e-6), 1e-2,
                  "rms_norm bf16");
}

TEST(LayerNorm, MatchesReferenceAffineAndPlain) {
  Tensor x = random_tensor({2, 3, 10}, 7, DType::Float32);
  // A large row mean checks the two-pass variance.
  Tensor shifted = x.to(DType::Float64);
  double* p = shifted.data<double>();
  for (int64_t i = 0; i < shifted.numel(); ++i)
    p[i] += 1000.0;
  Tensor xs = shifted.to(DType::Float32);
  Tensor w = random_tensor({10}, 8, DType::Float32);
  Tensor b = random_tensor({10}, 9, DType::Float32);
  const double eps = 1e-5;

  // float32 rounding of a mean near 1000 costs ~1e-4 in the centred values; the one-pass formula
  // would be off by percents.
  for (auto [in, tol] : {std::pair{x, 1e-5}, std::pair{xs, 1e-3}}) {
    kernels::NormResult r = kernels::layer_norm(in, w, b, eps);
    std::vector<double> mean, rstd;
    std::vector<double> want =
        ref_layer_norm(values(in), 10, values(w), values(b), eps, &mean, &rstd);
    EXPECT_EQ(r.mean.shape(), (Shape{2, 3}));
    EXPECT_EQ(r.rstd.shape(), (Shape{2, 3}));
    expect_near_all(values(r.out), want, tol, "layer_norm out");
    expect_near_all(values(r.mean), mean, 1e-6, "layer_norm mean");
    expect_near_all(values(r.rstd), rstd, tol, "layer_norm rstd");
  }

  expect_near_all(values(kernels::layer_norm(x, Tensor(), Tensor(), eps).out),
                  ref_layer_norm(values(x), 10, {}, {}, eps), 1e-5, "layer_norm plain");
  expect_near_all(values(kernels::layer_norm(x, Tensor(), b, eps).out),
                  ref_layer_norm(values(x), 10, {}, values(b), eps), 1e-5, "layer_norm bias only");
}

TEST(LayerNorm, BFloat16Input) {
  Tensor x = random_tensor({5, 32}, 10, DType::Float32).to(DType::BFloat16);
  Tensor w = random_tensor({32}, 11, DType::Float32);
  Tensor b = random_tensor({32}, 12, DType::Float32);
  kernels::NormResult r = kernels::layer_norm(x, w, b, 1e-5);
  EXPECT_EQ(r.out.dtype(), DType::BFloat16);
  expect_near_all(values(r.out), ref_layer_norm(values(x), 32, values(w), values(b), 1e-5), 1e-2,
                  "layer_norm bf16");
}

TEST(RmsNorm, GradcheckInputAndWeight) {
  Tensor x = random_tensor({2, 3, 6}, 13, DType::Float64).set_requires_grad(true);
  Tensor w = random_tensor({6}, 14, DType::Float64).set_requires_grad(true);
  GradcheckResult with_w =
      gradcheck([](const std::vector<Tensor>& in) { return rms_norm(in[0], in[1], 1e-6); }, {x, w});
  EXPECT_TRUE(with_w.ok) << with_w.message;
  GradcheckResult no_w =
      gradcheck([](const std::vector<Tensor>& in) { return rms_norm(in[0], Tensor(), 1e-6); }, {x});
  EXPECT_TRUE(no_w.ok) << no_w.message;
}

TEST(LayerNorm, GradcheckInputWeightBias) {
  Tensor x = random_tensor({4, 7}, 15, DType::Float64).set_requires_grad(true);
  Tensor w = random_tensor({7}, 16, DType::Float64).set_requires_grad(true);
  Tensor b = random_tensor({7}, 17, DType::Float64).set_requires_grad(true);
  GradcheckResult all =
      gradcheck([](const std::vector<Tensor>& in) { return layer_norm(in[0], in[1], in[2], 1e-5); },
                {x, w, b});
  EXPECT_TRUE(all.ok) << all.message;
  GradcheckResult plain = gradcheck(
      [](const std::vector<Tensor>& in) { return layer_norm(in[0], Tensor(), Tensor(), 1e-5); },
      {x});
  EXPECT_TRUE(plain.ok) << plain.message;
  GradcheckResult bias_only = gradcheck(
      [](const std::vector<Tensor>& in) { return layer_norm(in[0], Tensor(), in[1], 1e-5); },
      {x, b});
  EXPECT_TRUE(bias_only.ok) << bias_only.message;
}

TEST(LayerNorm, ParameterGradientsKeepParameterDtype) {
  // float32 activations with float64 parameters: each gradient comes back in its tensor's dtype.
  Tensor x = random_tensor({3, 8}, 18, DType::Float32).set_requires_grad(true);
  Tensor w = random_tensor({8}, 19, DType::Float64).set_requires_grad(true);
  Tensor b = random_tensor({8}, 20, DType::Float64).set_requires_grad(true);
  Tensor y = layer_norm(x, w, b);
  EXPECT_EQ(y.dtype(), DType::Float32);
  Tensor g = random_tensor({3, 8}, 21, DType::Float32);
  backward(y, g);
  ASSERT_TRUE(x.grad().defined() && w.grad().defined() && b.grad().defined());
  EXPECT_EQ(x.grad().dtype(), DType::Float32);
  EXPECT_EQ(w.grad().dtype(), DType::Float64);
  EXPECT_EQ(b.grad().dtype(), DType::Float64);
  // d/db sum(g * y) is the column sum of g.
  std::vector<double> gv = values(g), want(8, 0.0);
  for (size_t i = 0; i < gv.size(); ++i)
    want[i % 8] += gv[i];
  expect_near_all(values(b.grad()), want, 1e-6, "layer_norm grad_bias");
}

TEST(NormErrors, ShapesAreNamed) {
  Tensor x = random_tensor({2, 8}, 22, DType::Float32);
  Tensor w = random_tensor({7}, 23, DType::Float32);
  expect_error([&] { kernels::rms_norm(x, w, 1e-6); }, "weight of shape [7]");
  expect_error([&] { kernels::layer_norm(x, Tensor(), w, 1e-5); }, "bias of shape [7]");
  expect_error([&] { kernels::rms_norm(arange(4), Tensor(), 1e-6); }, "must be floating");
  Tensor r = kernels::rms_norm(x, Tensor(), 1e-6).rstd;
  expect_error(
      [&] {
        kernels::rms_norm_backward(random_tensor({2, 4}, 24, DType::Float64), x, Tensor(), r);
      },
      "grad_out [2, 4] does not match x [2, 8]");
}
