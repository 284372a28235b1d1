// Core's device kernels (core/src/portable/kernels.h) against the CPU kernels: elementwise ops on
// every dtype with strided and broadcast operands, comparisons, selection, copies, in-place
// updates, Philox draws and the optimizer updates. The device is testing::TestDevice with
// KernelsOn::Device: a GPU's CUDA kernels where there is one, else the stand-in running the same
// device code on the host. What IEEE arithmetic fixes (+ - * /, comparisons, moves, the Philox
// integers) must match bit for bit; transcendentals within a tolerance per dtype, since a GPU's
// math library and the CPU's vectorised one round differently. Matrix products, reductions and
// the nn kernels: device_kernels_nn.cpp, in the same binary.
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

namespace {

// The operands a kernel sees on the device: contiguous, a transposed view, and a view that
// starts inside its storage.
struct Operands {
  std::string name;
  Tensor cpu;
  Tensor device;
};
std::vector<Operands> operand_forms(const Tensor& base) {
  // base is [4, 6]; its views keep the same storage on both sides.
  const Tensor dev = cuda(base);
  std::vector<Operands> out;
  out.push_back({"contiguous", base, dev});
  out.push_back(
      {"transposed", base.as_strided({6, 4}, {1, 6}, 0), dev.as_strided({6, 4}, {1, 6}, 0)});
  out.push_back(
      {"offset slice", base.as_strided({3, 2}, {6, 2}, 7), dev.as_strided({3, 2}, {6, 2}, 7)});
  return out;
}

Tensor values_for(UnaryOp op, DType dt, uint64_t seed) {
  Tensor x = random_tensor({4, 6}, seed, DType::Float64, 2.0);
  const bool positive = op == UnaryOp::Log || op == UnaryOp::Sqrt || op == UnaryOp::Rsqrt ||
                        op == UnaryOp::Reciprocal;
  if (positive) x = kernels::binary_scalar(BinaryOp::Add, kernels::unary(UnaryOp::Abs, x), 0.25);
  if (dt == DType::Int64 || dt == DType::Int32) x = kernels::binary_scalar(BinaryOp::Mul, x, 20.0);
  return x.to(dt);
}

const std::vector<UnaryOp> kUnaryOps = {
    UnaryOp::Neg,   UnaryOp::Exp,      UnaryOp::Log,     UnaryOp::Sqrt,
    UnaryOp::Rsqrt, UnaryOp::Tanh,     UnaryOp::Sigmoid, UnaryOp::Relu,
    UnaryOp::Gelu,  UnaryOp::GeluTanh, UnaryOp::Silu,    UnaryOp::Abs,
    UnaryOp::Sin,   UnaryOp::Cos,      UnaryOp::Square,  UnaryOp::Reciprocal};
const std::vector<DType> kArithmeticDtypes = {DType::Float32, DType::Float64, DType::BFloat16,
                                              DType::Float16, DType::Int64,   DType::Int32};

bool exact_op(UnaryOp op) {
  return op == UnaryOp::Neg || op == UnaryOp::Relu || op == UnaryOp::Abs || op == UnaryOp::Square ||
         op == UnaryOp::Sqrt;
}

}  // namespace

TEST(DeviceKernels, UnaryOpsAndTheirGradientsOnEveryDtypeAndLayout) {
  TestDevice device(KernelsOn::Device);
  for (DType dt : kArithmeticDtypes) {
    for (UnaryOp op : kUnaryOps) {
      const bool int_ok =
          op == UnaryOp::Neg || op == UnaryOp::Abs || op == UnaryOp::Square || op == UnaryOp::Relu;
      if (is_integer(dt) && !int_ok) continue;
      for (const Operands& x : operand_forms(values_for(op, dt, 11))) {
        const std::string what = std::string(dtype_name(dt)) + " unary op " +
                                 std::to_string(int(op)) + ", " + x.name + " on " + device.str();
        const Tolerance tol = exact_op(op) ? Tolerance{} : rounding_of(dt);
        expect_matches(kernels::unary(op, x.device), kernels::unary(op, x.cpu), tol, what);
        if (is_integer(dt)) continue;
        const Tensor g = random_tensor(x.cpu.shape(), 12, dt);
        expect_matches(kernels::unary_backward(op, cuda(g), x.device),
                       kernels::unary_backward(op, g, x.cpu), rounding_of(dt), what + " backward");
      }
    }
  }
}

