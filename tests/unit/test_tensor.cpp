#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/stand_in_device.h"

using namespace tessera;
using tessera::testing::error_of;
using tessera::testing::expect_error;

TEST(Tensor, ViewsShareStorage) {
  Tensor a = arange(0, 12, 1, DType::Float32);
  Tensor m = kernels::view(a, {3, 4});
  Tensor t = kernels::transpose(m, 0, 1);
  EXPECT_TRUE(t.storage().is_same(a.storage()));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.shape(), (Shape{4, 3}));
  EXPECT_EQ(t.contiguous().to_vector<float>(),
            (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
}

TEST(Tensor, NarrowSliceSelectPermute) {
  Tensor a = kernels::view(arange(0, 24, 1, DType::Float64), {2, 3, 4});
  Tensor n = kernels::narrow(a, 2, 1, 2);
  EXPECT_EQ(n.shape(), (Shape{2, 3, 2}));
  EXPECT_EQ(n.storage_offset(), 1);
  EXPECT_EQ(n.contiguous().to_vector<double>(),
            (std::vector<double>{1, 2, 5, 6, 9, 10, 13, 14, 17, 18, 21, 22}));
  Tensor s = kernels::slice(a, 2, 0, 4, 2);
  EXPECT_EQ(s.contiguous().to_vector<double>(),
            (std::vector<double>{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22}));
  Tensor sel = kernels::select(a, 1, -1);
  EXPECT_EQ(sel.contiguous().to_vector<double>(),
            (std::vector<double>{8, 9, 10, 11, 20, 21, 22, 23}));
  Tensor p = kernels::permute(a, {2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.contiguous().to_vector<double>()[3], 12.0);  // p[0,1,0] = a[1,0,0]
  Tensor u = kernels::unsqueeze(a, 1);
  EXPECT_EQ(u.shape(), (Shape{2, 1, 3, 4}));
  EXPECT_EQ(kernels::squeeze(u).shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(kernels::flatten(a, 1).shape(), (Shape{2, 12}));
}

// PyTorch's rule: a tensor with no elements is contiguous, whatever strides its view left it.
TEST(Tensor, AnEmptyTensorIsContiguousWhateverItsStrides) {
  const Tensor t = kernels::transpose(zeros({4, 3}), 0, 1);  // [3, 4], strides [1, 3]
  const Tensor e = kernels::narrow(t, 0, 0, 0);
  ASSERT_EQ(e.shape(), (Shape{0, 4}));
  ASSERT_EQ(e.strides(), (Shape{1, 3}));
  EXPECT_TRUE(e.is_contiguous());
  EXPECT_TRUE(e.contiguous().is_same(e));
  EXPECT_FALSE(kernels::narrow(t, 0, 0, 1).is_contiguous());  // [1, 4] with strides [1, 3]
}

TEST(Tensor, ExpandHasZeroStride) {
  Tensor a = from_vector<float>({1, 2, 3}, {3, 1});
  Tensor e = kernels::expand(a, {2, 3, 4});
  EXPECT_EQ(e.strides(), (Shape{0, 1, 0}));
  std::vector<float> v = e.contiguous().to_vector<float>();
  EXPECT_EQ(v.size(), 24u);
  EXPECT_EQ(v[4], 2.0f);
  EXPECT_NE(error_of([&] { kernels::expand(a, {2, 2}); }).find("cannot expand"), std::string::npos);
}

TEST(Tensor, ViewNeedsCompatibleStridesReshapeCopies) {
  Tensor a = kernels::view(arange(0, 6, 1, DType::Float32), {2, 3});
  Tensor t = kernels::transpose(a, 0, 1);
  EXPECT_NE(error_of([&] { kernels::view(t, {6}); }).find("use reshape"), std::string::npos);
  Tensor r = kernels::reshape(t, {6});
  EXPECT_FALSE(r.storage().is_same(a.storage()));
  EXPECT_EQ(r.to_vector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  // A view over a split of a contiguous dim stays a view.
  Tensor v = kernels::view(a, {3, 2});
  EXPECT_TRUE(v.storage().is_same(a.storage()));
  EXPECT_EQ(kernels::view(a, {-1}).shape(), (Shape{6}));
}

TEST(Tensor, ChunkFollowsTorchSemantics) {
  Tensor a = arange(5, DType::Float32);
  auto pieces = kernels::chunk(a, 4, 0);
  ASSERT_EQ(pieces.size(), 3u);  // ceil(5/4) = 2 -> 2, 2, 1
  EXPECT_EQ(pieces[0].numel(), 2);
  EXPECT_EQ(pieces[2].numel(), 1);
  auto s = kernels::split(a, {1, 0, 4}, 0);
  EXPECT_EQ(s[1].numel(), 0);
  EXPECT_EQ(s[2].to_vector<float>(), (std::vector<float>{1, 2, 3, 4}));
}

TEST(Tensor, ChunkOfAnEmptyDimGivesEveryPiece) {
  auto pieces = kernels::chunk(empty({0}), 3, 0);
  ASSERT_EQ(pieces.size(), 3u);
  for (const Tensor& p : pieces)
    EXPECT_EQ(p.shape(), (Shape{0}));
  Tensor x = empty({2, 0});
  x.set_requires_grad(true);
  auto grads = tessera::chunk(x, 2, 1);
  ASSERT_EQ(grads.size(), 2u);
  EXPECT_EQ(grads[1].shape(), (Shape{2, 0}));
}

// A 0-dim tensor takes dim 0 or -1 where PyTorch wraps a scalar's dim (squeeze, transpose,
// unsqueeze), and is refused by the ops that need a dim to index.
TEST(Tensor, ZeroDimViews) {
  Tensor s = scalar_tensor(5.0);
  for (int64_t d : {0, -1}) {
    Tensor q = kernels::squeeze(s, d);
    EXPECT_EQ(q.dim(), 0);
    EXPECT_TRUE(q.storage().is_same(s.storage()));
    EXPECT_EQ(kernels::transpose(s, d, -1 - d).dim(), 0);
    EXPECT_EQ(kernels::unsqueeze(s, d).shape(), (Shape{1}));
  }
  EXPECT_EQ(kernels::transpose(s, 0, 0).item<float>(), 5.0f);
  expect_error([&] { kernels::select(s, 0, 0); }, {"select()", "0-dim"});
  expect_error([&] { kernels::narrow(s, 0, 0, 1); }, {"narrow()", "0-dim"});
  expect_error([&] { kernels::slice(s, 0, 0, 1); }, {"slice()", "0-dim"});
  expect_error([&] { kernels::chunk(s, 2, 0); }, {"chunk", "1-dimensional"});
  expect_error([&] { kernels::split(s, {1}, 0); }, {"split", "1-dimensional"});
  expect_error([&] { s.size(0); }, {"size(0)", "no dimensions"});
  expect_error([&] { s.stride(-1); }, {"stride(-1)", "no dimensions"});
  expect_error([&] { kernels::squeeze(s, 1); }, {"squeeze", "dim 1"});

  // The differentiable views agree, and the gradient flows through them.
  Tensor x = scalar_tensor(3.0, DType::Float64);
  x.set_requires_grad(true);
  Tensor y = tessera::transpose(tessera::squeeze(x, 0), 0, -1);
  EXPECT_EQ(y.dim(), 0);
  EXPECT_EQ(tessera::unsqueeze(x, -1).shape(), (Shape{1}));
  backward(tessera::mul(y, 2.0));
  EXPECT_EQ(x.grad().item<double>(), 2.0);
  expect_error([&] { tessera::select(x, 0, 0); }, {"select()", "0-dim"});
  expect_error([&] { tessera::chunk(x, 2, 0); }, {"chunk", "1-dimensional"});
  expect_error([&] { tessera::split(x, {1}, 0); }, {"split", "1-dimensional"});
}

// computeStride: the one element of a 0-dim tensor is viewed as [1, ...] with any strides.
TEST(Tensor, ViewOfAZeroDimTensor) {
  Tensor s = scalar_tensor(7.0);
  for (const Shape& shape : {Shape{1}, Shape{1, 1}, Shape{-1}, Shape{}}) {
    Tensor v = kernels::view(s, shape);
    EXPECT_TRUE(v.storage().is_same(s.storage())) << shape_str(shape);
    EXPECT_EQ(v.numel(), 1);
    EXPECT_EQ(v.contiguous().to_vector<float>(), std::vector<float>{7.0f});
  }
  EXPECT_TRUE(kernels::reshape(s, {1, 1, 1}).storage().is_same(s.storage()));
  EXPECT_TRUE(kernels::flatten(s).storage().is_same(s.storage()));
  EXPECT_EQ(kernels::flatten(s).shape(), (Shape{1}));
  expect_error([&] { kernels::view(s, {2}); }, {"view", "[2]", "1 elements"});
  Tensor x = scalar_tensor(2.0, DType::Float64);
  x.set_requires_grad(true);
  Tensor y = tessera::view(x, {1, 1});
  EXPECT_TRUE(y.storage().is_same(x.storage()));
  backward(tessera::sum(tessera::mul(y, y)));
  EXPECT_EQ(x.grad().shape(), Shape{});
  EXPECT_EQ(x.grad().item<double>(), 4.0);
}

// As PyTorch's `x.grad = g` ("assigned grad has data of a different type / located on a different
// device"): a float64 gradient set on a float32 leaf was kept, backward then accumulated into it
// in float64 and an optimizer met a gradient of another dtype than its parameter.
TEST(Tensor, SetGradRefusesAnotherDtypeOrDeviceKeepingTheOldGradient) {
  Tensor x = full({2}, 1.0);
  x.set_requires_grad(true);
  x.set_grad(full({2}, 0.5));
  tessera::testing::expect_error([&] { x.set_grad(full({2}, 1.0, DType::Float64)); },
                                 {"set_grad", "float64", "float32"});
  tessera::testing::expect_error([&] { x.set_grad(full({3}, 1.0)); }, {"set_grad", "[3]", "[2]"});
  {
    tessera::testing::TestDevice device(tessera::testing::KernelsOn::Device);
    tessera::testing::expect_error([&] { x.set_grad(full({2}, 1.0).to(Device::cuda(0))); },
                                   {"set_grad", "cuda:0", "cpu"});
  }
  EXPECT_EQ(x.grad().dtype(), DType::Float32);
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{0.5f, 0.5f}));
  backward(tessera::sum(tessera::mul(x, 2.0)));
  EXPECT_EQ(x.grad().dtype(), DType::Float32);
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2.5f, 2.5f}));
  x.set_grad(Tensor());
  EXPECT_FALSE(x.grad().defined());
}

