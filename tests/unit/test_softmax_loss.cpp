// softmax / log_softmax / cross_entropy: values and backward kernels against plain-loop
// references in double, numerical stability, gradients by finite differences, error messages.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using kernels::Reduction;
using tessera::testing::error_of;
using tessera::testing::random_tensor;

namespace {

Tensor leaf(const Shape& shape, uint64_t seed) {
  Tensor t = random_tensor(shape, seed, DType::Float64);
  t.set_requires_grad(true);
  return t;
}

void expect_close(const Tensor& t, const std::vector<double>& want, double atol, double rtol) {
  std::vector<double> v = t.to_vector<double>();
  ASSERT_EQ(v.size(), want.size()) << t.str();
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_NEAR(v[i], want[i], atol + rtol * std::abs(want[i]))
        << "element " << i << " of " << t.str();
  }
}

void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      const std::vector<Tensor>& inputs) {
  GradcheckResult r = gradcheck(f, inputs);
  EXPECT_TRUE(r.ok) << r.message;
}

// Row-major [outer, n, inner] split of `shape` around `dim`.
void split_dims(const Shape& shape, int64_t dim, int64_t& outer, int64_t& n, int64_t& inner) {
  outer = 1;
  inner = 1;
  n = shape[size_t(dim)];
  for (int64_t i = 0; i < dim; ++i)
    outer *= shape[size_t(i)];
  for (size_t i = size_t(dim) + 1; i < shape.size(); ++i)
    inner *= shape[i];
}

std::vector<double> ref_softmax(const std::vector<double>& x, const Shape& shape, int64_t dim,
                                bool log) {
  int64_t outer, n, inner;
  split_dims(shape, dim, outer, n, inner);
  std::vector<double> y(x.size());
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < inner; ++i) {
      auto at = [&](int64_t j) { return size_t((o * n + j) * inner + i); };
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j)
        m = std::max(m, x[at(j)]);
      double s = 0;
      for (int64_t j = 0; j < n; ++j)
        s += std::exp(x[at(j)] - m);
      for (int64_t j = 0; j < n; ++j)
        y[at(j)] = log ? x[at(j)] - m - std::log(s) : std::exp(x[at(j)] - m) / s;
    }
  }
  return y;
}

// Per-row losses (0 for ignored rows) of logits [N, C].
std::vector<double> ref_ce_rows(const std::vector<double>& x, int64_t c,
                                const std::vector<int64_t>& t, int64_t ignore_index) {
  std::vector<double> loss(t.size(), 0.0);
  for (size_t r = 0; r < t.size(); ++r) {
    if (t[r] == ignore_index) continue;
    double m = -std::numeric_limits<double>::infinity(), s = 0;
    for (int64_t j = 0; j < c; ++j)
      m = std::max(m, x[r * size_t(c) + size_t(j)]);
    for (int64_t j = 0; j < c; ++j)
      s += std::exp(x[r * size_t(c) + size_t(j)] - m);
    loss[r] = m + std::log(s) - x[r * size_t(c) + size_t(t[r])];
  }
  return loss;
}

}  // namespace

TEST(Softmax, EveryDimMatchesReference) {
  Tensor x = random_tensor({3, 4, 5}, 1, DType::Float32);
  std::vector<double> v = x.to_vector<double>();
  for (int64_t dim : {0, 1, 2}) {
    expect_close(kernels::softmax(x, dim), ref_softmax(v, x.shape(), dim, false), 1e-6, 1e-5);
    expect_close(kernels::log_softmax(x, dim), ref_softmax(v, x.shape(), dim, true), 1e-5, 1e-5);
  }
  // Negative dims wrap; the autograd ops give the same values.
  expect_close(tessera::softmax(x, -1), ref_softmax(v, x.shape(), 2, false), 1e-6, 1e-5);
  expect_close(tessera::log_softmax(x, -3), ref_softmax(v, x.shape(), 0, true), 1e-5, 1e-5);
}

TEST(Softmax, NonContiguousInput) {
  Tensor base = random_tensor({5, 3, 4}, 2, DType::Float32);
  Tensor x = kernels::permute(base, {1, 2, 0});  // [3, 4, 5], strided
  ASSERT_FALSE(x.is_contiguous());
  std::vector<double> v = x.to_vector<double>();
  expect_close(kernels::softmax(x, 2), ref_softmax(v, x.shape(), 2, false), 1e-6, 1e-5);
  expect_close(kernels::log_softmax(x, 0), ref_softmax(v, x.shape(), 0, true), 1e-5, 1e-5);
}