TEST(DeviceKernels, BinaryOpsPromoteAndBroadcastAsTheCpu) {
  TestDevice device(KernelsOn::Device);
  const std::vector<BinaryOp> ops = {BinaryOp::Add,    BinaryOp::Sub, BinaryOp::Mul,
                                     BinaryOp::Div,    BinaryOp::Pow, BinaryOp::Maximum,
                                     BinaryOp::Minimum};
  for (DType da : kArithmeticDtypes) {
    for (DType db : {DType::Float32, DType::Int64, DType::BFloat16}) {
      // a [3, 1, 5] against b [4, 5]: both broadcast; b is a transposed view.
      Tensor a = random_tensor({3, 1, 5}, 21, DType::Float64, 4.0).to(da);
      Tensor bt = random_tensor({5, 4}, 22, DType::Float64, 4.0).to(db);
      if (is_integer(db)) bt = kernels::binary_scalar(BinaryOp::Add, bt, 1.0);
      const Tensor b = bt.as_strided({4, 5}, {1, 4}, 0);
      const Tensor b_dev = cuda(bt).as_strided({4, 5}, {1, 4}, 0);
      for (BinaryOp op : ops) {
        const DType dt = promote_types(da, db);
        if (is_integer(dt) && (op == BinaryOp::Div || op == BinaryOp::Pow)) continue;
        const std::string what =
            std::string(dtype_name(da)) + " op " + std::to_string(int(op)) + " " + dtype_name(db);
        const Tensor pa = op == BinaryOp::Pow ? kernels::unary(UnaryOp::Abs, a) : a;
        const Tolerance tol = op == BinaryOp::Pow ? rounding_of(dt) : Tolerance{};
        expect_matches(kernels::binary(op, cuda(pa), b_dev), kernels::binary(op, pa, b), tol, what);
        if (is_integer(da) && (op == BinaryOp::Div || op == BinaryOp::Pow)) continue;
        const Tolerance stol = op == BinaryOp::Pow ? rounding_of(da) : Tolerance{};
        expect_matches(kernels::binary_scalar(op, cuda(pa), 3.0),
                       kernels::binary_scalar(op, pa, 3.0), stol, what + " scalar");
        expect_matches(kernels::rbinary_scalar(op, 3.0, cuda(pa)),
                       kernels::rbinary_scalar(op, 3.0, pa), stol, what + " reversed scalar");
      }
    }
  }
}