TEST(Tensor, DtypeConversionRoundsToNearestEven) {
  // 1 + 2^-8 is halfway between two bfloat16 values: ties go to the even mantissa (1.0).
  Tensor f = from_vector<float>({1.0f + 1.0f / 256, 1.0f + 3.0f / 256, 65520.0f, 1e-8f, -2.5f});
  Tensor bf = f.to(DType::BFloat16);
  std::vector<float> back = bf.to_vector<float>();
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], 1.0f + 4.0f / 256);
  EXPECT_EQ(back[4], -2.5f);
  Tensor h = f.to(DType::Float16);
  std::vector<float> hb = h.to(DType::Float32).to_vector<float>();
  EXPECT_EQ(hb[0], 1.0f + 1.0f / 256);  // exact in float16's 10-bit mantissa
  EXPECT_TRUE(std::isinf(hb[2]));       // 65520 rounds up past fp16's max 65504
  EXPECT_NEAR(hb[3], 0.0f, 1e-7f);
  EXPECT_EQ(hb[4], -2.5f);
  EXPECT_EQ(Float16::to_float(Float16::from_float(65504.0f)), 65504.0f);
  EXPECT_EQ(Float16::to_float(Float16::from_float(5.9604644775390625e-8f)),
            5.9604644775390625e-8f);  // smallest subnormal
  Tensor i = from_vector<float>({1.7f, -2.2f}).to(DType::Int64);
  EXPECT_EQ(i.to_vector<int64_t>(), (std::vector<int64_t>{1, -2}));
}

