// Basic layers (Linear, Embedding, RMSNorm, LayerNorm): values against direct loops, initial
// values against the generator's draws, and gradients by finite differences through
// Module::operator(). The Module machinery the layers rely on (layers_modules.cpp) and shared
// modules and tied weights (layers_tied_weights.cpp) are compiled into this same binary.
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

namespace {

// Makes a layer's parameter a float64 leaf holding `value`.
void set_param(Parameter& p, const Tensor& value) {
  p = Parameter(value.to(DType::Float64).clone());
}

}  // namespace

// --- Linear ---

TEST(LinearLayer, ForwardMatchesDirectComputation) {
  Generator gen(7);
  Linear lin(5, 3, true, gen);
  Tensor x = random_tensor({2, 4, 5}, 1, DType::Float32);
  Tensor y = lin(x);
  ASSERT_EQ(y.shape(), (Shape{2, 4, 3}));
  auto xv = x.to_vector<double>(), wv = lin.weight.local().to_vector<double>(),
       bv = lin.bias.local().to_vector<double>();
  std::vector<double> want;
  for (int r = 0; r < 8; ++r)
    for (int o = 0; o < 3; ++o) {
      double s = bv[size_t(o)];
      for (int k = 0; k < 5; ++k)
        s += xv[size_t(r * 5 + k)] * wv[size_t(o * 5 + k)];
      want.push_back(s);
    }
  expect_near_all(y, want, 1e-5, "linear");
}

TEST(LinearLayer, WithoutBiasHasOnlyWeight) {
  Generator gen(3);
  auto lp = std::make_shared<Linear>(4, 2, false, gen);
  Linear& lin = *lp;
  EXPECT_FALSE(lin.bias.defined());
  EXPECT_EQ(names_of(lin), (std::vector<std::string>{"weight"}));
  Tensor x = random_tensor({3, 4}, 2, DType::Float32);
  Tensor y = lin(x);
  auto xv = x.to_vector<double>(), wv = lin.weight.local().to_vector<double>();
  std::vector<double> want;
  for (int r = 0; r < 3; ++r)
    for (int o = 0; o < 2; ++o) {
      double s = 0;
      for (int k = 0; k < 4; ++k)
        s += xv[size_t(r * 4 + k)] * wv[size_t(o * 4 + k)];
      want.push_back(s);
    }
  expect_near_all(y, want, 1e-5, "linear without bias");
}

TEST(LinearLayer, InitDrawsWeightThenBiasFromTheGenerator) {
  Generator gen(42);
  auto lp = std::make_shared<Linear>(6, 4, true, gen);
  Linear& lin = *lp;
  EXPECT_EQ(names_of(lin), (std::vector<std::string>{"weight", "bias"}));
  // PyTorch: kaiming_uniform(a = sqrt(5)) gives bound 1/sqrt(in) for W, and b ~ U(+-1/sqrt(in)).
  const double bound = 1.0 / std::sqrt(6.0);
  Generator ref(42);
  Tensor w = empty({4, 6});
  uniform_(w, -bound, bound, ref);
  Tensor b = empty({4});
  uniform_(b, -bound, bound, ref);
  expect_equal(lin.weight.local(), w, "weight draw");
  expect_equal(lin.bias.local(), b, "bias draw");
  EXPECT_EQ(gen.offset(), ref.offset());
  for (double v : lin.weight.local().to_vector<double>())
    EXPECT_LE(std::abs(v), bound);
  EXPECT_TRUE(lin.weight.requires_grad());
  EXPECT_TRUE(lin.bias.requires_grad());
}

TEST(LinearLayer, RejectsWrongInputWidth) {
  Generator gen(1);
  Linear lin(4, 2, true, gen);
  expect_error([&] { lin(zeros({3, 5})); }, {"Linear(4 -> 2)", "[3, 5]", "last dim 4"});
}

TEST(LinearLayer, GradcheckThroughModuleCall) {
  Generator gen(5);
  Linear lin(4, 3, true, gen);
  set_param(lin.weight, random_tensor({3, 4}, 11, DType::Float64));
  set_param(lin.bias, random_tensor({3}, 12, DType::Float64));
  Tensor x = random_tensor({2, 4}, 13, DType::Float64).set_requires_grad(true);
  auto r = gradcheck([&](const std::vector<Tensor>& in) { return lin(in[0]); },
                     {x, lin.weight.local(), lin.bias.local()});
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_TRUE(lin.weight.grad().defined());
}