TEST(DeviceKernels, ComparisonsSelectionAndFillsAreExact) {
  TestDevice device(KernelsOn::Device);
  const std::vector<CompareOp> ops = {CompareOp::Eq, CompareOp::Ne, CompareOp::Lt,
                                      CompareOp::Le, CompareOp::Gt, CompareOp::Ge};
  for (DType dt : kArithmeticDtypes) {
    // Few distinct values, so that equal elements occur.
    Tensor a = kernels::unary(UnaryOp::Relu, random_tensor({3, 1, 4}, 31, DType::Float64, 2.0))
                   .to(DType::Int64)
                   .to(dt);
    Tensor b = kernels::unary(UnaryOp::Relu, random_tensor({5, 4}, 32, DType::Float64, 2.0))
                   .to(DType::Int64)
                   .to(DType::Float32);
    for (CompareOp op : ops) {
      const std::string what = std::string(dtype_name(dt)) + " compare " + std::to_string(int(op));
      expect_matches(kernels::compare(op, cuda(a), cuda(b)), kernels::compare(op, a, b), {}, what);
      for (double s : {1.0, 2.5})
        expect_matches(kernels::compare_scalar(op, cuda(a), s), kernels::compare_scalar(op, a, s),
                       {}, what + " scalar " + std::to_string(s));
    }
    const Tensor cond = kernels::compare_scalar(CompareOp::Gt, b, 0.5);  // [5, 4]
    expect_matches(kernels::where(cuda(cond), cuda(a), cuda(b)), kernels::where(cond, a, b), {},
                   std::string("where ") + dtype_name(dt));
    const Tensor mask = kernels::compare_scalar(CompareOp::Gt, a, 0.5);  // [3, 1, 4]
    const Tensor wide = random_tensor({3, 5, 4}, 33, DType::Float64, 4.0).to(dt);
    expect_matches(kernels::masked_fill(cuda(wide), cuda(mask), -7.0),
                   kernels::masked_fill(wide, mask, -7.0), {},
                   std::string("masked_fill ") + dtype_name(dt));
    Tensor filled = cuda(wide);
    filled.as_strided({3, 2}, {20, 4}, 1).fill_(5.0);
    Tensor want = wide.clone();
    want.as_strided({3, 2}, {20, 4}, 1).fill_(5.0);
    expect_matches(filled, want, {}, std::string("fill_ of a strided view ") + dtype_name(dt));
  }
}

TEST(DeviceKernels, CopiesConvertBetweenEveryPairOfDtypes) {
  TestDevice device(KernelsOn::Device);
  const std::vector<DType> all = {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16,
                                  DType::Int64,   DType::Int32,   DType::Bool};
  const Tensor base = random_tensor({4, 6}, 41, DType::Float64, 30.0);
  for (DType from : all) {
    const Tensor src = base.to(from);
    const Tensor src_dev = cuda(src);
    for (DType to : all) {
      const std::string what = std::string(dtype_name(from)) + " -> " + dtype_name(to);
      // Through the device copy kernel: a transposed source into a contiguous destination.
      Tensor dst = empty({6, 4}, TensorOptions(to, Device::cuda(0)));
      dst.copy_(src_dev.as_strided({6, 4}, {1, 6}, 0));
      Tensor want = empty({6, 4}, to);
      want.copy_(src.as_strided({6, 4}, {1, 6}, 0));
      expect_matches(dst, want, {}, what);
    }
  }
}

// Within one dtype a device copy moves bits, as the CPU's does: 16-bit NaN payloads survive a
// strided copy.
TEST(DeviceKernels, StridedCopiesWithinADtypeMoveBits) {
  TestDevice device(KernelsOn::Device);
  for (DType dt : {DType::Float16, DType::BFloat16}) {
    const std::vector<uint16_t> bits = {0x7c01, 0x7d55, 0xfe01, 0x7f81, 0x7fc1, 0xffa5};
    Tensor base = empty({2, 3}, dt);
    std::memcpy(base.raw_data(), bits.data(), bits.size() * 2);
    const Tensor moved = cuda(base).as_strided({3, 2}, {1, 3}, 0).contiguous().to(Device::cpu());
    const auto* got = static_cast<const uint16_t*>(moved.raw_data());
    for (int64_t r = 0; r < 3; ++r)
      for (int64_t c = 0; c < 2; ++c)
        EXPECT_EQ(got[r * 2 + c], bits[size_t(c * 3 + r)]) << dtype_name(dt);
  }
}

