// matmul / addmm / linear: values against a plain-loop reference in double (transposed, sliced
// and broadcast operands, every float dtype, empty dims), copies counted through the allocator,
// gradients by finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::error_of;
using tessera::testing::random_tensor;

namespace {

struct Ref {
  std::vector<double> v;
  Shape shape;
};

Ref ref_of(const Tensor& t) {
  return {t.to_vector<double>(), t.shape()};
}

// Row-major linear index of `idx` in `shape`, where shape is right-aligned against idx and its
// size-1 dims broadcast.
int64_t broadcast_index(const Shape& idx, const Shape& shape) {
  int64_t lin = 0;
  size_t lead = idx.size() - shape.size();
  for (size_t d = 0; d < shape.size(); ++d) {
    int64_t i = shape[d] == 1 ? 0 : idx[lead + d];
    lin = lin * shape[d] + i;
  }
  return lin;
}

// op(a) @ op(b) with numpy batch broadcasting, in double.
Ref ref_matmul(const Ref& a, const Ref& b, bool ta = false, bool tb = false) {
  size_t na = a.shape.size(), nb = b.shape.size();
  int64_t ar = a.shape[na - 2], ac = a.shape[na - 1], br = b.shape[nb - 2], bc = b.shape[nb - 1];
  int64_t m = ta ? ac : ar, k = ta ? ar : ac, n = tb ? br : bc;
  Shape ba(a.shape.begin(), a.shape.end() - 2), bb(b.shape.begin(), b.shape.end() - 2);
  size_t nbatch = std::max(ba.size(), bb.size());
  Shape batch(nbatch);
  for (size_t d = 0; d < nbatch; ++d) {
    int64_t da = d + ba.size() >= nbatch ? ba[d + ba.size() - nbatch] : 1;
    int64_t db = d + bb.size() >= nbatch ? bb[d + bb.size() - nbatch] : 1;
    batch[d] = da == 1 ? db : da;
  }
  Ref out;
  out.shape = batch;
  out.shape.push_back(m);
  out.shape.push_back(n);
  int64_t nb_total = shape_numel(batch);
  out.v.assign(size_t(nb_total * m * n), 0.0);
  Shape idx(nbatch, 0);
  for (int64_t bi = 0; bi < nb_total; ++bi) {
    int64_t rem = bi;
    for (size_t d = nbatch; d-- > 0;) {
      idx[d] = rem % batch[d];
      rem /= batch[d];
    }
    int64_t ia = broadcast_index(idx, ba), ib = broadcast_index(idx, bb);
    const double* pa = a.v.data() + ia * ar * ac;
    const double* pb = b.v.data() + ib * br * bc;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t p = 0; p < k; ++p) {
          double x = ta ? pa[p * ac + i] : pa[i * ac + p];
          double y = tb ? pb[j * bc + p] : pb[p * bc + j];
          s += x * y;
        }
        out.v[size_t((bi * m + i) * n + j)] = s;
      }
    }
  }
  return out;
}

void expect_close(const Tensor& t, const Ref& r, double atol, double rtol) {
  ASSERT_EQ(t.shape(), r.shape) << t.str();
  std::vector<double> v = t.to_vector<double>();
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_NEAR(v[i], r.v[i], atol + rtol * std::abs(r.v[i]))
        << "element " << i << " of " << t.str();
  }
}

int64_t allocations() {
  return memory_stats().num_allocations;
}

void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      const std::vector<Tensor>& inputs) {
  GradcheckResult r = gradcheck(f, inputs);
  EXPECT_TRUE(r.ok) << r.message;
}

Tensor leaf(const Shape& shape, uint64_t seed) {
  Tensor t = random_tensor(shape, seed, DType::Float64);
  t.set_requires_grad(true);
  return t;
}

}  // namespace

TEST(Matmul, TwoDimFloat32MatchesReference) {
  Tensor a = random_tensor({5, 7}, 1, DType::Float32), b = random_tensor({7, 3}, 2, DType::Float32);
  Tensor c = kernels::matmul(a, b);
  EXPECT_EQ(c.dtype(), DType::Float32);
  expect_close(c, ref_matmul(ref_of(a), ref_of(b)), 1e-5, 1e-5);
}