TEST(Softmax, StableForLargeLogits) {
  Tensor x = random_tensor({4, 6}, 3, DType::Float32, 1000.0);
  std::vector<double> v = x.to_vector<double>();
  Tensor y = kernels::softmax(x, 1), ly = kernels::log_softmax(x, 1);
  for (double e : y.to_vector<double>())
    ASSERT_TRUE(std::isfinite(e));
  for (double e : ly.to_vector<double>())
    ASSERT_TRUE(std::isfinite(e));
  expect_close(y, ref_softmax(v, x.shape(), 1, false), 1e-6, 1e-5);
  expect_close(ly, ref_softmax(v, x.shape(), 1, true), 1e-3, 1e-6);
}

TEST(Softmax, Float64AndHalfDtypes) {
  Tensor x = random_tensor({3, 7}, 4, DType::Float64);
  std::vector<double> v = x.to_vector<double>();
  Tensor y = kernels::softmax(x, 0);
  EXPECT_EQ(y.dtype(), DType::Float64);
  expect_close(y, ref_softmax(v, x.shape(), 0, false), 1e-14, 1e-12);
  expect_close(kernels::log_softmax(x, 1), ref_softmax(v, x.shape(), 1, true), 1e-14, 1e-12);
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    Tensor h = x.to(dt);
    std::vector<double> hv = h.to_vector<double>();
    Tensor hy = kernels::softmax(h, 1);
    EXPECT_EQ(hy.dtype(), dt);
    expect_close(hy, ref_softmax(hv, h.shape(), 1, false), 1e-2, 1e-2);
    expect_close(kernels::log_softmax(h, 0), ref_softmax(hv, h.shape(), 0, true), 3e-2, 1e-2);
  }
}

TEST(Softmax, EmptyDims) {
  EXPECT_EQ(kernels::softmax(random_tensor({0, 5}, 5, DType::Float32), 1).shape(), (Shape{0, 5}));
  EXPECT_EQ(kernels::log_softmax(random_tensor({3, 0}, 6, DType::Float32), 1).shape(),
            (Shape{3, 0}));
  EXPECT_EQ(kernels::softmax_backward(zeros({3, 0}), zeros({3, 0}), 0).shape(), (Shape{3, 0}));
}

TEST(Softmax, BackwardKernelsMatchReference) {
  Tensor x = random_tensor({3, 4, 2}, 7, DType::Float64);
  Tensor g = random_tensor({3, 4, 2}, 8, DType::Float64);
  std::vector<double> vg = g.to_vector<double>();
  int64_t dim = 1, outer, n, inner;
  split_dims(x.shape(), dim, outer, n, inner);
  Tensor y = kernels::softmax(x, dim), ly = kernels::log_softmax(x, dim);
  std::vector<double> vy = y.to_vector<double>(), vly = ly.to_vector<double>();
  std::vector<double> want_s(vg.size()), want_l(vg.size());
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < inner; ++i) {
      auto at = [&](int64_t j) { return size_t((o * n + j) * inner + i); };
      double dot = 0, gsum = 0;
      for (int64_t j = 0; j < n; ++j) {
        dot += vg[at(j)] * vy[at(j)];
        gsum += vg[at(j)];
      }
      for (int64_t j = 0; j < n; ++j) {
        want_s[at(j)] = vy[at(j)] * (vg[at(j)] - dot);
        want_l[at(j)] = vg[at(j)] - std::exp(vly[at(j)]) * gsum;
      }
    }
  }
  expect_close(kernels::softmax_backward(g, y, dim), want_s, 1e-14, 1e-12);
  expect_close(kernels::log_softmax_backward(g, ly, dim), want_l, 1e-14, 1e-12);
  // A strided gradient gives the same result.
  Tensor gt = kernels::transpose(kernels::transpose(g, 0, 2).contiguous(), 0, 2);
  ASSERT_FALSE(gt.is_contiguous());
  expect_close(kernels::softmax_backward(gt, y, dim), want_s, 1e-14, 1e-12);
}

