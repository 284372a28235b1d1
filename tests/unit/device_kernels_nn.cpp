// Core's device kernels against the CPU kernels, as test_device_kernels.cpp: matrix products in
// every layout, reductions over any dims, softmax, norms, RoPE, dropout, cross entropy, gathers,
// attention and the vocabulary parallel stages. Part of the test_device_kernels binary.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "tessera/core/detail/emulated_kernels.h"
#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"
#include "tessera/testing/stand_in_device.h"
#include "unit/device_kernels_test_util.h"

using namespace tessera;
using kernels::BinaryOp;
using kernels::CompareOp;
using kernels::UnaryOp;
using tessera::testing::expect_error;
using tessera::testing::KernelsOn;
using tessera::testing::random_tensor;
using tessera::testing::TestDevice;
using tessera::testing::Tolerance;
using namespace tessera::device_kernels_test;

TEST(DeviceKernels, MatrixProductsInEveryLayoutFollowTheCpu) {
  TestDevice device(KernelsOn::Device);
  // Accumulation order differs from the CPU's blocked products: a few ulps of the sum.
  auto tol = [](DType dt) {
    return dt == DType::Float64 ? Tolerance{1e-12, 1e-12} : rounding_of(dt);
  };
  for (DType dt : kFloatDtypes) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const std::string what = std::string(dtype_name(dt)) + (ta ? " a^T" : " a") +
                                 (tb ? " b^T" : " b") + " on " + device.str();
        // Batched with broadcast batch dims: [2, 1, m, k] x [3, k, n].
        const Tensor a = random_tensor(ta ? Shape{2, 1, 5, 4} : Shape{2, 1, 4, 5}, 81, dt);
        const Tensor b = random_tensor(tb ? Shape{3, 6, 5} : Shape{3, 5, 6}, 82, dt);
        expect_matches(kernels::matmul(cuda(a), cuda(b), ta, tb), kernels::matmul(a, b, ta, tb),
                       tol(dt), what + " batched");
        // One a for every b: a's batch stride is 0, not the stride of its size-1 dim.
        const Tensor a1 = random_tensor(ta ? Shape{1, 5, 4} : Shape{1, 4, 5}, 80, dt);
        expect_matches(kernels::matmul(cuda(a1), cuda(b), ta, tb), kernels::matmul(a1, b, ta, tb),
                       tol(dt), what + " one a for a batch of b");
        // 2-D views no BLAS layout fits (both strides above 1), and a column-major view.
        const Tensor sa = random_tensor({12, 10}, 83, dt);
        const Tensor va = sa.as_strided({4, 5}, {20, 2}, 1);
        const Tensor va_dev = cuda(sa).as_strided({4, 5}, {20, 2}, 1);
        const Tensor sb = random_tensor({6, 5}, 84, dt);
        const Tensor vb =
            sb.as_strided(tb ? Shape{6, 5} : Shape{5, 6}, tb ? Shape{5, 1} : Shape{1, 5}, 0);
        const Tensor vb_dev =
            cuda(sb).as_strided(tb ? Shape{6, 5} : Shape{5, 6}, tb ? Shape{5, 1} : Shape{1, 5}, 0);
        expect_matches(kernels::matmul(va_dev, vb_dev, false, tb),
                       kernels::matmul(va, vb, false, tb), tol(dt), what + " strided views");
        // Degenerate products, as an empty shard of a row-parallel weight makes (k = 0: zeros):
        // cuBLAS refuses a leading dimension below 1 even where it addresses nothing.
        for (const auto& [m, k, n] :
             {std::tuple{3, 0, 4}, {1, 0, 1}, {1, 5, 1}, {4, 1, 3}, {0, 3, 2}, {2, 3, 0}}) {
          const Tensor da = random_tensor(ta ? Shape{k, m} : Shape{m, k}, 92, dt);
          const Tensor db = random_tensor(tb ? Shape{n, k} : Shape{k, n}, 93, dt);
          expect_matches(kernels::matmul(cuda(da), cuda(db), ta, tb),
                         kernels::matmul(da, db, ta, tb), tol(dt),
                         what + " [" + std::to_string(m) + ", " + std::to_string(k) + "] x [" +
                             std::to_string(k) + ", " + std::to_string(n) + "]");
        }
        // Rows of nothing whose stride is 0 (one row expanded): a leading dimension of 0.
        const Tensor ea = expand(random_tensor({1, 0}, 96, dt), {3, 0});
        const Tensor eb = random_tensor(tb ? Shape{4, 0} : Shape{0, 4}, 97, dt);
        expect_matches(kernels::matmul(expand(cuda(random_tensor({1, 0}, 96, dt)), {3, 0}),
                                       cuda(eb), false, tb),
                       kernels::matmul(ea, eb, false, tb), tol(dt), what + " expanded [3, 0]");
      }
    }
    const Tensor x = random_tensor({2, 3, 8}, 85, dt), w = random_tensor({5, 8}, 86, dt),
                 bias = random_tensor({5}, 87, dt);
    expect_matches(kernels::linear(cuda(x), cuda(w), cuda(bias)), kernels::linear(x, w, bias),
                   tol(dt), std::string("linear ") + dtype_name(dt));
    expect_matches(kernels::linear(cuda(x), cuda(w)), kernels::linear(x, w), tol(dt),
                   std::string("linear without bias ") + dtype_name(dt));
    const Tensor c = random_tensor({1, 5}, 88, dt);
    const Tensor m = random_tensor({6, 8}, 89, dt);
    expect_matches(kernels::addmm(cuda(c), cuda(m), cuda(w), 0.5, 2.0, false, true),
                   kernels::addmm(c, m, w, 0.5, 2.0, false, true), tol(dt),
                   std::string("addmm ") + dtype_name(dt));
    const Tensor m0 = random_tensor({6, 0}, 94, dt), w0 = random_tensor({5, 0}, 95, dt);
    expect_matches(kernels::addmm(cuda(c), cuda(m0), cuda(w0), 0.5, 2.0, false, true),
                   kernels::addmm(c, m0, w0, 0.5, 2.0, false, true), tol(dt),
                   std::string("addmm with k = 0 ") + dtype_name(dt));
    if (is_half(dt)) continue;
    Tensor acc = random_tensor({6, 5}, 90, dt);
    Tensor acc_dev = cuda(acc);
    kernels::matmul_accumulate_(acc_dev, cuda(m), cuda(w), -1.5, false, true);
    kernels::matmul_accumulate_(acc, m, w, -1.5, false, true);
    expect_matches(acc_dev, acc, tol(dt), std::string("matmul_accumulate_ ") + dtype_name(dt));
    kernels::matmul_accumulate_(acc_dev, cuda(m0), cuda(w0), -1.5, false, true);
    kernels::matmul_accumulate_(acc, m0, w0, -1.5, false, true);
    expect_matches(acc_dev, acc, tol(dt),
                   std::string("matmul_accumulate_ with k = 0 ") + dtype_name(dt));
  }
  const Tensor a = cuda(random_tensor({3, 4}, 91, DType::Float32));
  expect_error([&] { kernels::matmul(a, a); }, {"matmul", "inner dimensions", "[3, 4]"});
  expect_error([&] { kernels::matmul(a, a.to(DType::Float64), false, true); },
               {"matmul", "dtype mismatch"});
}

