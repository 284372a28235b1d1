// Rotary embedding and scaled dot-product attention: values against plain-loop references,
// gradients by finite differences, and the errors users hit first.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
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

std::vector<double> values(const Tensor& t) {
  return t.to_vector<double>();
}

// Direct formula: pair (2i, 2i+1) at position t rotated by t * theta^(-2i/D).
std::vector<double> ref_rope(const std::vector<double>& x, int64_t b, int64_t t, int64_t h,
                             int64_t d, double theta) {
  std::vector<double> out(x.size());
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t ti = 0; ti < t; ++ti)
      for (int64_t hi = 0; hi < h; ++hi)
        for (int64_t i = 0; i < d / 2; ++i) {
          size_t base = size_t(((bi * t + ti) * h + hi) * d + 2 * i);
          double angle = double(ti) * std::pow(theta, -2.0 * double(i) / double(d));
          double c = std::cos(angle), s = std::sin(angle);
          out[base] = x[base] * c - x[base + 1] * s;
          out[base + 1] = x[base] * s + x[base + 1] * c;
        }
  return out;
}

struct RefAttention {
  std::vector<double> out, lse;
};

// q [B, H, T, D], k [B, H, S, D], v [B, H, S, Dv], all contiguous row-major values.
RefAttention ref_attention(const std::vector<double>& q, const std::vector<double>& k,
                           const std::vector<double>& v, int64_t bh, int64_t t, int64_t s,
                           int64_t d, int64_t dv, bool causal, double scale) {
  RefAttention r{std::vector<double>(size_t(bh * t * dv), 0.0), {}};
  for (int64_t n = 0; n < bh; ++n) {
    for (int64_t i = 0; i < t; ++i) {
      std::vector<double> score(size_t(s), -std::numeric_limits<double>::infinity());
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < s; ++j) {
        if (causal && j > i + (s - t)) continue;
        double acc = 0;
        for (int64_t c = 0; c < d; ++c)
          acc += q[size_t((n * t + i) * d + c)] * k[size_t((n * s + j) * d + c)];
        score[size_t(j)] = acc * scale;
        m = std::max(m, score[size_t(j)]);
      }
      if (m == -std::numeric_limits<double>::infinity()) {
        r.lse.push_back(m);
        continue;
      }
      double z = 0;
      for (int64_t j = 0; j < s; ++j)
        z += std::exp(score[size_t(j)] - m);
      r.lse.push_back(m + std::log(z));
      for (int64_t j = 0; j < s; ++j) {
        double p = std::exp(score[size_t(j)] - m) / z;
        for (int64_t c = 0; c < dv; ++c)
          r.out[size_t((n * t + i) * dv + c)] += p * v[size_t((n * s + j) * dv + c)];
      }
    }
  }
  return r;
}

}  // namespace

TEST(Rope, MatchesDirectFormulaWithLongerTables) {
  const int64_t b = 2, t = 5, h = 3, d = 8;
  Tensor x = random_tensor({b, t, h, d}, 1, DType::Float32);
  auto [cos, sin] = kernels::rope_tables(t + 4, d, 10000.0);
  EXPECT_EQ(cos.shape(), (Shape{t + 4, d / 2}));
  EXPECT_EQ(cos.dtype(), DType::Float32);
  Tensor y = kernels::rope(x, cos, sin);
  EXPECT_EQ(y.shape(), x.shape());
  expect_near_all(values(y), ref_rope(values(x), b, t, h, d, 10000.0), 1e-5, "rope");
  // Another base, float64 throughout.
  Tensor x64 = x.to(DType::Float64);
  auto [c64, s64] = kernels::rope_tables(t, d, 500000.0, DType::Float64);
  expect_near_all(values(kernels::rope(x64, c64, s64)), ref_rope(values(x64), b, t, h, d, 500000.0),
                  1e-13, "rope theta=5e5");
}