TEST(DeviceKernels, InPlaceAddAndScaleFollowTheCpu) {
  TestDevice device(KernelsOn::Device);
  for (DType dt : kArithmeticDtypes) {
    for (DType src_dt : {DType::Float32, DType::BFloat16, DType::Int32}) {
      if (is_integer(dt) && !is_integer(src_dt)) continue;
      Tensor dst = random_tensor({3, 4}, 51, DType::Float64, 8.0).to(dt);
      const Tensor src = random_tensor({4}, 52, DType::Float64, 8.0).to(src_dt);  // broadcast
      Tensor dst_dev = cuda(dst);
      // An inexact alpha: a device that fused the multiply into the add would round once where
      // the CPU rounds twice.
      const double alpha = is_integer(dt) ? 3.0 : 0.1;
      kernels::add_(dst_dev, cuda(src), alpha);
      kernels::add_(dst, src, alpha);
      expect_matches(dst_dev, dst, {},
                     std::string("add_ ") + dtype_name(src_dt) + " into " + dtype_name(dt));
    }
    // Scaling a strided view changes only the view's elements.
    Tensor whole = random_tensor({4, 6}, 53, DType::Float64, 8.0).to(dt);
    Tensor whole_dev = cuda(whole);
    Tensor view = whole.as_strided({3, 3}, {6, 2}, 1);
    Tensor view_dev = whole_dev.as_strided({3, 3}, {6, 2}, 1);
    kernels::mul_scalar_(view_dev, 3.0);
    kernels::mul_scalar_(view, 3.0);
    expect_matches(whole_dev, whole, {}, std::string("mul_scalar_ ") + dtype_name(dt));
  }
}

TEST(DeviceKernels, PhiloxDrawsAreTheCpusForAnyWindow) {
  TestDevice device(KernelsOn::Device);
  for (DType dt : kFloatDtypes) {
    for (RandomKind kind : {RandomKind::Uniform, RandomKind::Bernoulli, RandomKind::Normal}) {
      // The window [1:4, 2:7] of a [5, 9] tensor, written into a transposed destination.
      const RandomWindow window{{5, 9}, {1, 2}};
      Tensor host_storage = empty({5, 3}, dt);
      Tensor dev_storage = empty({5, 3}, TensorOptions(dt, Device::cuda(0)));
      Tensor host_view = host_storage.as_strided({3, 5}, {1, 3}, 0);
      Tensor dev_view = dev_storage.as_strided({3, 5}, {1, 3}, 0);
      // Uniform's bounds make (b - a) * u inexact, so a fused multiply-add would show.
      const double a = kind == RandomKind::Bernoulli ? 0.3
                       : kind == RandomKind::Uniform ? -0.3
                                                     : -1.0;
      const double b = kind == RandomKind::Uniform ? 2.1 : 2.0;
      philox_fill(dev_view, kind, a, b, 1234, 77, window);
      philox_fill(host_view, kind, a, b, 1234, 77, window);
      // Uniform and Bernoulli are integer arithmetic on the Philox words; Box-Muller calls log,
      // sqrt and sincospi, which a GPU rounds its own way.
      const Tolerance tol = kind == RandomKind::Normal ? rounding_of(dt) : Tolerance{};
      expect_matches(dev_storage, host_storage, tol,
                     std::string(dtype_name(dt)) + " kind " + std::to_string(int(kind)));
    }
  }
  Generator g1(5), g2(5);
  Tensor on_device = empty({7, 3}, TensorOptions(DType::Float32, Device::cuda(0)));
  Tensor on_cpu = empty({7, 3}, DType::Float32);
  uniform_(on_device, -2.0, 2.0, g1);
  uniform_(on_cpu, -2.0, 2.0, g2);
  expect_matches(on_device, on_cpu, {}, "uniform_");
  EXPECT_EQ(g1.offset(), g2.offset());
}