// --- Embedding ---

TEST(EmbeddingLayer, LooksUpRowsAndDrawsNormalInit) {
  Generator gen(9);
  Embedding emb(7, 3, gen);
  Generator ref(9);
  expect_equal(emb.weight.local(), randn({7, 3}, ref), "N(0, 1) init");
  Tensor ids = from_vector<int64_t>({6, 0, 2, 2, 5, 1}, {2, 3});
  Tensor y = emb(ids);
  ASSERT_EQ(y.shape(), (Shape{2, 3, 3}));
  auto wv = emb.weight.local().to_vector<double>();
  std::vector<double> want;
  for (int64_t id : ids.to_vector<int64_t>())
    for (int d = 0; d < 3; ++d)
      want.push_back(wv[size_t(id * 3 + d)]);
  expect_near_all(y, want, 0, "embedding rows");
}

TEST(EmbeddingLayer, GradcheckThroughModuleCall) {
  Generator gen(4);
  Embedding emb(5, 3, gen);
  set_param(emb.weight, random_tensor({5, 3}, 21, DType::Float64));
  Tensor ids = from_vector<int64_t>({4, 1, 1, 0}, {2, 2});
  auto r = gradcheck([&](const std::vector<Tensor>&) { return emb(ids); }, {emb.weight.local()});
  EXPECT_TRUE(r.ok) << r.message;
  // Repeated id 1 accumulates twice; id 2 and 3 get nothing.
  auto g = emb.weight.grad().to_vector<double>();
  for (int d = 0; d < 3; ++d) {
    EXPECT_EQ(g[size_t(2 * 3 + d)], 0.0);
    EXPECT_EQ(g[size_t(3 * 3 + d)], 0.0);
  }
}

// --- norms ---

TEST(NormLayers, RMSNormMatchesDirectComputation) {
  auto np = std::make_shared<RMSNorm>(4, 1e-5);
  RMSNorm& norm = *np;
  EXPECT_EQ(names_of(norm), (std::vector<std::string>{"weight"}));
  expect_near_all(norm.weight.local(), {1, 1, 1, 1}, 0, "ones");
  norm.weight.copy_from_full(from_vector<float>({0.5f, -1.f, 2.f, 1.5f}));
  Tensor x = random_tensor({3, 4}, 31, DType::Float32);
  auto xv = x.to_vector<double>();
  const double w[] = {0.5, -1, 2, 1.5};
  std::vector<double> want;
  for (int r = 0; r < 3; ++r) {
    double ss = 0;
    for (int j = 0; j < 4; ++j)
      ss += xv[size_t(r * 4 + j)] * xv[size_t(r * 4 + j)];
    const double rs = 1.0 / std::sqrt(ss / 4 + 1e-5);
    for (int j = 0; j < 4; ++j)
      want.push_back(xv[size_t(r * 4 + j)] * rs * w[j]);
  }
  expect_near_all(norm(x), want, 1e-5, "rms_norm");
}

TEST(NormLayers, LayerNormMatchesDirectComputation) {
  auto np = std::make_shared<LayerNorm>(5);
  LayerNorm& norm = *np;
  EXPECT_EQ(names_of(norm), (std::vector<std::string>{"weight", "bias"}));
  expect_near_all(norm.weight.local(), {1, 1, 1, 1, 1}, 0, "ones");
  expect_near_all(norm.bias.local(), {0, 0, 0, 0, 0}, 0, "zeros");
  const std::vector<double> w = {1, 2, -1, 0.5, 3}, b = {0.1, 0, -0.2, 1, 0.5};
  norm.weight.copy_from_full(from_vector<double>(w));
  norm.bias.copy_from_full(from_vector<double>(b));
  Tensor x = random_tensor({2, 5}, 32, DType::Float32);
  auto xv = x.to_vector<double>();
  std::vector<double> want;
  for (int r = 0; r < 2; ++r) {
    double mu = 0, var = 0;
    for (int j = 0; j < 5; ++j)
      mu += xv[size_t(r * 5 + j)] / 5;
    for (int j = 0; j < 5; ++j)
      var += (xv[size_t(r * 5 + j)] - mu) * (xv[size_t(r * 5 + j)] - mu) / 5;
    for (int j = 0; j < 5; ++j)
      want.push_back((xv[size_t(r * 5 + j)] - mu) / std::sqrt(var + 1e-5) * w[size_t(j)] +
                     b[size_t(j)]);
  }
  expect_near_all(norm(x), want, 1e-5, "layer_norm");
}