TEST(Tensor, Float16RoundTripIsExactForAllHalfValues) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    if ((bits & 0x7c00) == 0x7c00 && (bits & 0x3ff)) continue;  // NaN payloads
    float f = Float16::to_float(uint16_t(bits));
    ASSERT_EQ(Float16::from_float(f), uint16_t(bits)) << bits;
  }
}

TEST(Tensor, CopyAcrossStridesAndDtypes) {
  Tensor src = kernels::transpose(kernels::view(arange(0, 6, 1, DType::Int32), {2, 3}), 0, 1);
  Tensor dst = zeros({3, 2}, DType::Float64);
  dst.copy_(src);
  EXPECT_EQ(dst.to_vector<double>(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  EXPECT_NE(error_of([&] { dst.copy_(zeros({2, 3})); }).find("[2, 3]"), std::string::npos);
  Tensor window = kernels::narrow(zeros({4, 4}), 1, 1, 2);
  window.fill_(7);
  EXPECT_EQ(window.contiguous().to_vector<float>(), std::vector<float>(8, 7.0f));
}

// A source sharing memory with the destination is read as it was before the copy, as if staged
// through a temporary (the loops would otherwise read elements they had already overwritten).
TEST(Tensor, CopyFromAnOverlappingViewOfItself) {
  Tensor m = kernels::view(arange(0, 9, 1, DType::Float32), {3, 3});
  m.copy_(kernels::transpose(m, 0, 1));
  EXPECT_EQ(m.to_vector<float>(), (std::vector<float>{0, 3, 6, 1, 4, 7, 2, 5, 8}));

  // Shifted by one element either way (contiguous: the memcpy path) and by one of a stride-2
  // walk (the strided loop).
  Tensor a = arange(0, 6, 1, DType::Int64);
  kernels::narrow(a, 0, 1, 5).copy_(kernels::narrow(a, 0, 0, 5));
  EXPECT_EQ(a.to_vector<int64_t>(), (std::vector<int64_t>{0, 0, 1, 2, 3, 4}));
  kernels::narrow(a, 0, 0, 5).copy_(kernels::narrow(a, 0, 1, 5));
  EXPECT_EQ(a.to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3, 4, 4}));
  Tensor b = arange(0, 10, 1, DType::Float64);
  kernels::slice(b, 0, 2, 10, 2).copy_(kernels::slice(b, 0, 0, 8, 2));
  EXPECT_EQ(b.to_vector<double>(), (std::vector<double>{0, 1, 0, 3, 2, 5, 4, 7, 6, 9}));

  // The same view is left as it is, and counts as a write.
  Tensor t = kernels::transpose(kernels::view(arange(0, 6, 1, DType::Float32), {2, 3}), 0, 1);
  const uint32_t version = t.version();
  t.copy_(t);
  EXPECT_EQ(t.contiguous().to_vector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(t.version(), version + 1);
}

// PyTorch: "more than one element of the written-to tensor refers to a single memory location".
// In grad mode an in-place copy_ or fill_ into a tensor that requires grad is refused (no
// in-place op is recorded, so the gradient would ignore it: y = 2x, y *= 3 gave dx = 2); under
// NoGradGuard it writes, as optimizers do.
TEST(Tensor, InPlaceWritesToTensorsThatRequireGradNeedNoGrad) {
  Tensor x = from_vector<float>({1, 2}).set_requires_grad(true);
  Tensor y = tessera::mul(x, 2.0);
  expect_error([&] { y.fill_(3.0); }, {"fill_: an in-place write to", "requires grad"});
  expect_error([&] { x.copy_(zeros({2})); }, {"copy_: an in-place write to", "NoGradGuard"});
  {
    NoGradGuard no_grad;
    x.copy_(from_vector<float>({5, 6}));
  }
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{5, 6}));
  Tensor plain = zeros({2});
  plain.fill_(1.0);  // no grad required: written
  EXPECT_EQ(plain.to_vector<float>(), (std::vector<float>{1, 1}));
}