TEST(DeviceKernels, OptimizerUpdatesFollowTheCpu) {
  TestDevice device(KernelsOn::Device);
  for (DType dt : {DType::Float32, DType::Float64}) {
    Tensor w = random_tensor({5, 7}, 61, dt), m = random_tensor({5, 7}, 62, dt, 0.1),
           v = kernels::unary(UnaryOp::Square, random_tensor({5, 7}, 63, dt, 0.1)),
           g = random_tensor({5, 7}, 64, dt);
    Tensor wd = cuda(w), md = cuda(m), vd = cuda(v);
    const kernels::AdamWStep step{.decay = 0.999,
                                  .beta1 = 0.9,
                                  .beta2 = 0.95,
                                  .step_size = 1e-2,
                                  .bias_correction2_sqrt = 0.3,
                                  .eps = 1e-8};
    Tensor no_max;
    kernels::adamw_update_(wd, md, vd, no_max, cuda(g), step);
    kernels::adamw_update_(w, m, v, no_max, g, step);
    // A GPU may fuse a multiply and an add into one rounding.
    const Tolerance tol = dt == DType::Float32 ? Tolerance{1e-6, 1e-7} : Tolerance{1e-14, 1e-15};
    expect_matches(wd, w, tol, std::string("adamw param ") + dtype_name(dt));
    expect_matches(md, m, tol, std::string("adamw exp_avg ") + dtype_name(dt));
    expect_matches(vd, v, tol, std::string("adamw exp_avg_sq ") + dtype_name(dt));
    for (bool first : {true, false}) {
      Tensor buf = random_tensor({5, 7}, 65, dt);
      Tensor bufd = cuda(buf);
      const kernels::SgdStep sgd{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .first = first};
      kernels::sgd_update_(wd, bufd, cuda(g), sgd);
      kernels::sgd_update_(w, buf, g, sgd);
      expect_matches(wd, w, tol, std::string("sgd param ") + dtype_name(dt));
      expect_matches(bufd, buf, tol, std::string("sgd momentum ") + dtype_name(dt));
    }
    // Adam's L2 term, amsgrad's maximum and maximize; SGD's dampening, Nesterov and maximize.
    Tensor vmax = kernels::unary(UnaryOp::Square, random_tensor({5, 7}, 66, dt, 0.1));
    Tensor vmaxd = cuda(vmax);
    const kernels::AdamWStep adam{.beta1 = 0.9,
                                  .beta2 = 0.95,
                                  .step_size = 1e-2,
                                  .bias_correction2_sqrt = 0.3,
                                  .l2_weight_decay = 0.1,
                                  .maximize = true};
    kernels::adamw_update_(wd, md, vd, vmaxd, cuda(g), adam);
    kernels::adamw_update_(w, m, v, vmax, g, adam);
    expect_matches(wd, w, tol, std::string("adam amsgrad param ") + dtype_name(dt));
    expect_matches(vmaxd, vmax, tol, std::string("adam max_exp_avg_sq ") + dtype_name(dt));
    Tensor buf = random_tensor({5, 7}, 67, dt);
    Tensor bufd = cuda(buf);
    for (const kernels::SgdStep sgd :
         {kernels::SgdStep{.lr = 0.1, .momentum = 0.9, .dampening = 0.2, .maximize = true},
          kernels::SgdStep{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true}}) {
      kernels::sgd_update_(wd, bufd, cuda(g), sgd);
      kernels::sgd_update_(w, buf, g, sgd);
      expect_matches(wd, w, tol, std::string("sgd variant param ") + dtype_name(dt));
      expect_matches(bufd, buf, tol, std::string("sgd variant momentum ") + dtype_name(dt));
    }
    Tensor none;
    kernels::sgd_update_(wd, none, cuda(g), {.lr = 0.1});
    kernels::sgd_update_(w, none, g, {.lr = 0.1});
    expect_matches(wd, w, tol, std::string("sgd without momentum ") + dtype_name(dt));
  }
}

// The pack and unpack of a gather of scattered pieces: every run in one launch, bit for bit.
TEST(DeviceKernels, CopyRunsMoveEveryRunInOneLaunch) {
  TestDevice device(KernelsOn::Device);
  const std::vector<kernels::CopyRun> runs = {{0, 10, 5}, {20, 0, 7}, {5, 30, 0}, {33, 40, 7}};
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Bool}) {
    const Tensor src = random_tensor({40}, 43, DType::Float64, 10.0).to(dt);
    Tensor want = full({50}, 1.0, dt);
    kernels::copy_runs_(want, src, runs);
    Tensor dst = cuda(full({50}, 1.0, dt));
    const Tensor src_dev = cuda(src);
    const int64_t launches = tessera::detail::emulated_launches();
    kernels::copy_runs_(dst, src_dev, runs);
    if (device.is_stand_in()) {
      EXPECT_EQ(tessera::detail::emulated_launches(), launches + 1);
    }
    expect_matches(dst, want, {}, dtype_name(dt));
  }
  Tensor dst = cuda(zeros({8}));
  expect_error(
      [&] {
        kernels::copy_runs_(dst, cuda(zeros({8})), {{0, 2, 3}, {4, 4, 2}});
      },
      {"copy_runs_", "overlap"});
}