TEST(Rope, InverseUndoesRotationOnStridedInput) {
  // [B, H, T, D] transposed to [B, T, H, D]: the layout a projection usually produces.
  Tensor base = random_tensor({2, 3, 6, 4}, 2, DType::Float32);
  Tensor x = kernels::transpose(base, 1, 2);
  ASSERT_FALSE(x.is_contiguous());
  auto [cos, sin] = kernels::rope_tables(6, 4);
  Tensor y = kernels::rope(x, cos, sin);
  expect_near_all(values(y), ref_rope(values(x), 2, 6, 3, 4, 10000.0), 1e-5, "rope strided");
  Tensor back = kernels::rope(y, cos, sin, /*inverse=*/true);
  expect_near_all(values(back), values(x), 1e-5, "rope inverse");
}

TEST(Rope, BFloat16Input) {
  Tensor x = random_tensor({1, 4, 2, 16}, 3, DType::Float32).to(DType::BFloat16);
  auto [cos, sin] = kernels::rope_tables(4, 16);
  Tensor y = kernels::rope(x, cos, sin);
  EXPECT_EQ(y.dtype(), DType::BFloat16);
  expect_near_all(values(y), ref_rope(values(x), 1, 4, 2, 16, 10000.0), 1e-2, "rope bf16");
}

TEST(Rope, Gradcheck) {
  Tensor x = random_tensor({2, 3, 2, 6}, 4, DType::Float64).set_requires_grad(true);
  auto [cos, sin] = kernels::rope_tables(5, 6, 10000.0, DType::Float64);
  GradcheckResult r =
      gradcheck([&](const std::vector<Tensor>& in) { return rope(in[0], cos, sin); }, {x});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Rope, Errors) {
  auto [cos, sin] = kernels::rope_tables(4, 6);
  expect_error(
      [&] {
        kernels::rope(random_tensor({1, 4, 2, 5}, 5, DType::Float64), cos, sin);
      },
      "head dim D=5 of x [1, 4, 2, 5] is odd");
  expect_error(
      [&] {
        kernels::rope(random_tensor({1, 8, 2, 6}, 6, DType::Float64), cos, sin);
      },
      "tables [4, 3] do not fit x [1, 8, 2, 6]");
  expect_error([&] { kernels::rope_tables(4, 7); }, "head_dim must be positive and even, got 7");
  expect_error(
      [&] {
        kernels::rope(random_tensor({4, 2, 6}, 7, DType::Float64), cos, sin);
      },
      "x must be [B, T, H, D]");
}

namespace {

void check_attention(DType dtype, int64_t b, int64_t h, int64_t t, int64_t s, int64_t d, int64_t dv,
                     bool causal, double tol) {
  SCOPED_TRACE(::testing::Message()
               << dtype_name(dtype) << " T=" << t << " S=" << s << " causal=" << causal);
  Tensor q = random_tensor({b, h, t, d}, 10, DType::Float32).to(dtype);
  Tensor k = random_tensor({b, h, s, d}, 11, DType::Float32).to(dtype);
  Tensor v = random_tensor({b, h, s, dv}, 12, DType::Float32).to(dtype);
  const double scale = 1.0 / std::sqrt(double(d));
  kernels::AttentionResult r = kernels::scaled_dot_product_attention(q, k, v, causal, scale);
  EXPECT_EQ(r.out.shape(), (Shape{b, h, t, dv}));
  EXPECT_EQ(r.out.dtype(), dtype);
  EXPECT_EQ(r.lse.shape(), (Shape{b, h, t}));
  // The reference sees the same (possibly bf16-rounded) inputs.
  RefAttention want =
      ref_attention(values(q), values(k), values(v), b * h, t, s, d, dv, causal, scale);
  expect_near_all(values(r.out), want.out, tol, "attention out");
  expect_near_all(values(r.lse), want.lse, tol, "attention lse");
}

}  // namespace

TEST(Attention, MatchesReference) {
  for (bool causal : {false, true}) {
    check_attention(DType::Float32, 2, 3, 5, 5, 8, 8, causal, 1e-5);   // S == T
    check_attention(DType::Float32, 1, 2, 3, 7, 4, 6, causal, 1e-5);   // S > T, Dv != D
    check_attention(DType::Float64, 2, 2, 6, 9, 5, 5, causal, 1e-12);  // float64
    check_attention(DType::BFloat16, 1, 2, 8, 8, 16, 16, causal, 2e-2);
  }
}