TEST(DeviceKernels, ReductionsOverAnyDimsFollowTheCpu) {
  TestDevice device(KernelsOn::Device);
  // Sums add in float64 on both sides, in different orders: within one rounding of the result.
  auto sum_tol = [](DType dt) {
    return is_integer(dt) || dt == DType::Bool ? Tolerance{} : Tolerance{1e-6, 1e-9};
  };
  const std::vector<std::vector<int64_t>> dim_sets = {{}, {0}, {1}, {-1}, {0, 2}};
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Int64, DType::Bool}) {
    const Tensor base = random_tensor({3, 4, 5}, 101, DType::Float64, 5.0).to(dt);
    // Also a permuted view, so reduced elements are not contiguous.
    const Tensor perm = random_tensor({5, 4, 3}, 102, DType::Float64, 5.0).to(dt);
    for (const auto& [name, x, x_dev] :
         {std::tuple<std::string, Tensor, Tensor>{"contiguous", base, cuda(base)},
          {"permuted", perm.as_strided({3, 4, 5}, {1, 3, 12}, 0),
           cuda(perm).as_strided({3, 4, 5}, {1, 3, 12}, 0)}}) {
      for (const auto& dims : dim_sets) {
        for (bool keep : {false, true}) {
          const std::string what = std::string(dtype_name(dt)) + " " + name + " dims " +
                                   shape_str(dims) + (keep ? " keepdim" : "");
          expect_matches(kernels::sum(x_dev, dims, keep), kernels::sum(x, dims, keep), sum_tol(dt),
                         "sum " + what);
          if (dt == DType::Bool) continue;
          expect_matches(kernels::amax(x_dev, dims, keep), kernels::amax(x, dims, keep), {},
                         "amax " + what);
          expect_matches(kernels::amin(x_dev, dims, keep), kernels::amin(x, dims, keep), {},
                         "amin " + what);
          if (!is_integer(dt))
            expect_matches(kernels::mean(x_dev, dims, keep), kernels::mean(x, dims, keep),
                           sum_tol(dt), "mean " + what);
        }
      }
      if (dt == DType::Bool) continue;
      for (int64_t d : {0, 1, 2}) {
        const auto dev = kernels::max(x_dev, d, false);
        const auto cpu = kernels::max(x, d, false);
        expect_matches(dev.values, cpu.values, {}, std::string("max values ") + dtype_name(dt));
        expect_matches(dev.indices, cpu.indices, {}, std::string("max indices ") + dtype_name(dt));
        expect_matches(kernels::argmax(x_dev, d, true), kernels::argmax(x, d, true), {},
                       std::string("argmax ") + dtype_name(dt));
      }
    }
  }
  // Few outputs over many elements: the chunked sums, and the squared norm.
  const Tensor wide = random_tensor({3, 20000}, 103, DType::Float32);
  expect_matches(kernels::sum(cuda(wide), {1}, false), kernels::sum(wide, {1}, false), {1e-6, 1e-9},
                 "chunked sum");
  expect_matches(kernels::mean(cuda(wide), {}, false), kernels::mean(wide, {}, false), {1e-6, 1e-9},
                 "chunked mean of everything");
  expect_matches(kernels::sum_of_squares(cuda(wide)), kernels::sum_of_squares(wide), {1e-12, 0},
                 "sum_of_squares");
  // Rows too short to cut into chunks but long enough for a team per output.
  const Tensor rows = random_tensor({64, 2048}, 106, DType::Float32);
  expect_matches(kernels::sum(cuda(rows), {1}, false), kernels::sum(rows, {1}, false), {1e-6, 1e-9},
                 "sum by teams");
  expect_matches(kernels::mean(cuda(rows), {1}, true), kernels::mean(rows, {1}, true), {1e-6, 1e-9},
                 "mean by teams");
  const Tensor cols = rows.as_strided({2048, 64}, {1, 2048}, 0);
  expect_matches(kernels::sum(cuda(rows).as_strided({2048, 64}, {1, 2048}, 0), {0}, false),
                 kernels::sum(cols, {0}, false), {1e-6, 1e-9}, "sum by teams over columns");
  // Integer totals past int64's range wrap around as on the CPU (torch.sum's two's complement),
  // by one thread per output and by chunks: 9000 * (2^63 - 1) = -9000 mod 2^64.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const Tensor huge = from_vector<int64_t>(std::vector<int64_t>(3 * 9000, kMax), {3, 9000});
  expect_matches(kernels::sum(cuda(huge), {1}, false), kernels::sum(huge, {1}, false), {},
                 "chunked int64 sum past its range");
  EXPECT_EQ(kernels::sum(cuda(huge), {1}, false).to(Device::cpu()).to_vector<int64_t>(),
            (std::vector<int64_t>{-9000, -9000, -9000}));
  const Tensor pair = from_vector<int64_t>({kMax, 1, kMax, kMax}, {2, 2});
  EXPECT_EQ(kernels::sum(cuda(pair), {1}, false).to(Device::cpu()).to_vector<int64_t>(),
            (std::vector<int64_t>{std::numeric_limits<int64_t>::min(), -2}));
  // Long rows, whose float maxima and minima a team of lanes shares, with NaN in some rows (it
  // must win wherever a lane meets it) and a permuted view (elements not contiguous). Equal bit
  // for bit, NaN where the CPU has NaN.
  auto expect_same_or_nan = [](const Tensor& dev, const Tensor& cpu, const std::string& what) {
    ASSERT_TRUE(dev.device().is_cuda()) << what;
    EXPECT_EQ(dev.shape(), cpu.shape()) << what;
    const std::vector<double> got = dev.to(Device::cpu()).to(DType::Float64).to_vector<double>();
    const std::vector<double> want = cpu.to(DType::Float64).to_vector<double>();
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < want.size(); ++i) {
      if (std::isnan(want[i])) {
        EXPECT_TRUE(std::isnan(got[i])) << what << ": element " << i;
      } else {
        EXPECT_EQ(got[i], want[i]) << what << ": element " << i;
      }
    }
  };
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float64}) {
    Tensor longrows = random_tensor({4, 3000}, 105, DType::Float64, 5.0);
    std::vector<double> v = longrows.to_vector<double>();
    v[1 * 3000 + 2999] = std::nan("");  // the last element of row 1
    v[3 * 3000 + 6] = std::nan("");     // early in row 3
    longrows = from_vector<double>(v, {4, 3000}).to(dt);
    for (const auto& [name, x, x_dev] :
         {std::tuple<std::string, Tensor, Tensor>{"rows", longrows, cuda(longrows)},
          {"columns", longrows.as_strided({3000, 4}, {1, 3000}, 0),
           cuda(longrows).as_strided({3000, 4}, {1, 3000}, 0)}}) {
      const int64_t dim = name == "rows" ? 1 : 0;
      const std::string what = std::string(dtype_name(dt)) + " long " + name;
      expect_same_or_nan(kernels::amax(x_dev, {dim}, false), kernels::amax(x, {dim}, false),
                         "amax " + what);
      expect_same_or_nan(kernels::amin(x_dev, {dim}, true), kernels::amin(x, {dim}, true),
                         "amin " + what);
    }
  }
  // Ties and NaN: the first maximum wins, NaN beats everything.
  const Tensor ties = from_vector<float>({1, 3, 3, 2, std::nanf(""), 5}, {2, 3});
  expect_matches(kernels::argmax(cuda(ties), 1, false), kernels::argmax(ties, 1, false), {},
                 "argmax with ties and NaN");
  const Tensor g = random_tensor({2, 3, 4}, 104, DType::Float32);
  expect_matches(kernels::sum_to_shape(cuda(g), {3, 1}), kernels::sum_to_shape(g, {3, 1}),
                 {1e-6, 1e-9}, "sum_to_shape");
  expect_error([&] { kernels::sum_to_shape(cuda(g), {2, 4}); }, {"sum_to_shape", "[2, 4]"});
  expect_error([&] { kernels::amax(cuda(empty({0, 3})), {0}, false); }, {"amax", "non-zero size"});
  expect_error([&] { kernels::mean(cuda(full({2}, 1.0, DType::Int64)), {}, false); },
               {"mean", "int64"});
}