TEST(DeviceKernels, RefuseWhatTheCpuRefusesNamingTheOp) {
  TestDevice device(KernelsOn::Device);
  const Tensor i = cuda(full({3}, 2.0, DType::Int64));
  const Tensor f = cuda(full({3}, 2.0));
  expect_error([&] { kernels::unary(UnaryOp::Exp, i); }, {"exp", "int64", "[3]"});
  expect_error([&] { kernels::binary(BinaryOp::Div, i, i); }, {"div", "int64"});
  expect_error([&] { kernels::binary_scalar(BinaryOp::Add, i, 2.5); }, {"add", "2.5", "int64"});
  Tensor idst = cuda(full({3}, 1.0, DType::Int32));
  expect_error([&] { kernels::add_(idst, f, 1.0); }, {"add_", "float32", "int32", "fraction"});
  expect_error([&] { kernels::where(f, f, f); }, {"where", "condition", "bool"});
  expect_error([&] { kernels::masked_fill(f, f, 0.0); }, {"masked_fill", "mask", "bool"});
  Tensor expanded = f.as_strided({2, 3}, {0, 1}, 0);
  expect_error([&] { kernels::mul_scalar_(expanded, 2.0); }, {"mul_scalar_", "expanded view"});
  // Nine dims, each with a smaller stride than the next, so no two merge: more than a device
  // kernel takes.
  const Tensor big = cuda(full({512}, 1.0));
  const Tensor nine =
      big.as_strided({2, 2, 2, 2, 2, 2, 2, 2, 2}, {1, 2, 4, 8, 16, 32, 64, 128, 256}, 0);
  expect_error([&] { kernels::unary(UnaryOp::Neg, nine); },
               {"neg", "[2, 2, 2, 2, 2, 2, 2, 2, 2]", "8"});
}

// The device's masked_fill checks its value as the CPU's does: a finite value beyond a floating
// dtype's largest would have become inf, an integer dtype's out-of-range or fractional one
// wrapped or truncated. Infinities and NaN are kept; the mask's shape is checked first.
TEST(DeviceKernels, MaskedFillRefusesAValueTheDtypeCannotHold) {
  TestDevice device(KernelsOn::Device);
  const Tensor mask = from_vector<bool>({true, false, true});
  const std::vector<std::tuple<DType, double, double>> cases = {
      {DType::Float16, 1e5, 65504.0}, {DType::BFloat16, -1e39, -3.3895313892515355e38},
      {DType::Float32, 1e39, 3e38},   {DType::Int32, 3e9, -2147483648.0},
      {DType::Int64, 0.5, -9.0},
  };
  for (const auto& [dt, bad, largest] : cases) {
    const std::string name = dtype_name(dt);
    const Tensor x = full({3}, 2.0, dt);
    expect_error([&] { kernels::masked_fill(cuda(x), cuda(mask), bad); }, {"masked_fill", name});
    EXPECT_THROW(kernels::masked_fill(x, mask, bad), Error) << name;
    expect_matches(kernels::masked_fill(cuda(x), cuda(mask), largest),
                   kernels::masked_fill(x, mask, largest), {}, "masked_fill at the edge " + name);
    // Every shard refuses alike, an empty one too.
    expect_error(
        [&] { kernels::masked_fill(cuda(zeros({0}, dt)), cuda(zeros({0}, DType::Bool)), bad); },
        {"masked_fill", name});
  }
  for (DType dt : kFloatDtypes) {
    const Tensor x = full({3}, 2.0, dt);
    for (double v : {INFINITY, -INFINITY, NAN}) {
      const Tensor got = kernels::masked_fill(cuda(x), cuda(mask), v).to(Device::cpu());
      const std::vector<double> vals = got.to(DType::Float64).to_vector<double>();
      EXPECT_EQ(vals[1], 2.0) << dtype_name(dt);
      for (double g : {vals[0], vals[2]}) {
        if (std::isnan(v))
          EXPECT_TRUE(std::isnan(g)) << dtype_name(dt);
        else
          EXPECT_EQ(g, v) << dtype_name(dt);
      }
    }
  }
  expect_error(
      [&] {
        kernels::masked_fill(cuda(full({3}, 2.0, DType::Float16)), cuda(zeros({2}, DType::Bool)),
                             1e5);
      },
      {"masked_fill", "[2]", "[3]"});
}