TEST(Matmul, TransposeFlagsAndTransposedViews) {
  Tensor a = random_tensor({7, 5}, 3, DType::Float32), b = random_tensor({3, 7}, 4, DType::Float32);
  Ref ra = ref_of(a), rb = ref_of(b);
  expect_close(kernels::matmul(a, b, true, true), ref_matmul(ra, rb, true, true), 1e-5, 1e-5);
  Tensor b2 = random_tensor({7, 3}, 5, DType::Float32);
  expect_close(kernels::matmul(a, b2, true, false), ref_matmul(ra, ref_of(b2), true, false), 1e-5,
               1e-5);
  // A transposed view passed without a flag is the same product.
  Tensor at = kernels::transpose(a, 0, 1);
  ASSERT_FALSE(at.is_contiguous());
  expect_close(kernels::matmul(at, b2), ref_matmul(ra, ref_of(b2), true, false), 1e-5, 1e-5);
  // Transposing a transposed view through the flag gives back the original orientation.
  Tensor b3 = random_tensor({5, 2}, 6, DType::Float32);
  expect_close(kernels::matmul(at, b3, true, false), ref_matmul(ra, ref_of(b3)), 1e-5, 1e-5);
}

TEST(Matmul, TransposedAndRowSlicedOperandsAreNotCopied) {
  Tensor a = random_tensor({64, 32}, 7, DType::Float32),
         w = random_tensor({48, 32}, 8, DType::Float32);
  Tensor big = random_tensor({64, 40}, 9, DType::Float32);
  Tensor sliced = kernels::narrow(big, 1, 4, 32);  // row stride 40: a plain outer stride
  Tensor wt = kernels::transpose(w, 0, 1);         // column-major [32, 48]

  int64_t before = allocations();
  Tensor y1 = kernels::matmul(a, w, false, true);
  Tensor y2 = kernels::matmul(sliced, wt);
  Tensor y3 = kernels::matmul(kernels::transpose(a, 0, 1), a, false, false);
  EXPECT_EQ(allocations() - before, 3) << "only the three outputs should be allocated";

  expect_close(y1, ref_matmul(ref_of(a), ref_of(w), false, true), 1e-4, 1e-5);
  expect_close(y2, ref_matmul(ref_of(sliced.contiguous()), ref_of(w), false, true), 1e-4, 1e-5);
  expect_close(y3, ref_matmul(ref_of(a), ref_of(a), true, false), 1e-4, 1e-5);
}

TEST(Matmul, StridesWithoutAUnitDimAreCopiedAndStillCorrect) {
  Tensor big = random_tensor({6, 14}, 10, DType::Float32);
  Tensor a = kernels::slice(big, 1, 0, 14, 2);  // [6, 7] with column stride 2
  Tensor b = random_tensor({7, 4}, 11, DType::Float32);
  int64_t before = allocations();
  Tensor c = kernels::matmul(a, b);
  EXPECT_EQ(allocations() - before, 2) << "one copy of a, one output";
  expect_close(c, ref_matmul(ref_of(a.contiguous()), ref_of(b)), 1e-5, 1e-5);
}

TEST(Matmul, BatchedBroadcastDims) {
  Tensor a = random_tensor({2, 1, 4, 5}, 12, DType::Float32),
         b = random_tensor({3, 5, 6}, 13, DType::Float32);
  Tensor c = kernels::matmul(a, b);
  EXPECT_EQ(c.shape(), (Shape{2, 3, 4, 6}));
  expect_close(c, ref_matmul(ref_of(a), ref_of(b)), 1e-5, 1e-5);

  // Batched transposes on both sides.
  Tensor at = random_tensor({3, 5, 4}, 14, DType::Float32),
         bt = random_tensor({1, 6, 5}, 15, DType::Float32);
  expect_close(kernels::matmul(at, bt, true, true), ref_matmul(ref_of(at), ref_of(bt), true, true),
               1e-5, 1e-5);
}