TEST(Softmax, Gradcheck) {
  for (int64_t dim : {0, 1, -1}) {
    expect_gradcheck([dim](const std::vector<Tensor>& in) { return tessera::softmax(in[0], dim); },
                     {leaf({3, 4, 5}, 9)});
    expect_gradcheck(
        [dim](const std::vector<Tensor>& in) { return tessera::log_softmax(in[0], dim); },
        {leaf({3, 4, 5}, 10)});
  }
}

TEST(CrossEntropy, ReductionsAndIgnoreIndex) {
  const int64_t n = 6, c = 5;
  Tensor x = random_tensor({n, c}, 11, DType::Float32);
  std::vector<int64_t> t = {0, 4, -100, 2, 2, -100};
  Tensor target = from_vector<int64_t>(t, {n});
  std::vector<double> rows = ref_ce_rows(x.to_vector<double>(), c, t, -100);
  double sum = 0;
  for (double r : rows)
    sum += r;

  Tensor none = kernels::cross_entropy(x, target, -100, Reduction::None);
  EXPECT_EQ(none.shape(), (Shape{n}));
  expect_close(none, rows, 1e-5, 1e-5);
  Tensor s = kernels::cross_entropy(x, target, -100, Reduction::Sum);
  EXPECT_EQ(s.dim(), 0);
  expect_close(s, {sum}, 1e-5, 1e-5);
  // Mean divides by the 4 rows that count, not by 6.
  expect_close(kernels::cross_entropy(x, target), {sum / 4.0}, 1e-5, 1e-5);
  expect_close(tessera::cross_entropy(x, target), {sum / 4.0}, 1e-5, 1e-5);

  // ignore_index may be a valid class.
  std::vector<int64_t> t2 = {0, 4, 1, 2, 2, 3};
  std::vector<double> rows2 = ref_ce_rows(x.to_vector<double>(), c, t2, 2);
  double sum2 = 0;
  for (double r : rows2)
    sum2 += r;
  expect_close(kernels::cross_entropy(x, from_vector<int64_t>(t2, {n}), 2), {sum2 / 4.0}, 1e-5,
               1e-5);

  // Nothing left to average over: 0/0.
  Tensor all_ignored = full({n}, -100, DType::Int64);
  EXPECT_TRUE(std::isnan(kernels::cross_entropy(x, all_ignored).item<double>()));
  EXPECT_EQ(kernels::cross_entropy(x, all_ignored, -100, Reduction::Sum).item<double>(), 0.0);
}

// A row with a +inf logit has no finite log-softmax: NaN, as torch's cross_entropy and our own
// log_softmax give, in the loss and in its gradient (not an infinite loss with finite
// gradients, which hid the overflow). A row of -inf logits is NaN too.
TEST(CrossEntropy, InfiniteLogitsGiveNaNAsLogSoftmaxDoes) {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::Float32, DType::Float64}) {
    const Tensor x = from_vector<double>({inf, 0, -inf, -inf}, {2, 2}).to(dt);
    const Tensor target = from_vector<int64_t>({1, 0}, {2});
    const Tensor loss = kernels::cross_entropy(x, target, -100, Reduction::None);
    EXPECT_TRUE(std::isnan(loss.to_vector<double>()[0])) << dtype_name(dt);
    EXPECT_TRUE(std::isnan(loss.to_vector<double>()[1])) << dtype_name(dt);
    EXPECT_TRUE(std::isnan(kernels::log_softmax(x, 1).to_vector<double>()[1])) << dtype_name(dt);
    const Tensor g =
        kernels::cross_entropy_backward(full({}, 1.0, dt), x, target, -100, Reduction::Mean);
    EXPECT_TRUE(std::isnan(g.to_vector<double>()[1])) << dtype_name(dt);
  }
}