// Writes whose source shares the destination's memory read the source as it was before the
// call.
TEST(DeviceKernels, OverlappingWritesAsTheCpu) {
  TestDevice device(KernelsOn::Device);
  const Tensor host = kernels::view(arange(0, 9, 1, DType::Float32), {3, 3});
  Tensor m = cuda(host);
  m.copy_(kernels::transpose(m, 0, 1));
  expect_matches(m, kernels::transpose(host, 0, 1), {}, "copy_ of the transpose");
  Tensor a = cuda(host);
  kernels::add_(a, kernels::transpose(a, 0, 1));
  expect_matches(a, kernels::binary(BinaryOp::Add, host, kernels::transpose(host, 0, 1)), {},
                 "add_ of the transpose");
  Tensor r = cuda(host);
  kernels::add_(r, kernels::select(r, 0, 0));
  expect_matches(r, kernels::binary(BinaryOp::Add, host, kernels::select(host, 0, 0)), {},
                 "add_ of a row");
  Tensor expanded = cuda(zeros({1})).as_strided({3}, {0}, 0);
  expect_error([&] { expanded.copy_(cuda(ones({3}))); }, {"copy_", "more than one element"});
}

TEST(DeviceKernels, ZeroDimOperandPromotesAsTheCpu) {
  TestDevice device(KernelsOn::Device);
  const Tensor f = full({3}, 0.1), s = scalar_tensor(0.1, DType::Float64);
  expect_matches(kernels::binary(BinaryOp::Mul, cuda(f), cuda(s)),
                 kernels::binary(BinaryOp::Mul, f, s), {}, "float32 [3] * float64 []");
  expect_matches(kernels::compare(CompareOp::Eq, cuda(f), cuda(s)),
                 kernels::compare(CompareOp::Eq, f, s), {}, "float32 [3] == float64 []");
  expect_matches(kernels::where(cuda(full({3}, 1.0, DType::Bool)), cuda(f), cuda(s)),
                 kernels::where(full({3}, 1.0, DType::Bool), f, s), {}, "where");
  EXPECT_EQ(kernels::binary(BinaryOp::Mul, cuda(f), cuda(s)).dtype(), DType::Float32);
}

TEST(DeviceKernels, EveryKernelOfTheListHasDeviceCode) {
  EXPECT_EQ(tessera::detail::kernels_without_device_code(), std::vector<std::string>{});
}

TEST(DeviceKernels, RunOnTheDeviceNotOnHostCopies) {
  TestDevice device(KernelsOn::Device);
  const Tensor a = cuda(random_tensor({64}, 71, DType::Float32));
  const int64_t fallbacks = kernels::host_fallback_calls();
  const int64_t launches = tessera::detail::emulated_launches();
  const Tensor b = kernels::binary(BinaryOp::Mul, kernels::unary(UnaryOp::Exp, a), a);
  EXPECT_TRUE(b.device().is_cuda());
  EXPECT_EQ(kernels::host_fallback_calls(), fallbacks) << device.str();
  if (device.is_stand_in()) {
    EXPECT_EQ(tessera::detail::emulated_launches(), launches + 2);
  }
}