TEST(Matmul, SharedWeightFoldsTheBatchIntoOneProduct) {
  Tensor a = random_tensor({3, 4, 5}, 16, DType::Float32),
         w = random_tensor({5, 6}, 17, DType::Float32);
  expect_close(kernels::matmul(a, w), ref_matmul(ref_of(a), ref_of(w)), 1e-5, 1e-5);
  // A batch made of a permuted tensor cannot fold; it must still be right.
  Tensor p = kernels::permute(random_tensor({4, 3, 5}, 18, DType::Float32), {1, 0, 2});
  expect_close(kernels::matmul(p, w), ref_matmul(ref_of(p.contiguous()), ref_of(w)), 1e-5, 1e-5);
  // Nor can an expanded (stride 0) batch: every batch element reads the same rows.
  Tensor e = kernels::expand(random_tensor({1, 4, 5}, 19, DType::Float32), {3, 4, 5});
  expect_close(kernels::matmul(e, w), ref_matmul(ref_of(e.contiguous()), ref_of(w)), 1e-5, 1e-5);
  // Batched a transposed per batch element, with a shared weight.
  Tensor at = random_tensor({3, 5, 4}, 20, DType::Float32);
  expect_close(kernels::matmul(at, w, true, false), ref_matmul(ref_of(at), ref_of(w), true, false),
               1e-5, 1e-5);
}

TEST(Matmul, Float64IsExactToRounding) {
  Tensor a = random_tensor({2, 9, 11}, 21, DType::Float64);
  Tensor b = random_tensor({2, 11, 13}, 22, DType::Float64);
  Tensor c = kernels::matmul(a, b);
  EXPECT_EQ(c.dtype(), DType::Float64);
  expect_close(c, ref_matmul(ref_of(a), ref_of(b)), 1e-12, 1e-12);
}

TEST(Matmul, HalfInputsComputeInFloat32) {
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    Tensor a = random_tensor({6, 16}, 23, dt), b = random_tensor({8, 16}, 24, dt);
    Tensor c = kernels::matmul(a, b, false, true);
    EXPECT_EQ(c.dtype(), dt);
    // The reference uses the already-rounded inputs, so only the output rounding remains.
    expect_close(c, ref_matmul(ref_of(a), ref_of(b), false, true), 2e-2, 1e-2);
  }
}

TEST(Matmul, EmptyDims) {
  Tensor c = kernels::matmul(random_tensor({0, 3}, 25, DType::Float32),
                             random_tensor({3, 4}, 26, DType::Float32));
  EXPECT_EQ(c.shape(), (Shape{0, 4}));
  Tensor z = kernels::matmul(random_tensor({2, 0}, 27, DType::Float32),
                             random_tensor({0, 4}, 28, DType::Float32));
  EXPECT_EQ(z.shape(), (Shape{2, 4}));
  EXPECT_EQ(z.to_vector<float>(), std::vector<float>(8, 0.0f));
  Tensor eb = kernels::matmul(random_tensor({0, 2, 3}, 29, DType::Float32),
                              random_tensor({3, 4}, 30, DType::Float32));
  EXPECT_EQ(eb.shape(), (Shape{0, 2, 4}));
}

TEST(Matmul, MismatchedInnerDimsNameBothShapes) {
  Tensor a = random_tensor({2, 3}, 31, DType::Float32),
         b = random_tensor({4, 5}, 32, DType::Float32);
  std::string msg = error_of([&] { kernels::matmul(a, b); });
  EXPECT_NE(msg.find("matmul"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 5]"), std::string::npos) << msg;
  msg = error_of([&] { tessera::matmul(a, b); });
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 5]"), std::string::npos) << msg;
  msg = error_of([&] { kernels::matmul(a, random_tensor({3, 2}, 33, DType::Float64)); });
  EXPECT_NE(msg.find("float64"), std::string::npos) << msg;
  msg = error_of([&] {
    kernels::matmul(random_tensor({2, 2, 3}, 34, DType::Float32),
                    random_tensor({3, 3, 1}, 35, DType::Float32));
  });
  EXPECT_NE(msg.find("broadcast"), std::string::npos) << msg;
}

// c += a b reads a and b while it writes c: c may not be the memory of either (the product
// would read values it already changed). Refused, c unchanged; a separate c accumulates.
TEST(Matmul, AccumulatingIntoAnOperandIsRefused) {
  Tensor c = from_vector<float>({1, 2, 3, 4}, {2, 2});
  const Tensor b = ones({2, 2}, DType::Float32);
  std::string msg = error_of([&] { kernels::matmul_accumulate_(c, c, b); });
  EXPECT_NE(msg.find("shares memory with a"), std::string::npos) << msg;
  msg = error_of([&] { kernels::matmul_accumulate_(c, b, kernels::transpose(c, 0, 1)); });
  EXPECT_NE(msg.find("shares memory with b"), std::string::npos) << msg;
  EXPECT_EQ(c.to_vector<float>(), (std::vector<float>{1, 2, 3, 4}));
  Tensor acc = c.clone();
  kernels::matmul_accumulate_(acc, c, b);
  EXPECT_EQ(acc.to_vector<float>(), (std::vector<float>{4, 5, 10, 11}));
}