// A view whose extent overflows the index arithmetic is refused, not wrapped into a small one
// that would pass the storage check.
TEST(Tensor, AViewWhoseExtentOverflowsIsRefused) {
  Tensor base = zeros({4});
  tessera::testing::expect_error(
      [&] { base.as_strided({5}, {int64_t(1) << 62}, 0); },  // 4 * 2^62 wraps to 0
      {"reaches past any storage"});
}

TEST(Tensor, CopyIntoSelfOverlappingDestinationIsAnError) {
  Tensor one = zeros({1});
  Tensor expanded = kernels::expand(one, {3});
  expect_error(
      [&] {
        expanded.copy_(from_vector<float>({1, 2, 3}));
      },
      {"copy_", "[3]", "strides [0]", "more than one element"});
  EXPECT_EQ(one.item<float>(), 0.0f);
  // Overlap without a zero stride: elements {0, 1, 1, 2}.
  Tensor base = zeros({4});
  expect_error(
      [&] {
        base.as_strided({2, 2}, {1, 1}, 0).copy_(ones({2, 2}));
      },
      {"copy_", "[2, 2]", "more than one element"});
  // Strides that do not nest but never meet (offsets 0, 3, 2, 5, 4, 7) are written.
  Tensor spread = zeros({8});
  spread.as_strided({3, 2}, {2, 3}, 0).copy_(from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2}));
  EXPECT_EQ(spread.to_vector<float>(), (std::vector<float>{1, 0, 3, 2, 5, 4, 0, 6}));
  // An expanded source is fine: only the destination is written.
  Tensor dst = zeros({2, 3});
  dst.copy_(kernels::expand(from_vector<float>({1, 2, 3}), {2, 3}));
  EXPECT_EQ(dst.to_vector<float>(), (std::vector<float>{1, 2, 3, 1, 2, 3}));
}