TEST(CrossEntropy, HigherRankLogitsAndDtypes) {
  Tensor x = random_tensor({2, 3, 4}, 12, DType::Float64);
  std::vector<int64_t> t = {3, 0, 1, -100, 2, 2};
  Tensor target = from_vector<int64_t>(t, {2, 3});
  std::vector<double> rows = ref_ce_rows(x.to_vector<double>(), 4, t, -100);
  Tensor none = tessera::cross_entropy(x, target, -100, Reduction::None);
  EXPECT_EQ(none.shape(), (Shape{2, 3}));
  expect_close(none, rows, 1e-12, 1e-12);

  // Unbatched: logits [C] with a 0-d target, as in PyTorch.
  Tensor row = kernels::select(kernels::select(x, 0, 0), 0, 0);
  Tensor one = tessera::cross_entropy(row, scalar_tensor(3, DType::Int64), -100, Reduction::None);
  EXPECT_EQ(one.dim(), 0);
  expect_close(one, {rows[0]}, 1e-12, 1e-12);

  Tensor h = x.to(DType::BFloat16);
  Tensor flat = from_vector<int64_t>(t, {6});
  std::vector<double> hrows = ref_ce_rows(h.to_vector<double>(), 4, t, -100);
  Tensor hl = kernels::cross_entropy(kernels::reshape(h, {6, 4}), flat, -100, Reduction::None);
  EXPECT_EQ(hl.dtype(), DType::BFloat16);
  expect_close(hl, hrows, 2e-2, 1e-2);
}

TEST(CrossEntropy, BackwardKernelMatchesReference) {
  const int64_t n = 4, c = 3;
  Tensor x = random_tensor({n, c}, 13, DType::Float64);
  std::vector<int64_t> t = {2, -100, 0, 1};
  Tensor target = from_vector<int64_t>(t, {n});
  std::vector<double> vx = x.to_vector<double>();
  std::vector<double> gl = {0.5, 2.0, -1.0, 3.0};
  auto ref_grad = [&](Reduction red, double scalar) {
    std::vector<double> g(vx.size(), 0.0);
    for (int64_t r = 0; r < n; ++r) {
      if (t[size_t(r)] == -100) continue;
      std::vector<double> row(vx.begin() + r * c, vx.begin() + (r + 1) * c);
      std::vector<double> p = ref_softmax(row, {c}, 0, false);
      double w = red == Reduction::None  ? gl[size_t(r)]
                 : red == Reduction::Sum ? scalar
                                         : scalar / 3.0;
      for (int64_t j = 0; j < c; ++j)
        g[size_t(r * c + j)] = w * (p[size_t(j)] - (j == t[size_t(r)] ? 1.0 : 0.0));
    }
    return g;
  };
  expect_close(kernels::cross_entropy_backward(from_vector<double>(gl, {n}), x, target, -100,
                                               Reduction::None),
               ref_grad(Reduction::None, 0), 1e-14, 1e-12);
  expect_close(kernels::cross_entropy_backward(scalar_tensor(1.5, DType::Float64), x, target, -100,
                                               Reduction::Mean),
               ref_grad(Reduction::Mean, 1.5), 1e-14, 1e-12);
  expect_close(kernels::cross_entropy_backward(scalar_tensor(0.25, DType::Float64), x, target, -100,
                                               Reduction::Sum),
               ref_grad(Reduction::Sum, 0.25), 1e-14, 1e-12);
}

TEST(CrossEntropy, Gradcheck) {
  Tensor target = from_vector<int64_t>({1, -100, 0, 3, 3}, {5});
  for (Reduction red : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    expect_gradcheck(
        [&](const std::vector<Tensor>& in) {
          return tessera::cross_entropy(in[0], target, -100, red);
        },
        {leaf({5, 4}, 14)});
  }
  Tensor target3 = from_vector<int64_t>({1, 2, 0, -100}, {2, 2});
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) { return tessera::cross_entropy(in[0], target3); },
      {leaf({2, 2, 3}, 15)});
  // Composed with a softmax upstream, the chain rule runs through both.
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) {
        return tessera::cross_entropy(tessera::log_softmax(in[0], 0), target);
      },
      {leaf({5, 4}, 16)});
}