TEST(Addmm, BiasBroadcastAndScales) {
  Tensor a = random_tensor({4, 6}, 36, DType::Float32),
         w = random_tensor({5, 6}, 37, DType::Float32);
  Tensor bias = random_tensor({5}, 38, DType::Float32),
         c = random_tensor({4, 5}, 39, DType::Float32);
  Ref prod = ref_matmul(ref_of(a), ref_of(w), false, true);
  std::vector<double> vb = bias.to_vector<double>(), vc = c.to_vector<double>();

  Ref want = prod;
  for (size_t i = 0; i < want.v.size(); ++i)
    want.v[i] = 0.5 * vb[i % 5] + 2.0 * prod.v[i];
  expect_close(kernels::addmm(bias, a, w, 0.5, 2.0, false, true), want, 1e-5, 1e-5);

  for (size_t i = 0; i < want.v.size(); ++i)
    want.v[i] = vc[i] + prod.v[i];
  expect_close(kernels::addmm(c, a, w, 1.0, 1.0, false, true), want, 1e-5, 1e-5);

  // beta = 0 ignores c entirely, NaNs included.
  Tensor nan_c = full({4, 5}, std::numeric_limits<double>::quiet_NaN());
  expect_close(kernels::addmm(nan_c, a, w, 0.0, 1.0, false, true), prod, 1e-5, 1e-5);

  std::string msg = error_of(
      [&] { kernels::addmm(random_tensor({3}, 40, DType::Float32), a, w, 1, 1, false, true); });
  EXPECT_NE(msg.find("[3]"), std::string::npos) << msg;
}

TEST(Linear, BatchedInputWithAndWithoutBias) {
  Tensor x = random_tensor({2, 3, 4}, 41, DType::Float32),
         w = random_tensor({5, 4}, 42, DType::Float32), b = random_tensor({5}, 43, DType::Float32);
  Ref prod = ref_matmul(ref_of(x), ref_of(w), false, true);
  expect_close(kernels::linear(x, w), prod, 1e-5, 1e-5);
  Ref want = prod;
  std::vector<double> vb = b.to_vector<double>();
  for (size_t i = 0; i < want.v.size(); ++i)
    want.v[i] += vb[i % 5];
  expect_close(kernels::linear(x, w, b), want, 1e-5, 1e-5);
  expect_close(tessera::linear(x, w, b), want, 1e-5, 1e-5);

  // Non-contiguous input.
  Tensor xt = kernels::transpose(random_tensor({4, 3}, 44, DType::Float32), 0, 1);
  expect_close(kernels::linear(xt, w), ref_matmul(ref_of(xt.contiguous()), ref_of(w), false, true),
               1e-5, 1e-5);

  std::string msg = error_of([&] {
    kernels::linear(random_tensor({2, 3}, 45, DType::Float32), w);
  });
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[5, 4]"), std::string::npos) << msg;
}

TEST(MatmulAutograd, ValuesIncludingVectors) {
  Tensor a = random_tensor({3, 4}, 46, DType::Float32),
         b = random_tensor({4, 2}, 47, DType::Float32);
  expect_close(tessera::matmul(a, b), ref_matmul(ref_of(a), ref_of(b)), 1e-5, 1e-5);
  Tensor v = random_tensor({4}, 48, DType::Float32);
  Ref col = ref_matmul(ref_of(a), {v.to_vector<double>(), {4, 1}});
  col.shape = {3};
  expect_close(tessera::matmul(a, v), col, 1e-5, 1e-5);
  Tensor u = random_tensor({3}, 49, DType::Float32);
  Ref row = ref_matmul({u.to_vector<double>(), {1, 3}}, ref_of(a));
  row.shape = {4};
  expect_close(tessera::matmul(u, a), row, 1e-5, 1e-5);
}