TEST(Tensor, FillingAnIntegerTensorWithAValueItCannotHoldIsAnError) {
  // As torch's fill_: the value is truncated, but NaN or one out of range is refused (the
  // conversion is undefined: an int64 filled with 2^63 held INT64_MIN).
  const double two63 = 9223372036854775808.0;
  Tensor a = zeros({2}, DType::Int64);
  EXPECT_THROW(a.fill_(two63), Error);
  EXPECT_THROW(a.fill_(std::nan("")), Error);
  EXPECT_EQ(a.to_vector<int64_t>(), (std::vector<int64_t>{0, 0}));
  a.fill_(-two63);
  EXPECT_EQ(a.to_vector<int64_t>()[0], std::numeric_limits<int64_t>::min());
  a.fill_(-2.7);
  EXPECT_EQ(a.to_vector<int64_t>(), (std::vector<int64_t>{-2, -2}));
  EXPECT_THROW(full({3}, 3e9, DType::Int32), Error);
  EXPECT_EQ(full({1}, 2147483647.9, DType::Int32).item<int32_t>(), 2147483647);
  // An empty shard refuses it as well, so every rank of a sharded fill agrees.
  Tensor none = zeros({0}, DType::Int32);
  EXPECT_THROW(none.fill_(-3e9), Error);
}