TEST(Attention, CausalMaskIsAlignedAtTheEnd) {
  // With S > T the last query sees every key and the first sees S - T + 1 of them: changing a
  // key the first query must not see leaves its output unchanged.
  Tensor q = random_tensor({1, 1, 2, 4}, 20, DType::Float64);
  Tensor k = random_tensor({1, 1, 5, 4}, 21, DType::Float64);
  Tensor v = random_tensor({1, 1, 5, 4}, 22, DType::Float64);
  Tensor k2 = k.clone(), v2 = v.clone();
  k2.data<double>()[4 * 4] += 3.0;  // key 4: visible to query 1 only
  v2.data<double>()[4 * 4] += 3.0;
  auto a = kernels::scaled_dot_product_attention(q, k, v, true, 0.5).out.to_vector<double>();
  auto c = kernels::scaled_dot_product_attention(q, k2, v2, true, 0.5).out.to_vector<double>();
  for (int i = 0; i < 4; ++i)
    EXPECT_DOUBLE_EQ(a[size_t(i)], c[size_t(i)]) << i;
  EXPECT_NE(a[4], c[4]);
}

TEST(Attention, QueriesWithoutKeysGiveZerosAndNoGradient) {
  // Causal with S < T: the first T - S queries have no visible key.
  Tensor q = random_tensor({1, 1, 4, 3}, 23, DType::Float64).set_requires_grad(true);
  Tensor k = random_tensor({1, 1, 2, 3}, 24, DType::Float64).set_requires_grad(true);
  Tensor v = random_tensor({1, 1, 2, 3}, 25, DType::Float64).set_requires_grad(true);
  kernels::AttentionResult r = kernels::scaled_dot_product_attention(q, k, v, true, 0.7);
  std::vector<double> out = values(r.out), lse = values(r.lse);
  for (int i = 0; i < 6; ++i)
    EXPECT_EQ(out[size_t(i)], 0.0);
  EXPECT_TRUE(std::isinf(lse[0]) && lse[0] < 0);
  EXPECT_TRUE(std::isfinite(lse[2]));
  GradcheckResult g = gradcheck(
      [](const std::vector<Tensor>& in) {
        return scaled_dot_product_attention(in[0], in[1], in[2], true, 0.7);
      },
      {q, k, v});
  EXPECT_TRUE(g.ok) << g.message;
  std::vector<double> dq = values(q.grad());
  for (int i = 0; i < 6; ++i)
    EXPECT_EQ(dq[size_t(i)], 0.0);
}

TEST(Attention, StridedInputsMatchContiguous) {
  // q/k/v as projections usually arrive: [B, T, H, D] transposed to [B, H, T, D].
  Tensor qb = random_tensor({2, 4, 3, 8}, 30, DType::Float32);
  Tensor kb = random_tensor({2, 6, 3, 8}, 31, DType::Float32);
  Tensor vb = random_tensor({2, 6, 3, 8}, 32, DType::Float32);
  Tensor q = kernels::transpose(qb, 1, 2), k = kernels::transpose(kb, 1, 2),
         v = kernels::transpose(vb, 1, 2);
  ASSERT_FALSE(q.is_contiguous());
  auto strided = kernels::scaled_dot_product_attention(q, k, v, true, 0.3);
  auto dense = kernels::scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                                     true, 0.3);
  EXPECT_EQ(values(strided.out), values(dense.out));
  RefAttention want = ref_attention(values(q), values(k), values(v), 6, 4, 6, 8, 8, true, 0.3);
  expect_near_all(values(strided.out), want.out, 1e-5, "strided attention");
}

TEST(Attention, DefaultScaleIsInverseSqrtHeadDim) {
  Tensor q = random_tensor({1, 2, 3, 9}, 40, DType::Float64);
  Tensor k = random_tensor({1, 2, 4, 9}, 41, DType::Float64);
  Tensor v = random_tensor({1, 2, 4, 9}, 42, DType::Float64);
  Tensor y = scaled_dot_product_attention(q, k, v, false);
  RefAttention want =
      ref_attention(values(q), values(k), values(v), 2, 3, 4, 9, 9, false, 1.0 / 3.0);
  expect_near_all(values(y), want.out, 1e-12, "default scale");
}