// torch.matmul of two vectors is their dot product, a 0-dim tensor.
TEST(MatmulAutograd, VectorDotVector) {
  Tensor a = from_vector<float>({1, 2, 3}), b = from_vector<float>({4, 5, 6});
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  Tensor y = tessera::matmul(a, b);
  EXPECT_EQ(y.shape(), Shape{});
  EXPECT_EQ(y.item<float>(), 32.0f);
  backward(y);
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{4, 5, 6}));
  EXPECT_EQ(b.grad().to_vector<float>(), (std::vector<float>{1, 2, 3}));
  expect_gradcheck([](const std::vector<Tensor>& in) { return tessera::matmul(in[0], in[1]); },
                   {leaf({5}, 64), leaf({5}, 65)});
  const std::string msg = error_of([] {
    tessera::matmul(from_vector<float>({1, 2, 3}), zeros({4}));
  });
  EXPECT_NE(msg.find("matmul"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4]"), std::string::npos) << msg;
}

TEST(MatmulAutograd, Gradcheck2D) {
  expect_gradcheck([](const std::vector<Tensor>& in) { return tessera::matmul(in[0], in[1]); },
                   {leaf({3, 4}, 50), leaf({4, 5}, 51)});
}

TEST(MatmulAutograd, GradcheckBatchedBroadcast) {
  // Both operands broadcast somewhere, so both gradients are summed over batch dims.
  expect_gradcheck([](const std::vector<Tensor>& in) { return tessera::matmul(in[0], in[1]); },
                   {leaf({2, 1, 3, 4}, 52), leaf({3, 4, 2}, 53)});
}

TEST(MatmulAutograd, GradcheckSharedWeightAndBatchedRhs) {
  expect_gradcheck([](const std::vector<Tensor>& in) { return tessera::matmul(in[0], in[1]); },
                   {leaf({2, 3, 4}, 54), leaf({4, 5}, 55)});
  expect_gradcheck([](const std::vector<Tensor>& in) { return tessera::matmul(in[0], in[1]); },
                   {leaf({3, 4}, 56), leaf({2, 4, 5}, 57)});
}

TEST(MatmulAutograd, GradcheckVectorsAndTransposedViews) {
  expect_gradcheck([](const std::vector<Tensor>& in) { return tessera::matmul(in[0], in[1]); },
                   {leaf({4}, 58), leaf({4, 3}, 59)});
  expect_gradcheck([](const std::vector<Tensor>& in) { return tessera::matmul(in[0], in[1]); },
                   {leaf({2, 3, 4}, 60), leaf({4}, 61)});
  expect_gradcheck(
      [](const std::vector<Tensor>& in) {
        return tessera::matmul(in[0], tessera::transpose(in[1], 0, 1));
      },
      {leaf({3, 4}, 62), leaf({5, 4}, 63)});
}

TEST(LinearAutograd, Gradcheck) {
  expect_gradcheck(
      [](const std::vector<Tensor>& in) { return tessera::linear(in[0], in[1], in[2]); },
      {leaf({2, 3, 4}, 64), leaf({5, 4}, 65), leaf({5}, 66)});
  expect_gradcheck([](const std::vector<Tensor>& in) { return tessera::linear(in[0], in[1]); },
                   {leaf({4}, 67), leaf({3, 4}, 68)});
}

TEST(LinearAutograd, GradientOnlyWhereRequired) {
  Tensor x = random_tensor({3, 4}, 69, DType::Float64);
  Tensor w = leaf({2, 4}, 70);
  Tensor y = tessera::linear(x, w);
  tessera::backward(tessera::sum(y));
  ASSERT_TRUE(w.grad().defined());
  // d sum(x W^T) / dW[o, i] = sum_r x[r, i].
  std::vector<double> vx = x.to_vector<double>(), gw = w.grad().to_vector<double>();
  for (int64_t o = 0; o < 2; ++o)
    for (int64_t i = 0; i < 4; ++i)
      EXPECT_NEAR(gw[size_t(o * 4 + i)], vx[size_t(i)] + vx[size_t(4 + i)] + vx[size_t(8 + i)],
                  1e-12);
  EXPECT_FALSE(x.grad().defined());
}