TEST(DeviceKernels, SoftmaxNormsRopeAndDropoutFollowTheCpu) {
  TestDevice device(KernelsOn::Device);
  for (DType dt : kFloatDtypes) {
    const Tolerance tol = rounding_of(dt);
    const std::string dn = dtype_name(dt);
    const Tensor x = random_tensor({3, 4, 5}, 111, dt, 3.0);
    const Tensor g = random_tensor({3, 4, 5}, 112, dt);
    for (int64_t dim : {0, 1, 2}) {
      const std::string what = dn + " dim " + std::to_string(dim);
      const Tensor y = kernels::softmax(x, dim), ly = kernels::log_softmax(x, dim);
      expect_matches(kernels::softmax(cuda(x), dim), y, tol, "softmax " + what);
      expect_matches(kernels::log_softmax(cuda(x), dim), ly, tol, "log_softmax " + what);
      expect_matches(kernels::softmax_backward(cuda(g), cuda(y), dim),
                     kernels::softmax_backward(g, y, dim), tol, "softmax_backward " + what);
      expect_matches(kernels::log_softmax_backward(cuda(g), cuda(ly), dim),
                     kernels::log_softmax_backward(g, ly, dim), tol,
                     "log_softmax_backward " + what);
    }
    const Tensor w = random_tensor({5}, 113, dt), b = random_tensor({5}, 114, dt);
    for (const Tensor& weight : {w, Tensor()}) {
      const std::string what = dn + (weight.defined() ? " with weight" : " without weight");
      const auto cpu = kernels::rms_norm(x, weight, 1e-5);
      const auto dev = kernels::rms_norm(cuda(x), weight.defined() ? cuda(weight) : weight, 1e-5);
      expect_matches(dev.out, cpu.out, tol, "rms_norm " + what);
      expect_matches(dev.rstd, cpu.rstd, tol, "rms_norm rstd " + what);
      const auto gcpu = kernels::rms_norm_backward(g, x, weight, cpu.rstd);
      const auto gdev = kernels::rms_norm_backward(
          cuda(g), cuda(x), weight.defined() ? cuda(weight) : weight, dev.rstd);
      expect_matches(gdev.grad_x, gcpu.grad_x, tol, "rms_norm grad_x " + what);
      if (weight.defined())
        expect_matches(gdev.grad_weight, gcpu.grad_weight, tol, "rms_norm grad_weight " + what);
      const auto lcpu = kernels::layer_norm(x, weight, b, 1e-5);
      const auto ldev =
          kernels::layer_norm(cuda(x), weight.defined() ? cuda(weight) : weight, cuda(b), 1e-5);
      expect_matches(ldev.out, lcpu.out, tol, "layer_norm " + what);
      const auto lgcpu = kernels::layer_norm_backward(g, x, weight, lcpu.mean, lcpu.rstd);
      const auto lgdev = kernels::layer_norm_backward(
          cuda(g), cuda(x), weight.defined() ? cuda(weight) : weight, ldev.mean, ldev.rstd);
      expect_matches(lgdev.grad_x, lgcpu.grad_x, tol, "layer_norm grad_x " + what);
      expect_matches(lgdev.grad_bias, lgcpu.grad_bias, tol, "layer_norm grad_bias " + what);
      if (weight.defined())
        expect_matches(lgdev.grad_weight, lgcpu.grad_weight, tol, "layer_norm grad_weight " + what);
    }
    // Many rows: the weight gradients add chunks of rows, then the chunks in order.
    {
      const std::string what = dn + " over 600 rows";
      const Tensor xs = random_tensor({600, 8}, 116, dt, 3.0);
      const Tensor gs = random_tensor({600, 8}, 117, dt);
      const Tensor ws = random_tensor({8}, 118, dt), bs = random_tensor({8}, 119, dt);
      const auto cpu = kernels::rms_norm(xs, ws, 1e-5);
      const auto gcpu = kernels::rms_norm_backward(gs, xs, ws, cpu.rstd);
      const auto gdev = kernels::rms_norm_backward(cuda(gs), cuda(xs), cuda(ws), cuda(cpu.rstd));
      expect_matches(gdev.grad_weight, gcpu.grad_weight, tol, "rms_norm grad_weight " + what);
      const auto lcpu = kernels::layer_norm(xs, ws, bs, 1e-5);
      const auto lgcpu = kernels::layer_norm_backward(gs, xs, ws, lcpu.mean, lcpu.rstd);
      const auto lgdev = kernels::layer_norm_backward(cuda(gs), cuda(xs), cuda(ws), cuda(lcpu.mean),
                                                      cuda(lcpu.rstd));
      expect_matches(lgdev.grad_weight, lgcpu.grad_weight, tol, "layer_norm grad_weight " + what);
      expect_matches(lgdev.grad_bias, lgcpu.grad_bias, tol, "layer_norm grad_bias " + what);
    }
    // rope on [B, T, H, D] with tables longer than T, forward and inverse.
    const auto [cos, sin] = kernels::rope_tables(7, 6, 10000.0, dt);
    const Tensor q = random_tensor({2, 5, 3, 6}, 115, dt);
    for (bool inverse : {false, true})
      expect_matches(kernels::rope(cuda(q), cuda(cos), cuda(sin), inverse),
                     kernels::rope(q, cos, sin, inverse), tol, "rope " + dn);
    Generator g1(9), g2(9);
    const auto ddev = kernels::dropout(cuda(x), 0.3, g1);
    const auto dcpu = kernels::dropout(x, 0.3, g2);
    expect_matches(ddev.mask, dcpu.mask, {}, "dropout mask " + dn);
    expect_matches(ddev.out, dcpu.out, {}, "dropout " + dn);
  }
}