TEST(NormLayers, GradcheckThroughModuleCall) {
  RMSNorm rms(6);
  set_param(rms.weight, random_tensor({6}, 41, DType::Float64));
  Tensor x = random_tensor({3, 6}, 42, DType::Float64).set_requires_grad(true);
  auto r =
      gradcheck([&](const std::vector<Tensor>& in) { return rms(in[0]); }, {x, rms.weight.local()});
  EXPECT_TRUE(r.ok) << "RMSNorm: " << r.message;

  LayerNorm ln(6);
  set_param(ln.weight, random_tensor({6}, 43, DType::Float64));
  set_param(ln.bias, random_tensor({6}, 44, DType::Float64));
  Tensor x2 = random_tensor({2, 2, 6}, 45, DType::Float64).set_requires_grad(true);
  auto r2 = gradcheck([&](const std::vector<Tensor>& in) { return ln(in[0]); },
                      {x2, ln.weight.local(), ln.bias.local()});
  EXPECT_TRUE(r2.ok) << "LayerNorm: " << r2.message;
}

// PyTorch's nn.RMSNorm(eps=None) uses torch.finfo(x.dtype).eps: [1e-3, -1e-3] in float32 gives
// 1e-3 / sqrt(1e-6 + 1.19e-7) = 0.9452 (with eps 1e-6: 0.7071).
TEST(NormLayers, RMSNormDefaultEpsIsTheInputDtypesEpsilon) {
  const Tensor x = from_vector<float>({1e-3f, -1e-3f});
  const double want = 1e-3 / std::sqrt(1e-6 + 1.1920928955078125e-07);
  expect_near_all((*std::make_shared<RMSNorm>(2))(x), {want, -want}, 1e-6, "float32 default");
  EXPECT_NEAR(want, 0.9452, 1e-4);
  EXPECT_FALSE(RMSNorm(2).eps().has_value());
  const double with_1e6 = 1e-3 / std::sqrt(2e-6);
  expect_near_all((*std::make_shared<RMSNorm>(2, 1e-6))(x), {with_1e6, -with_1e6}, 1e-6,
                  "explicit 1e-6");
  // The op alone, in bfloat16: float32's eps, as PyTorch computes in float32 (bfloat16's own
  // 0.0078125 would give 0.125 / sqrt(0.015625 + 0.0078125) = 0.8165).
  const Tensor xb = from_vector<float>({0.125f, -0.125f}).to(DType::BFloat16);
  const double wb = 0.125 / std::sqrt(0.015625 + 1.1920928955078125e-07);
  expect_near_all(rms_norm(xb, Tensor()), {wb, -wb}, 4e-3, "bfloat16 default");
  expect_near_all(rms_norm(x, Tensor()), {want, -want}, 1e-6, "float32 op default");
}

// torch.nn.init.kaiming_uniform_'s default a = 0 gives bound sqrt(6 / fan_in); Linear keeps
// nn.Linear's a = sqrt(5) (LinearLayer.InitDrawsWeightThenBiasFromTheGenerator).
TEST(ParameterInit, KaimingUniformDefaultsToPyTorchsAZero) {
  Generator gen(5), ref(5);
  Parameter p(empty({4, 6}));
  p.kaiming_uniform_(gen);
  const double bound = kaiming_uniform_bound({4, 6}, 0.0, FanMode::FanIn);
  EXPECT_NEAR(bound, std::sqrt(6.0 / 6.0), 1e-12);
  Tensor want = empty({4, 6});
  uniform_(want, -bound, bound, ref);
  expect_equal(p.stored(), want, "kaiming_uniform_ with a = 0");
}