// The low-rank (LoRA) linear: the fused path (one dtype) against the same computation from
// separate ops, and its gradients against finite differences, with and without a separate
// low-rank input and a mixed batch's routing.
TEST(LinearLowrank, FusedMatchesSeparateOpsAndGradientsCheck) {
  // Two adapters of width 2 stacked in a [4, 5] and b [6, 4]: sample 1 uses adapter 0, sample 0
  // none.
  const LowRankRouting routing{2, 2, from_vector<int64_t>({1}), {1, 0}};
  for (bool separate_low : {false, true}) {
    for (bool routed : {false, true}) {
      auto f = [&](const std::vector<Tensor>& in) {
        return tessera::linear_lowrank(in[0], in[1], in[2], in[3], in[4], 0.75,
                                       separate_low ? in[5] : Tensor(),
                                       routed ? routing : LowRankRouting{});
      };
      std::vector<Tensor> in = {leaf({2, 3, 5}, 1), leaf({6, 5}, 2), leaf({6}, 3),
                                leaf({4, 5}, 4),    leaf({6, 4}, 5), leaf({2, 3, 5}, 6)};
      expect_gradcheck(f, in);
      // The same from separate ops (routed: sample 1 through adapter 0's rows of a and columns
      // of b, sample 0 through none).
      const Tensor xl = separate_low ? in[5] : in[0];
      const Tensor base = tessera::linear(in[0], in[1], in[2]);
      Tensor want = tessera::add(
          base, tessera::linear(tessera::mul(tessera::linear(xl, in[3]), 0.75), in[4]));
      if (routed) {
        const Tensor a0 = tessera::narrow(in[3], 0, 0, 2), b0 = tessera::narrow(in[4], 1, 0, 2);
        const Tensor one = tessera::add(
            tessera::narrow(base, 0, 1, 1),
            tessera::linear(tessera::mul(tessera::linear(tessera::narrow(xl, 0, 1, 1), a0), 0.75),
                            b0));
        want = tessera::cat({tessera::narrow(base, 0, 0, 1), one}, 0);
      }
      const Tensor got = f(in);
      auto g = got.to_vector<double>(), w = want.to_vector<double>();
      ASSERT_EQ(g.size(), w.size());
      for (size_t i = 0; i < g.size(); ++i)
        EXPECT_NEAR(g[i], w[i], 1e-12) << "element " << i << (routed ? " (routed)" : "");
    }
  }
  // Mixed dtypes (a bfloat16 base, float32 adapters) take the unfused route: same values within
  // bfloat16's precision, output in the base's dtype.
  Tensor x = random_tensor({3, 5}, 7, DType::Float32).to(DType::BFloat16),
         w = random_tensor({6, 5}, 8, DType::Float32).to(DType::BFloat16);
  Tensor a = random_tensor({4, 5}, 9, DType::Float32),
         b = random_tensor({6, 4}, 10, DType::Float32);
  Tensor y = tessera::linear_lowrank(x, w, Tensor(), a, b, 2.0);
  EXPECT_EQ(y.dtype(), DType::BFloat16);
  Tensor ref =
      tessera::add(tessera::linear(x.to(DType::Float32), w.to(DType::Float32)),
                   tessera::mul(tessera::linear(tessera::linear(x.to(DType::Float32), a), b), 2.0));
  auto g = y.to_vector<double>(), r = ref.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i)
    EXPECT_NEAR(g[i], r[i], 0.02 * (1 + std::abs(r[i]))) << "element " << i;
}