TEST(DeviceKernels, CrossEntropyAndGathersFollowTheCpu) {
  TestDevice device(KernelsOn::Device);
  for (DType dt : kFloatDtypes) {
    const Tolerance tol = rounding_of(dt);
    const std::string dn = dtype_name(dt);
    const Tensor logits = random_tensor({6, 9}, 121, dt, 3.0);
    const Tensor target = from_vector<int64_t>({3, -100, 0, 8, 8, 2}, {6});
    const Tensor weight = random_tensor({9}, 125, DType::Float64, 1.0).to(dt);
    for (auto red : {kernels::Reduction::None, kernels::Reduction::Mean, kernels::Reduction::Sum}) {
      for (double eps : {0.0, 0.2}) {
        for (const Tensor& w : {Tensor(), weight}) {
          const std::string what = dn + " reduction " + std::to_string(int(red)) + " smoothing " +
                                   std::to_string(eps) + (w.defined() ? " weighted" : "");
          const Tensor wd = w.defined() ? cuda(w) : w;
          expect_matches(kernels::cross_entropy(cuda(logits), cuda(target), -100, red, eps, wd),
                         kernels::cross_entropy(logits, target, -100, red, eps, w), tol,
                         "ce " + what);
          const Tensor gl =
              red == kernels::Reduction::None ? random_tensor({6}, 122, dt) : full({}, 0.7, dt);
          expect_matches(kernels::cross_entropy_backward(cuda(gl), cuda(logits), cuda(target), -100,
                                                         red, eps, wd),
                         kernels::cross_entropy_backward(gl, logits, target, -100, red, eps, w),
                         tol, "ce backward " + what);
        }
      }
    }
    // A mean over no kept rows is NaN, as on the CPU.
    const Tensor all_ignored = full({6}, -100.0, DType::Int64);
    const Tensor none_kept =
        kernels::cross_entropy(cuda(logits), cuda(all_ignored), -100, kernels::Reduction::Mean);
    EXPECT_TRUE(std::isnan(none_kept.to(Device::cpu()).to(DType::Float64).item<double>())) << dn;
  }
  const Tensor logits = cuda(random_tensor({2, 4}, 123, DType::Float32));
  expect_error(
      [&] {
        kernels::cross_entropy(logits, cuda(from_vector<int64_t>({1, 4}, {2})));
      },
      {"cross_entropy", "target 4", "row 1", "4 classes"});
  // Gathers and scatters move bits (exact), with repeated indices added in order.
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Int64, DType::Bool}) {
    const Tensor x = random_tensor({4, 5, 3}, 124, DType::Float64, 4.0).to(dt);
    const Tensor idx = from_vector<int64_t>({2, 0, 2, 3}, {4});
    for (int64_t dim : {0, 1, 2}) {
      const Tensor id = dim == 2 ? from_vector<int64_t>({2, 0, 2}, {3}) : idx;
      expect_matches(kernels::index_select(cuda(x), dim, cuda(id)),
                     kernels::index_select(x, dim, id), {},
                     std::string("index_select ") + dtype_name(dt) + " dim " + std::to_string(dim));
    }
    // A transposed source.
    const Tensor xt = x.as_strided({5, 4, 3}, {3, 15, 1}, 0);
    expect_matches(
        kernels::index_select(cuda(x).as_strided({5, 4, 3}, {3, 15, 1}, 0), 1, cuda(idx)),
        kernels::index_select(xt, 1, idx), {},
        std::string("index_select of a view ") + dtype_name(dt));
    if (dt == DType::Bool) continue;
    const Tensor src = random_tensor({3, 4, 2}, 125, DType::Float64, 4.0).to(dt);
    expect_matches(kernels::index_add({3, 6, 2}, 1, cuda(idx), cuda(src)),
                   kernels::index_add({3, 6, 2}, 1, idx, src), {},
                   std::string("index_add ") + dtype_name(dt));
  }
  const Tensor w = random_tensor({7, 3}, 126, DType::Float32);
  const Tensor ids = from_vector<int64_t>({1, 6, 1, 0, 2, 6}, {2, 3});
  expect_matches(kernels::embedding(cuda(w), cuda(ids)), kernels::embedding(w, ids), {},
                 "embedding");
  const Tensor gy = random_tensor({2, 3, 3}, 127, DType::Float32);
  expect_matches(kernels::embedding_backward(cuda(gy), cuda(ids), 7),
                 kernels::embedding_backward(gy, ids, 7), {}, "embedding_backward");
  expect_error([&] { kernels::embedding(cuda(w), cuda(from_vector<int64_t>({7}, {1}))); },
               {"embedding", "index 7", "num_embeddings 7"});
  const Tensor parts = random_tensor({2, 3}, 128, DType::Float32);
  expect_matches(kernels::cat({cuda(parts), cuda(parts)}, 1), kernels::cat({parts, parts}, 1), {},
                 "cat");
  // PyTorch's legacy empty tensors [0] are skipped on the device too.
  const Tensor none = empty({0}, DType::Float32);
  expect_matches(kernels::cat({cuda(none), cuda(parts), cuda(none)}, 1), parts, {},
                 "cat of legacy empty tensors");
  expect_matches(kernels::stack({cuda(parts), cuda(parts)}, 0), kernels::stack({parts, parts}, 0),
                 {}, "stack");
}