TEST(Attention, GradcheckQKV) {
  for (bool causal : {false, true}) {
    for (auto [t, s] : {std::pair<int64_t, int64_t>{4, 4}, {3, 5}}) {
      SCOPED_TRACE(::testing::Message() << "T=" << t << " S=" << s << " causal=" << causal);
      Tensor q = random_tensor({2, 2, t, 3}, 50, DType::Float64).set_requires_grad(true);
      Tensor k = random_tensor({2, 2, s, 3}, 51, DType::Float64).set_requires_grad(true);
      Tensor v = random_tensor({2, 2, s, 4}, 52, DType::Float64).set_requires_grad(true);
      GradcheckResult r = gradcheck(
          [causal](const std::vector<Tensor>& in) {
            return scaled_dot_product_attention(in[0], in[1], in[2], causal);
          },
          {q, k, v});
      EXPECT_TRUE(r.ok) << r.message;
    }
  }
}

TEST(Attention, BFloat16Backward) {
  // Gradients of bf16 inputs come back in bf16 and agree with the float32 computation.
  Tensor q = random_tensor({1, 2, 4, 8}, 60, DType::Float32).to(DType::BFloat16);
  Tensor k = random_tensor({1, 2, 4, 8}, 61, DType::Float32).to(DType::BFloat16);
  Tensor v = random_tensor({1, 2, 4, 8}, 62, DType::Float32).to(DType::BFloat16);
  Tensor g = random_tensor({1, 2, 4, 8}, 63, DType::Float32).to(DType::BFloat16);
  auto f16 = kernels::scaled_dot_product_attention(q, k, v, true, 0.35);
  auto g16 =
      kernels::scaled_dot_product_attention_backward(g, q, k, v, f16.out, f16.lse, true, 0.35);
  Tensor q32 = q.to(DType::Float32), k32 = k.to(DType::Float32), v32 = v.to(DType::Float32);
  auto f32 = kernels::scaled_dot_product_attention(q32, k32, v32, true, 0.35);
  auto g32 = kernels::scaled_dot_product_attention_backward(g.to(DType::Float32), q32, k32, v32,
                                                            f32.out, f32.lse, true, 0.35);
  EXPECT_EQ(g16.dq.dtype(), DType::BFloat16);
  expect_near_all(values(g16.dq), values(g32.dq), 5e-2, "bf16 dq");
  expect_near_all(values(g16.dk), values(g32.dk), 5e-2, "bf16 dk");
  expect_near_all(values(g16.dv), values(g32.dv), 5e-2, "bf16 dv");
}

TEST(Attention, Errors) {
  Tensor q = random_tensor({1, 2, 3, 8}, 70, DType::Float64);
  Tensor k = random_tensor({1, 2, 4, 6}, 71, DType::Float64);
  Tensor v = random_tensor({1, 2, 4, 6}, 72, DType::Float64);
  expect_error([&] { kernels::scaled_dot_product_attention(q, k, v, false, 0.5); },
               "head dim mismatch between q [1, 2, 3, 8] (D=8) and k [1, 2, 4, 6] (D=6)");
  expect_error([&] { scaled_dot_product_attention(q, k, v); }, "head dim mismatch");
  Tensor k8 = random_tensor({1, 2, 4, 8}, 73, DType::Float64),
         v5 = random_tensor({1, 2, 5, 8}, 74, DType::Float64);
  expect_error([&] { kernels::scaled_dot_product_attention(q, k8, v5, false, 0.5); },
               "same number of keys S");
  expect_error(
      [&] { kernels::scaled_dot_product_attention(q, k8, k8.to(DType::Float32), false, 0.5); },
      "share one floating dtype, got float64, float64, float32");
  expect_error([&] { kernels::scaled_dot_product_attention(q, k8, k8, false, 0.0); },
               "scale must be finite and > 0");
  expect_error(
      [&] {
        scaled_dot_product_attention(random_tensor({2, 3, 8}, 75, DType::Float64), k8, k8);
      },
      "q must be [B, H, T, D]");
}
