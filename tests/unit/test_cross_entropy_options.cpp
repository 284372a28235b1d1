// cross_entropy's options on class-index targets, label smoothing and class weights, against a
// float64 reference written out here from PyTorch's definition: values and gradients for every
// reduction with ignored rows, in float32 and bfloat16, and the memory the fused kernel saves.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernel_test_util.h"
#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using kernel_test::expect_close;
using kernel_test::expect_gradcheck;
using tessera::testing::error_of;
using tessera::testing::random_tensor;

namespace {

constexpr int64_t kIgnore = -100;

// PyTorch's loss per row of logits [N, C] (0 on ignored rows) and the mean's divisor:
// (1 - eps) * w[t] * -log p[t] + (eps / C) * sum_j w[j] * -log p[j], w all ones when empty, and
// the sum of w[t] over the kept rows.
struct Reference {
  std::vector<double> rows;
  std::vector<double> grad;  // d(sum of rows * row_grad) / dx
  double divisor = 0;
};

Reference reference(const std::vector<double>& x, int64_t c, const std::vector<int64_t>& t,
                    double eps, const std::vector<double>& weight,
                    const std::vector<double>& row_grad) {
  Reference r;
  r.rows.assign(t.size(), 0.0);
  r.grad.assign(x.size(), 0.0);
  auto w = [&](int64_t j) { return weight.empty() ? 1.0 : weight[size_t(j)]; };
  double w_total = 0;
  for (int64_t j = 0; j < c; ++j)
    w_total += w(j);
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == kIgnore) continue;
    const double* row = x.data() + i * size_t(c);
    double m = -std::numeric_limits<double>::infinity(), s = 0;
    for (int64_t j = 0; j < c; ++j)
      m = std::max(m, row[j]);
    for (int64_t j = 0; j < c; ++j)
      s += std::exp(row[j] - m);
    const double lse = m + std::log(s);
    double smooth = 0;
    for (int64_t j = 0; j < c; ++j)
      smooth += w(j) * (lse - row[j]) / double(c);
    r.rows[i] = (1 - eps) * w(t[i]) * (lse - row[t[i]]) + eps * smooth;
    r.divisor += w(t[i]);
    for (int64_t j = 0; j < c; ++j) {
      const double p = std::exp(row[j] - lse);
      const double g = (1 - eps) * w(t[i]) * (p - (j == t[i] ? 1.0 : 0.0)) +
                       eps / double(c) * (p * w_total - w(j));
      r.grad[i * size_t(c) + size_t(j)] = g * row_grad[i];
    }
  }
  return r;
}

// The loss and the logits' gradient for `reduction`, checked against the reference at `tol`.
void expect_matches_reference(DType dt, Reduction reduction, double eps,
                              const std::vector<double>& weight, double tol) {
  const int64_t n = 7, c = 11;
  const std::vector<int64_t> t = {3, kIgnore, 0, 10, 10, kIgnore, 5};
  const Tensor target = from_vector<int64_t>(t, {n});
  Tensor x = random_tensor({n, c}, 71, DType::Float64, 3.0).to(dt);
  x.set_requires_grad(true);
  const std::vector<double> xv = x.to_vector<double>();
  const std::string what = std::string(dtype_name(dt)) + " " + reduction_name(reduction) + " eps " +
                           std::to_string(eps) + (weight.empty() ? "" : " weighted");
  const Tensor w = weight.empty() ? Tensor() : from_vector<double>(weight, {c}).to(dt);
  Tensor loss = cross_entropy(x, target, kIgnore, reduction, eps, w);
  ASSERT_EQ(loss.dtype(), dt) << what;
  if (reduction == Reduction::None) {
    std::vector<double> gl(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      gl[size_t(i)] = 0.5 + 0.25 * double(i);
    const Reference r = reference(xv, c, t, eps, weight, gl);
    expect_close(loss, r.rows, tol, tol, what + " loss");
    backward(loss, from_vector<double>(gl, {n}).to(dt));
    expect_close(x.grad(), r.grad, tol, tol, what + " grad");
    return;
  }
  const Reference r0 = reference(xv, c, t, eps, weight, std::vector<double>(size_t(n), 1.0));
  const double scale = reduction == Reduction::Mean ? 1.0 / r0.divisor : 1.0;
  const Reference r = reference(xv, c, t, eps, weight, std::vector<double>(size_t(n), scale));
  double total = 0;
  for (double v : r.rows)
    total += v;
  expect_close(loss, {total * scale}, tol, tol, what + " loss");
  backward(loss);
  expect_close(x.grad(), r.grad, tol, tol, what + " grad");
}

}  // namespace