TEST(DeviceKernels, AttentionForwardAndBackwardFollowTheCpu) {
  TestDevice device(KernelsOn::Device);
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16}) {
    for (bool causal : {false, true}) {
      // T = 4 queries over S = 6 keys: with causal, the first query sees 3 keys.
      const Tensor q = random_tensor({2, 3, 4, 5}, 131, dt),
                   k = random_tensor({2, 3, 6, 5}, 132, dt),
                   v = random_tensor({2, 3, 6, 7}, 133, dt);
      const std::string what = std::string(dtype_name(dt)) + (causal ? " causal" : "");
      const auto cpu = kernels::scaled_dot_product_attention(q, k, v, causal, 0.4);
      const auto dev =
          kernels::scaled_dot_product_attention(cuda(q), cuda(k), cuda(v), causal, 0.4);
      expect_matches(dev.out, cpu.out, rounding_of(dt), "attention out " + what);
      expect_matches(dev.lse, cpu.lse, rounding_of(dt), "attention lse " + what);
      const Tensor go = random_tensor({2, 3, 4, 7}, 134, dt);
      const auto gcpu = kernels::scaled_dot_product_attention_backward(go, q, k, v, cpu.out,
                                                                       cpu.lse, causal, 0.4);
      const auto gdev = kernels::scaled_dot_product_attention_backward(
          cuda(go), cuda(q), cuda(k), cuda(v), dev.out, dev.lse, causal, 0.4);
      expect_matches(gdev.dq, gcpu.dq, rounding_of(dt), "attention dq " + what);
      expect_matches(gdev.dk, gcpu.dk, rounding_of(dt), "attention dk " + what);
      expect_matches(gdev.dv, gcpu.dv, rounding_of(dt), "attention dv " + what);
    }
  }
}