TEST(Tensor, FillingAFloatTensorWithAFiniteValueBeyondItsRangeIsAnError) {
  // As torch's fill_, full and masked_fill ("value cannot be converted to type at::Half without
  // overflow"): 1e6 in float16 became inf silently. Infinities and NaN themselves are kept.
  Tensor h = zeros({2}, DType::Float16);
  tessera::testing::expect_error([&] { h.fill_(1e6); }, {"fill_", "1e+06", "float16", "overflow"});
  EXPECT_EQ(h.to(DType::Float32).to_vector<float>(), (std::vector<float>{0, 0}));
  EXPECT_THROW(h.fill_(-65520.0), Error);
  h.fill_(65504.0);
  EXPECT_EQ(h.to(DType::Float32).to_vector<float>()[0], 65504.0f);
  h.fill_(-std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isinf(h.to(DType::Float32).to_vector<float>()[0]));
  h.fill_(std::nan(""));
  EXPECT_TRUE(std::isnan(h.to(DType::Float32).to_vector<float>()[0]));
  EXPECT_THROW(full({2}, 1e39, DType::BFloat16), Error);
  EXPECT_THROW(full({2}, -1e39, DType::Float32), Error);
  EXPECT_EQ(full({1}, 1e38, DType::Float32).item<float>(), 1e38f);
  EXPECT_EQ(full({1}, 1e300, DType::Float64).item<double>(), 1e300);
  Tensor none = zeros({0}, DType::Float16);  // every shard agrees, the empty ones too
  EXPECT_THROW(none.fill_(7e4), Error);
  const Tensor mask = from_vector<bool>({true, false});
  tessera::testing::expect_error([&] { kernels::masked_fill(h, mask, 1e5); },
                                 {"masked_fill", "float16", "overflow"});
  EXPECT_TRUE(std::isinf(kernels::masked_fill(h, mask, std::numeric_limits<double>::infinity())
                             .to_vector<float>()[0]));
}

TEST(Tensor, AllocatorCountsEveryByte) {
  reset_peak_memory();
  int64_t before = memory_stats().current_bytes;
  {
    Tensor a = empty({1024, 256});  // 1 MiB
    EXPECT_EQ(memory_stats().current_bytes - before, 1024 * 256 * 4);
    Tensor v = kernels::narrow(a, 0, 0, 10);  // views allocate nothing
    EXPECT_EQ(memory_stats().current_bytes - before, 1024 * 256 * 4);
  }
  EXPECT_EQ(memory_stats().current_bytes, before);
  EXPECT_GE(memory_stats().peak_bytes - before, 1024 * 256 * 4);
  reset_peak_memory();
  EXPECT_EQ(memory_stats().peak_bytes, memory_stats().current_bytes);
}

TEST(Tensor, FactoriesAndItem) {
  EXPECT_EQ(arange(2, 8, 2, DType::Int64).to_vector<int64_t>(), (std::vector<int64_t>{2, 4, 6}));
  EXPECT_EQ(arange(3, 0, -1.5, DType::Float64).to_vector<double>(), (std::vector<double>{3, 1.5}));
  EXPECT_EQ(arange(4, 4, 1).numel(), 0);
  // As torch.arange: a step away from the end, or a bound that is not finite, is an error (an
  // empty tensor before; the infinite bound's length conversion was undefined).
  EXPECT_THROW(arange(5, 0, 1), Error);
  EXPECT_THROW(arange(-3), Error);
  EXPECT_THROW(arange(0, std::numeric_limits<double>::infinity(), 1), Error);
  EXPECT_THROW(arange(0, std::nan(""), 1), Error);
  EXPECT_EQ(full({2}, 3.5, DType::BFloat16).to_vector<float>(), (std::vector<float>{3.5f, 3.5f}));
  EXPECT_EQ(ones({2, 2}, DType::Bool).to_vector<bool>(), std::vector<bool>(4, true));
  EXPECT_EQ(scalar_tensor(4.0).item<float>(), 4.0f);
  EXPECT_EQ(scalar_tensor(4.0).dim(), 0);
  EXPECT_NE(error_of([] { ones({2}).item<float>(); }).find("exactly one"), std::string::npos);
  EXPECT_NE(error_of([] { ones({2}).data<double>(); }).find("float32"), std::string::npos);
}