TEST(CrossEntropyOptions, LabelSmoothingMatchesReference) {
  for (Reduction red : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    for (double eps : {0.0, 0.1, 1.0}) {
      expect_matches_reference(DType::Float32, red, eps, {}, 2e-5);
      expect_matches_reference(DType::BFloat16, red, eps, {}, 3e-2);
    }
  }
}

// Class weights (a zero among them) with and without smoothing, as PyTorch's: a mean divides by
// the kept rows' target weights, 1.5 + 0.5 + 0.5 + 1.25 + ... here, not by their count.
TEST(CrossEntropyOptions, ClassWeightsMatchReference) {
  std::vector<double> weight = kernel_test::wavy(11, 0.25, 2.0);
  weight[3] = 0.0;
  for (Reduction red : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    for (double eps : {0.0, 0.1, 1.0}) {
      expect_matches_reference(DType::Float32, red, eps, weight, 2e-5);
      expect_matches_reference(DType::BFloat16, red, eps, weight, 3e-2);
    }
  }
}

// Finite differences through the weighted, smoothed loss at rank 3.
TEST(CrossEntropyOptions, ClassWeightsGradcheck) {
  const Tensor target = from_vector<int64_t>({1, kIgnore, 0, 3, 3, 2}, {2, 3});
  const Tensor weight = from_vector<double>({0.5, 2.0, 1.0, 0.0}, {4});
  for (Reduction red : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    for (double eps : {0.0, 0.3}) {
      expect_gradcheck(
          [&](const std::vector<Tensor>& in) {
            return cross_entropy(in[0], target, kIgnore, red, eps, weight);
          },
          {kernel_test::leaf(kernel_test::wavy(24, -2.0, 2.0), {2, 3, 4})},
          std::string(reduction_name(red)) + " eps " + std::to_string(eps));
    }
  }
}

// Class probabilities with weights, as PyTorch's: -sum_c w[c] * q[c] * log_softmax[c] per row,
// q smoothed to q * (1 - eps) + eps / C; a mean divides by the rows, not by any weight.
TEST(CrossEntropyOptions, ClassWeightsOfProbabilityTargets) {
  const int64_t n = 2, c = 3;
  const std::vector<double> p = {0.2, 0.3, 0.5, 1.0, 0.0, 0.0}, w = {0.5, 2.0, 1.5};
  for (double eps : {0.0, 0.25}) {
    Tensor x = kernel_test::leaf(kernel_test::wavy(n * c, -1.5, 1.5), {n, c});
    const Tensor weight = from_vector<double>(w, {c});
    const std::vector<double> ls = kernels::log_softmax(x.detach(), 1).to_vector<double>();
    std::vector<double> rows(size_t(n), 0.0);
    for (size_t k = 0; k < p.size(); ++k)
      rows[k / size_t(c)] -= w[k % size_t(c)] * (p[k] * (1 - eps) + eps / double(c)) * ls[k];
    const Tensor t = from_vector<double>(p, {n, c});
    expect_close(cross_entropy(x, t, kIgnore, Reduction::None, eps, weight), rows, 1e-12, 1e-12);
    expect_close(cross_entropy(x, t, kIgnore, Reduction::Mean, eps, weight),
                 {(rows[0] + rows[1]) / 2.0}, 1e-12, 1e-12);
    expect_close(cross_entropy(x, t, kIgnore, Reduction::Sum, eps, weight), {rows[0] + rows[1]},
                 1e-12, 1e-12);
    Tensor tl = t.detach();
    tl.set_requires_grad(true);
    expect_gradcheck(
        [&](const std::vector<Tensor>& in) {
          return cross_entropy(in[0], in[1], kIgnore, Reduction::Mean, eps, weight);
        },
        {x, tl}, "probabilities eps " + std::to_string(eps));
  }
}