TEST(DeviceKernels, VocabularyParallelStagesFollowTheCpu) {
  TestDevice device(KernelsOn::Device);
  const Tensor ids = from_vector<int64_t>({0, 5, 9, 3, 4, 7}, {2, 3});
  const auto sd = kernels::vocab_shard_ids(cuda(ids), 3, 4, 10);
  const auto sc = kernels::vocab_shard_ids(ids, 3, 4, 10);
  expect_matches(sd.local, sc.local, {}, "vocab_shard_ids local");
  expect_matches(sd.foreign, sc.foreign, {}, "vocab_shard_ids foreign");
  expect_error([&] { kernels::vocab_shard_ids(cuda(ids), 3, 4, 9); },
               {"embedding", "id 9", "vocabulary of 9"});
  for (DType dt : {DType::Float32, DType::Float64}) {
    const Tolerance tol = rounding_of(dt);
    // This rank holds columns [4, 9) of a vocabulary; rows 1 and 2 are ignored, row 3's target
    // is elsewhere, row 1 is all -inf (its shift is 0).
    Tensor x = random_tensor({4, 5}, 141, dt, 3.0);
    x.as_strided({5}, {1}, 5).fill_(-INFINITY);
    const Tensor target = from_vector<int64_t>({4, -1, -1, 1}, {4});
    const Tensor row_max = kernels::amax(x, {1}, false);
    const Tensor stats = kernels::vocab_ce_stats(x, row_max, target, 4);
    expect_matches(kernels::vocab_ce_stats(cuda(x), cuda(row_max), cuda(target), 4), stats, tol,
                   std::string("vocab_ce_stats ") + dtype_name(dt));
    const auto lc = kernels::vocab_ce_loss(stats, row_max, target, 2);
    const auto ld = kernels::vocab_ce_loss(cuda(stats), cuda(row_max), cuda(target), 2);
    expect_matches(ld.lse, lc.lse, tol, std::string("vocab_ce_loss lse ") + dtype_name(dt));
    expect_matches(ld.loss, lc.loss, tol, std::string("vocab_ce_loss ") + dtype_name(dt));
    const Tensor finite = random_tensor({4, 5}, 142, dt);
    const Tensor lse =
        kernels::vocab_ce_loss(
            kernels::vocab_ce_stats(finite, kernels::amax(finite, {1}, false), target, 4),
            kernels::amax(finite, {1}, false), target, 2)
            .lse;
    expect_matches(kernels::vocab_ce_backward(cuda(finite), cuda(lse), cuda(target), 4, 0.25),
                   kernels::vocab_ce_backward(finite, lse, target, 4, 0.25), tol,
                   std::string("vocab_ce_backward ") + dtype_name(dt));
  }
}