// A floating target of the logits' shape holds class probabilities, as in PyTorch: the loss is
// -sum(target * log_softmax(logits)) per row, and the target receives its gradient,
// -log_softmax(logits) times the reduction's scale (the logits' is softmax * sum(target) -
// target). The last row's probabilities do not add up to one, which PyTorch allows too.
TEST(CrossEntropy, ClassProbabilityTargetsAndTheirGradient) {
  const int64_t n = 3, c = 4;
  const std::vector<double> p = {0.1, 0.2, 0.3, 0.4, 1.0, 0, 0, 0, 0.5, 0.25, 0.5, 0.0};
  for (Reduction red : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    Tensor x = leaf({n, c}, 41);
    Tensor t = from_vector<double>(p, {n, c});
    t.set_requires_grad(true);
    const Tensor loss = tessera::cross_entropy(x, t, -100, red);
    const std::vector<double> ls = kernels::log_softmax(x.detach(), 1).to_vector<double>();
    const std::vector<double> sm = kernels::softmax(x.detach(), 1).to_vector<double>();
    std::vector<double> rows(n, 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < c; ++j)
        rows[size_t(i)] -= p[size_t(i * c + j)] * ls[size_t(i * c + j)];
    const double total = rows[0] + rows[1] + rows[2];
    const double scale = red == Reduction::Mean ? 1.0 / double(n) : 1.0;
    if (red == Reduction::None) {
      expect_close(loss, rows, 1e-12, 1e-12);
      backward(loss, full({n}, 1.0, DType::Float64));
    } else {
      expect_close(loss, {total * scale}, 1e-12, 1e-12);
      backward(loss);
    }
    ASSERT_TRUE(t.grad().defined()) << "reduction " << int(red);
    ASSERT_TRUE(x.grad().defined()) << "reduction " << int(red);
    std::vector<double> want_t(size_t(n * c)), want_x(size_t(n * c));
    for (int64_t i = 0; i < n; ++i) {
      double mass = 0;
      for (int64_t j = 0; j < c; ++j)
        mass += p[size_t(i * c + j)];
      for (int64_t j = 0; j < c; ++j) {
        const size_t k = size_t(i * c + j);
        want_t[k] = -ls[k] * scale;
        want_x[k] = (sm[k] * mass - p[k]) * scale;
      }
    }
    expect_close(t.grad(), want_t, 1e-12, 1e-12);
    expect_close(x.grad(), want_x, 1e-12, 1e-12);
  }
  // Finite differences, both inputs, over logits of higher rank.
  for (Reduction red : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    expect_gradcheck(
        [&](const std::vector<Tensor>& in) {
          return tessera::cross_entropy(in[0], in[1], -100, red);
        },
        {leaf({2, 2, 3}, 42), leaf({2, 2, 3}, 43)});
  }
  // ignore_index applies to class indices only: a probability equal to it is a probability.
  const Tensor x = random_tensor({2, 3}, 44, DType::Float64);
  const Tensor t = from_vector<double>({-100, 0, 1, 0, 0, 1}, {2, 3});
  EXPECT_NE(tessera::cross_entropy(x, t).item<double>(), 0.0);
  EXPECT_TRUE(std::isfinite(tessera::cross_entropy(x, t).item<double>()));
}

// label_smoothing eps, as PyTorch's: per kept row (1 - eps) * -log_softmax[target] + eps * the
// mean over the classes of -log_softmax; ignored rows count in neither term nor in the mean's
// divisor. Checked against that closed form at rank 3, with eps 0 and 1 at the ends.
TEST(CrossEntropy, LabelSmoothingOfClassIndices) {
  const int64_t c = 5;
  const std::vector<int64_t> t = {0, 4, -100, 2, 2, -100};
  const Tensor target = from_vector<int64_t>(t, {2, 3});
  for (double eps : {0.0, 0.1, 0.3, 1.0}) {
    SCOPED_TRACE(eps);
    Tensor x = leaf({2, 3, c}, 61);
    const std::vector<double> ls = kernels::log_softmax(x.detach(), -1).to_vector<double>();
    std::vector<double> rows(t.size(), 0.0);
    for (size_t i = 0; i < t.size(); ++i) {
      if (t[i] == -100) continue;
      double mean_neg = 0;
      for (int64_t j = 0; j < c; ++j)
        mean_neg -= ls[i * size_t(c) + size_t(j)] / double(c);
      rows[i] = (1 - eps) * -ls[i * size_t(c) + size_t(t[i])] + eps * mean_neg;
    }
    double sum = 0;
    for (double r : rows)
      sum += r;
    const Tensor none = tessera::cross_entropy(x, target, -100, Reduction::None, eps);
    EXPECT_EQ(none.shape(), (Shape{2, 3}));
    expect_close(none, rows, 1e-12, 1e-12);
    expect_close(tessera::cross_entropy(x, target, -100, Reduction::Sum, eps), {sum}, 1e-12, 1e-12);
    expect_close(tessera::cross_entropy(x, target, -100, Reduction::Mean, eps), {sum / 4.0}, 1e-12,
                 1e-12);
    for (Reduction red : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
      expect_gradcheck(
          [&](const std::vector<Tensor>& in) {
            return tessera::cross_entropy(in[0], target, -100, red, eps);
          },
          {x});
    }
  }
  // Nothing kept: the mean is 0/0 as without smoothing, the sum 0.
  const Tensor x = random_tensor({3, c}, 62, DType::Float32);
  const Tensor all_ignored = full({3}, -100, DType::Int64);
  EXPECT_TRUE(std::isnan(
      tessera::cross_entropy(x, all_ignored, -100, Reduction::Mean, 0.2).item<double>()));
  EXPECT_EQ(tessera::cross_entropy(x, all_ignored, -100, Reduction::Sum, 0.2).item<double>(), 0.0);
}