TEST(Tensor, CudaWithoutBuildIsAClearError) {
  if (cuda_compiled()) GTEST_SKIP() << "CUDA build";
  EXPECT_NE(error_of([] {
              empty({2}, TensorOptions(DType::Float32, Device::cuda()));
            }).find("no CUDA support"),
            std::string::npos);
}

TEST(Tensor, SynchronizeWaitsForNothingOnTheCpuAndNamesAMissingDevice) {
  synchronize(Device::cpu());  // CPU kernels finish before they return
  if (cuda_device_count() > 0) {
    synchronize(Device::cuda(0));
    return;
  }
  EXPECT_NE(error_of([] { synchronize(Device::cuda(0)); }).find("cuda:0"), std::string::npos);
}

TEST(Tensor, StorageReleaseFreesBytesUnderLiveTensors) {
  Tensor a = full({256, 256}, 2.0);
  Tensor view = kernels::narrow(a, 0, 1, 3);
  const int64_t before = memory_stats().current_bytes;
  a.storage().impl()->release();
  EXPECT_TRUE(a.storage().impl()->is_released());
  EXPECT_EQ(memory_stats().current_bytes, before - 256 * 256 * 4);
  EXPECT_NE(error_of([&] { view.to_vector<float>(); }).find("released"), std::string::npos);
  a.storage().impl()->reallocate();
  EXPECT_EQ(memory_stats().current_bytes, before);
  view.fill_(5.0);
  EXPECT_EQ(a.to_vector<float>()[256], 5.0f);
}

// A copy within one dtype moves bits, strided or not: 16-bit NaN payloads and signalling NaNs
// survive (converting through float32 would quiet or rewrite them).
TEST(Tensor, StridedCopyWithinADtypeKeepsNaNPayloads) {
  for (DType dt : {DType::Float16, DType::BFloat16}) {
    const std::vector<uint16_t> bits = {0x7c01, 0x7d55, 0xfe01, 0x7f81, 0x7fc1, 0xffa5};
    Tensor base = empty({2, 3}, dt);
    std::memcpy(base.raw_data(), bits.data(), bits.size() * 2);
    const Tensor t = base.as_strided({3, 2}, {1, 3}, 0).contiguous();
    const auto* got = static_cast<const uint16_t*>(t.raw_data());
    for (int64_t r = 0; r < 3; ++r)
      for (int64_t c = 0; c < 2; ++c)
        EXPECT_EQ(got[r * 2 + c], bits[size_t(c * 3 + r)])
            << dtype_name(dt) << " [" << r << ", " << c << "]";
  }
}

// values_digest is what ranks compare to see that they hold the same values (distribute_tensor
// with every rank's tensor, LoRA's load_adapter): it follows the logical values, not the layout.
TEST(Tensor, ValuesDigestFollowsTheValuesInRowMajorOrder) {
  const Tensor a = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(values_digest(a), values_digest(a.clone()));
  const Tensor t = a.as_strided({3, 2}, {1, 3}, 0);  // a's transpose, strided
  EXPECT_EQ(values_digest(t), values_digest(from_vector<float>({1, 4, 2, 5, 3, 6}, {3, 2})));
  EXPECT_NE(values_digest(t), values_digest(a));
  Tensor b = a.clone();
  static_cast<float*>(b.raw_data())[5] = 7;
  EXPECT_NE(values_digest(b), values_digest(a));
  expect_error([] { values_digest(Tensor()); }, {"undefined tensor"});
}
