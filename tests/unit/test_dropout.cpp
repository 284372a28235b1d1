// Dropout: keep statistics, reproducibility from (seed, offset), gradient through the mask.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;

namespace {

std::vector<double> values(const Tensor& t) {
  return t.to_vector<double>();
}

}  // namespace

TEST(Dropout, KeepsAboutOneMinusPAndScalesKeptValues) {
  const int64_t n = 1 << 20;
  for (double p : {0.1, 0.5, 0.8}) {
    SCOPED_TRACE(::testing::Message() << "p=" << p);
    Tensor x = random_tensor({n / 256, 256}, 1, DType::Float32);
    Generator gen(7);
    kernels::DropoutResult r = kernels::dropout(x, p, gen);
    EXPECT_EQ(gen.offset(), uint64_t(n));
    EXPECT_EQ(r.mask.dtype(), DType::Float32);
    std::vector<float> xv = x.to_vector<float>(), mv = r.mask.to_vector<float>(),
                       ov = r.out.to_vector<float>();
    const float keep_value = float(1.0 / (1.0 - p));
    int64_t kept = 0;
    for (size_t i = 0; i < mv.size(); ++i) {
      ASSERT_TRUE(mv[i] == 0.0f || mv[i] == keep_value) << "mask value " << mv[i];
      ASSERT_EQ(ov[i], xv[i] * mv[i]) << i;
      kept += mv[i] != 0.0f;
    }
    // Binomial std of the kept fraction is sqrt(p(1-p)/n) < 5e-4; allow ~6 sigma.
    EXPECT_NEAR(double(kept) / double(n), 1.0 - p, 3e-3);
  }
}

TEST(Dropout, SameSeedAndOffsetGiveSameMask) {
  Tensor x = random_tensor({64, 33}, 2, DType::Float32);
  Generator a(42), b(42), c(43);
  a.set_offset(1000);
  b.set_offset(1000);
  c.set_offset(1000);
  std::vector<double> ma = values(kernels::dropout(x, 0.5, a).mask);
  EXPECT_EQ(ma, values(kernels::dropout(x, 0.5, b).mask));
  EXPECT_NE(ma, values(kernels::dropout(x, 0.5, c).mask));
  // The generator advanced past the draw: the next call draws fresh numbers.
  EXPECT_EQ(a.offset(), 1000u + 64u * 33u);
  EXPECT_NE(ma, values(kernels::dropout(x, 0.5, a).mask));
}

TEST(Dropout, StridedAndBFloat16Input) {
  Tensor base = random_tensor({16, 12}, 3, DType::Float32);
  Tensor x = kernels::transpose(base, 0, 1);
  Generator g1(5), g2(5);
  kernels::DropoutResult strided = kernels::dropout(x, 0.25, g1);
  kernels::DropoutResult dense = kernels::dropout(x.contiguous(), 0.25, g2);
  EXPECT_EQ(values(strided.mask), values(dense.mask));
  EXPECT_EQ(values(strided.out), values(dense.out));

  Tensor xb = x.to(DType::BFloat16);
  Generator g3(5);
  kernels::DropoutResult half = kernels::dropout(xb, 0.25, g3);
  EXPECT_EQ(half.mask.dtype(), DType::BFloat16);
  EXPECT_EQ(half.out.dtype(), DType::BFloat16);
  // Same draws whatever the dtype: the keep pattern matches the float32 one.
  std::vector<double> m32 = values(dense.mask), m16 = values(half.mask);
  for (size_t i = 0; i < m32.size(); ++i)
    EXPECT_EQ(m32[i] != 0, m16[i] != 0) << i;
}

TEST(Dropout, GradientIsGradTimesMask) {
  Tensor x = random_tensor({8, 10}, 4, DType::Float32).set_requires_grad(true);
  Generator gen(11), replay(11), replay_out(11);
  Tensor y = dropout(x, 0.3, true, gen);
  ASSERT_TRUE(y.requires_grad());
  Tensor g = random_tensor({8, 10}, 5, DType::Float32);
  backward(y, g);
  // Replaying the draw from the same (seed, offset) recovers the mask the op used.
  Tensor mask = kernels::dropout(x.detach(), 0.3, replay).mask;
  EXPECT_EQ(values(y), values(kernels::dropout(x.detach(), 0.3, replay_out).out));
  std::vector<double> gv = values(g), mv = values(mask), xg = values(x.grad());
  for (size_t i = 0; i < gv.size(); ++i)
    EXPECT_FLOAT_EQ(float(xg[i]), float(gv[i] * mv[i])) << i;
}

TEST(Dropout, IdentityInEvalOrWithZeroP) {
  Tensor x = random_tensor({4, 4}, 6, DType::Float32).set_requires_grad(true);
  Generator gen(3);
  EXPECT_TRUE(dropout(x, 0.5, false, gen).is_same(x));
  EXPECT_TRUE(dropout(x, 0.0, true, gen).is_same(x));
  EXPECT_EQ(gen.offset(), 0u);  // no numbers were drawn
}

// Everything dropped, as in PyTorch: zeros (x times 0) and a zero gradient, no numbers drawn.
TEST(Dropout, ProbabilityOneDropsEverything) {
  Tensor x = random_tensor({4, 4}, 6, DType::Float32).set_requires_grad(true);
  Generator gen(3);
  Tensor y = dropout(x, 1.0, true, gen);
  EXPECT_EQ(y.to_vector<float>(), std::vector<float>(16, 0.0f));
  backward(sum(y));
  EXPECT_EQ(x.grad().to_vector<float>(), std::vector<float>(16, 0.0f));
  EXPECT_EQ(gen.offset(), 0u);
}

TEST(Dropout, GradcheckFloat64) {
  Tensor x = random_tensor({5, 6}, 7, DType::Float64).set_requires_grad(true);
  // Each evaluation replays the same (seed, offset), so the function is deterministic.
  GradcheckResult r = gradcheck(
      [](const std::vector<Tensor>& in) {
        Generator gen(9);
        return dropout(in[0], 0.4, true, gen);
      },
      {x});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Dropout, RejectsBadProbability) {
  Tensor x = random_tensor({3}, 8, DType::Float32);
  Generator gen(1);
  expect_error([&] { kernels::dropout(x, 1.0, gen); }, "p must be in [0, 1), got 1");
  expect_error([&] { kernels::dropout(x, -0.1, gen); }, "p must be in [0, 1), got -0.1");
  expect_error([&] { kernels::dropout(x, std::nan(""), gen); }, "p must be in [0, 1)");
  expect_error([&] { dropout(x, 1.5, false, gen); }, "p must be in [0, 1], got 1.5");
  expect_error([&] { kernels::dropout(arange(3), 0.5, gen); }, "x must be floating");
  EXPECT_EQ(gen.offset(), 0u);
}