// Class probabilities are smoothed as PyTorch's: target * (1 - eps) + eps / C.
TEST(CrossEntropy, LabelSmoothingOfClassProbabilities) {
  const int64_t n = 2, c = 3;
  const std::vector<double> p = {0.2, 0.3, 0.5, 1.0, 0.0, 0.0};
  const double eps = 0.25;
  Tensor x = leaf({n, c}, 63);
  const std::vector<double> ls = kernels::log_softmax(x.detach(), 1).to_vector<double>();
  std::vector<double> rows(n, 0.0);
  for (size_t k = 0; k < p.size(); ++k)
    rows[k / size_t(c)] -= (p[k] * (1 - eps) + eps / double(c)) * ls[k];
  const Tensor t = from_vector<double>(p, {n, c});
  expect_close(tessera::cross_entropy(x, t, -100, Reduction::None, eps), rows, 1e-12, 1e-12);
  expect_close(tessera::cross_entropy(x, t, -100, Reduction::Mean, eps),
               {(rows[0] + rows[1]) / 2.0}, 1e-12, 1e-12);
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) {
        return tessera::cross_entropy(in[0], in[1], -100, Reduction::Sum, eps);
      },
      {x, leaf({n, c}, 64)});
}

TEST(CrossEntropy, LabelSmoothingOutOfRangeIsAnError) {
  const Tensor x = random_tensor({2, 3}, 65, DType::Float32);
  const Tensor t = from_vector<int64_t>({0, 2}, {2});
  for (double eps : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    const std::string msg =
        error_of([&] { tessera::cross_entropy(x, t, -100, Reduction::Mean, eps); });
    EXPECT_NE(msg.find("label_smoothing"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[0, 1]"), std::string::npos) << msg;
  }
}

TEST(CrossEntropy, Errors) {
  Tensor x = random_tensor({2, 3, 5}, 17, DType::Float32);
  std::string msg = error_of([&] {
    tessera::cross_entropy(x, from_vector<int64_t>({0, 1, 2}, {3}));
  });
  EXPECT_NE(msg.find("cross_entropy"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 3, 5]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;

  Tensor x2 = random_tensor({4, 5}, 18, DType::Float32);
  msg = error_of([&] { kernels::cross_entropy(x2, from_vector<int64_t>({0, 1}, {2})); });
  EXPECT_NE(msg.find("[2]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 5]"), std::string::npos) << msg;

  msg = error_of([&] { kernels::cross_entropy(x2, from_vector<int64_t>({0, 7, 1, 2}, {4})); });
  EXPECT_NE(msg.find("target 7"), std::string::npos) << msg;
  EXPECT_NE(msg.find("5 classes"), std::string::npos) << msg;

  msg = error_of([&] { kernels::cross_entropy(x2, zeros({4}, DType::Float32)); });
  EXPECT_NE(msg.find("int64"), std::string::npos) << msg;
  // Class probabilities must have the logits' shape and dtype.
  msg = error_of([&] { tessera::cross_entropy(x2, zeros({4, 4}, DType::Float32)); });
  EXPECT_NE(msg.find("probabilities"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 4]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 5]"), std::string::npos) << msg;
  msg = error_of([&] { tessera::cross_entropy(x2, zeros({4, 5}, DType::Float64)); });
  EXPECT_NE(msg.find("float64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("float32"), std::string::npos) << msg;
}