TEST(CrossEntropyOptions, ClassWeightErrorsNameShapesAndDtypes) {
  const Tensor x = random_tensor({2, 3, 5}, 73, DType::Float32);
  const Tensor t = from_vector<int64_t>({0, 1, 2, 3, 4, 0}, {2, 3});
  const Tensor probs = zeros({2, 3, 5}, DType::Float32);
  for (const Tensor& target : {t, probs}) {
    std::string msg = error_of([&] {
      cross_entropy(x, target, kIgnore, Reduction::Mean, 0.0, zeros({4}, DType::Float32));
    });
    EXPECT_NE(msg.find("cross_entropy: weight of shape [4]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[2, 3, 5]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected [5]"), std::string::npos) << msg;
    msg = error_of([&] {
      cross_entropy(x, target, kIgnore, Reduction::Mean, 0.0, zeros({1, 5}, DType::Float32));
    });
    EXPECT_NE(msg.find("[1, 5]"), std::string::npos) << msg;
    msg = error_of([&] {
      cross_entropy(x, target, kIgnore, Reduction::Mean, 0.0, zeros({5}, DType::Float64));
    });
    EXPECT_NE(msg.find("float64"), std::string::npos) << msg;
    EXPECT_NE(msg.find("logits' dtype float32"), std::string::npos) << msg;
    Tensor trainable = zeros({5}, DType::Float32);
    trainable.set_requires_grad(true);
    msg = error_of([&] { cross_entropy(x, target, kIgnore, Reduction::Mean, 0.0, trainable); });
    EXPECT_NE(msg.find("requires grad"), std::string::npos) << msg;
  }
  // The kernel checks the same, for its own callers.
  const std::string msg = error_of([&] {
    kernels::cross_entropy(kernels::reshape(x, {6, 5}), kernels::reshape(t, {6}), kIgnore,
                           Reduction::Mean, 0.0, zeros({6}, DType::Float32));
  });
  EXPECT_NE(msg.find("weight of shape [6]"), std::string::npos) << msg;
}

// int32 class indices are int64's (the loss-parallel cross-entropy takes both too); other
// integer dtypes are refused by name.
TEST(CrossEntropyOptions, Int32TargetsAreInt64s) {
  const std::vector<int64_t> t = {3, kIgnore, 0, 4};
  const Tensor t64 = from_vector<int64_t>(t, {4});
  for (double eps : {0.0, 0.2}) {
    std::vector<Tensor> losses, grads;
    for (DType dt : {DType::Int64, DType::Int32}) {
      Tensor x = kernel_test::leaf(kernel_test::wavy(20, -2.0, 2.0), {4, 5});
      Tensor loss = cross_entropy(x, t64.to(dt), kIgnore, Reduction::Mean, eps);
      backward(loss);
      losses.push_back(loss);
      grads.push_back(x.grad());
    }
    expect_close(losses[1], losses[0].to_vector<double>(), 0.0, 0.0, "int32 loss");
    expect_close(grads[1], grads[0].to_vector<double>(), 0.0, 0.0, "int32 grad");
  }
  const Tensor x = random_tensor({4, 5}, 74, DType::Float32);
  const std::string msg = error_of([&] { cross_entropy(x, t64.to(DType::Bool)); });
  EXPECT_NE(msg.find("int64 or int32 class indices"), std::string::npos) << msg;
}

// The smoothing term is fused into the kernel both ways: a forward and backward with
// label_smoothing allocates no more than without it (the gradient and per-row statistics), no
// log-softmax of the logits' size.
TEST(CrossEntropyOptions, LabelSmoothingAllocatesNoLogitsSizedTemporary) {
  const int64_t n = 64, c = 4096;
  const Tensor logits = random_tensor({n, c}, 72, DType::Float32);
  std::vector<int64_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    t[size_t(i)] = i % 5 == 4 ? kIgnore : (i * 37) % c;
  const Tensor target = from_vector<int64_t>(t, {n});
  auto peak_of = [&](double eps) {
    Tensor x = logits.detach();
    x.set_requires_grad(true);
    const int64_t before = memory_stats().current_bytes;
    reset_peak_memory();
    backward(cross_entropy(x, target, kIgnore, Reduction::Mean, eps));
    return memory_stats().peak_bytes - before;
  };
  const int64_t plain = peak_of(0.0), smoothed = peak_of(0.1);
  const int64_t logits_bytes = n * c * 4;
  EXPECT_GE(plain, logits_bytes);  // the gradient
  EXPECT_LT(smoothed, plain + logits_bytes / 8)
      << "plain " << plain << " B, smoothed " << smoothed << " B, logits " << logits_bytes << " B";
}