// A mixed batch's routed products: each sample's activations and update from its own adapter's
// rows of a and columns of b, zero for a sample of no adapter; gradients against finite
// differences for 1-D, 2-D, 3-D and 4-D inputs.
TEST(LowRankRouting, EachSampleUsesItsOwnAdapterOnly) {
  // Three adapters of width 2; samples 3, 0 use adapter 0, sample 2 adapter 2, sample 1 none.
  const LowRankRouting r{2, 4, from_vector<int64_t>({3, 0, 2}), {2, 0, 1}};
  for (const Shape& xs : std::vector<Shape>{{4, 5}, {4, 3, 5}, {4, 2, 1, 5}}) {
    std::vector<Tensor> in = {leaf(xs, 21), leaf({6, 5}, 22), leaf({7, 6}, 23)};
    expect_gradcheck([&](const std::vector<Tensor>& v) { return lowrank_down(v[0], v[1], r); },
                     {in[0], in[1]});
    Shape hs = xs;
    hs.back() = 6;
    expect_gradcheck([&](const std::vector<Tensor>& v) { return lowrank_up(v[0], v[1], r); },
                     {leaf(hs, 24), in[2]});
    const Tensor h = lowrank_down(in[0], in[1], r);
    const Tensor y = lowrank_up(h, in[2], r);
    const std::vector<int64_t> adapter = {0, -1, 2, 0};
    for (int64_t s = 0; s < 4; ++s) {
      const Tensor xs1 = tessera::narrow(in[0], 0, s, 1);
      const int64_t j = adapter[size_t(s)];
      Tensor want_h = zeros(tessera::narrow(h, 0, s, 1).shape(), DType::Float64);
      Tensor want_y = zeros(tessera::narrow(y, 0, s, 1).shape(), DType::Float64);
      if (j >= 0) {
        const Tensor hj = tessera::linear(xs1, tessera::narrow(in[1], 0, 2 * j, 2));
        kernels::narrow(want_h, -1, 2 * j, 2).copy_(hj);
        want_y = tessera::linear(hj, tessera::narrow(in[2], 1, 2 * j, 2));
      }
      const auto gh = tessera::narrow(h, 0, s, 1).to_vector<double>(),
                 wh = want_h.to_vector<double>();
      const auto gy = tessera::narrow(y, 0, s, 1).to_vector<double>(),
                 wy = want_y.to_vector<double>();
      for (size_t i = 0; i < gh.size(); ++i)
        EXPECT_NEAR(gh[i], wh[i], 1e-12) << shape_str(xs) << " sample " << s << " h " << i;
      for (size_t i = 0; i < gy.size(); ++i)
        EXPECT_NEAR(gy[i], wy[i], 1e-12) << shape_str(xs) << " sample " << s << " y " << i;
    }
  }
  // A 1-D input is one sample.
  const LowRankRouting one{2, 1, from_vector<int64_t>({0}), {0, 1}};
  expect_gradcheck([&](const std::vector<Tensor>& v) { return lowrank_down(v[0], v[1], one); },
                   {leaf({5}, 25), leaf({4, 5}, 26)});
  expect_gradcheck([&](const std::vector<Tensor>& v) { return lowrank_up(v[0], v[1], one); },
                   {leaf({4}, 27), leaf({3, 4}, 28)});
  // Bad input names what does not fit.
  EXPECT_NE(error_of([&] {
              lowrank_down(leaf({3, 5}, 29), leaf({6, 5}, 30), r);
            }).find("routing names 4 samples but [3, 5] holds 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              lowrank_up(leaf({4, 4}, 31), leaf({7, 4}, 32), r);
            }).find("stacked 4 wide, but the routing has 3 adapters of 2"),
            std::string::npos);
}

// An adapter holding NaN and infinity reaches no other sample: not its output, not the input's
// gradient, not the other adapter's gradients (a 0/1 mask over every adapter's activations
// turned 0 * inf into NaN for all of them).
TEST(LowRankRouting, AnAdapterOfNaNsReachesNoOtherSample) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  // Adapter 1 (rows 2-3 of a, columns 2-3 of b) is broken; samples 0 and 2 use adapter 0,
  // sample 1 adapter 1, sample 3 none.
  const LowRankRouting r{2, 4, from_vector<int64_t>({0, 2, 1}), {2, 1}};
  Tensor a = random_tensor({4, 5}, 41, DType::Float64),
         b = random_tensor({6, 4}, 42, DType::Float64);
  kernels::narrow(a, 0, 2, 1).fill_(nan);
  kernels::narrow(b, 1, 3, 1).fill_(inf);
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  Tensor x = random_tensor({4, 3, 5}, 43, DType::Float64),
         w = random_tensor({6, 5}, 44, DType::Float64);
  x.set_requires_grad(true);
  const Tensor y = tessera::linear_lowrank(x, w, Tensor(), a, b, 0.5, Tensor(), r);
  tessera::backward(tessera::sum(y));
  auto finite = [](const Tensor& t) {
    for (double v : t.to_vector<double>())
      if (!std::isfinite(v)) return false;
    return true;
  };
  for (int64_t s : {0, 2, 3}) {
    EXPECT_TRUE(finite(kernels::narrow(y, 0, s, 1))) << "sample " << s;
    EXPECT_TRUE(finite(kernels::narrow(x.grad(), 0, s, 1))) << "input gradient, sample " << s;
  }
  EXPECT_FALSE(finite(kernels::narrow(y, 0, 1, 1))) << "the broken adapter's own sample";
  EXPECT_TRUE(finite(kernels::narrow(a.grad(), 0, 0, 2))) << "adapter 0's a";
  EXPECT_TRUE(finite(kernels::narrow(b.grad(), 1, 0, 2))) << "adapter 0's b";
}
