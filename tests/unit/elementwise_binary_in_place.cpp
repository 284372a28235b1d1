// In-place and selection kernels: add with broadcasting, alpha, strided and overlapping
// operands, scalar multiply, where, masked_fill and sum_to_shape. Expected values are computed
// with plain loops in double. Part of the test_elementwise_binary binary.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "unit/kernel_test_util.h"

using namespace tessera;
using namespace tessera::kernel_test;
using kernels::BinaryOp;
using kernels::CompareOp;
using kernels::UnaryOp;
using tessera::testing::error_of;
using tessera::testing::expect_error;

// --- in place ---

TEST(InPlace, AddBroadcastAlphaAndStridedDestination) {
  Tensor dst = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  kernels::add_(dst, from_vector<float>({10, 20, 30}), 0.5);
  EXPECT_EQ(dst.to_vector<float>(), (std::vector<float>{6, 12, 18, 9, 15, 21}));

  // Writing through a transposed view updates the base in place.
  Tensor base = from_vector<double>({0, 1, 2, 3, 4, 5}, {2, 3});
  Tensor view = kernels::transpose(base, 0, 1);  // [3, 2]
  kernels::add_(view, from_vector<double>({100, 200}, {1, 2}));
  EXPECT_EQ(base.to_vector<double>(), (std::vector<double>{100, 101, 102, 203, 204, 205}));

  // Source in another dtype: float64 into float32, float32 into bfloat16, int32 into int64.
  Tensor f = from_vector<float>({1, 2});
  kernels::add_(f, from_vector<double>({0.25, 0.5}), 2.0);
  EXPECT_EQ(f.to_vector<float>(), (std::vector<float>{1.5f, 3.f}));
  Tensor h = from_vector<float>({1, 2}).to(DType::BFloat16);
  kernels::add_(h, from_vector<float>({0.5f, 0.25f}));
  EXPECT_EQ(h.dtype(), DType::BFloat16);
  EXPECT_EQ(h.to_vector<float>(), (std::vector<float>{1.5f, 2.25f}));
  Tensor acc = from_vector<float>({0.5f, 1.f, 2.f});  // a bfloat16 gradient into float32
  kernels::add_(acc, from_vector<float>({1.f, 2.f, 3.f}).to(DType::BFloat16), 2.0);
  EXPECT_EQ(acc.to_vector<float>(), (std::vector<float>{2.5f, 5.f, 8.f}));
  Tensor hf = from_vector<float>({1, 2}).to(DType::Float16);
  kernels::add_(hf, from_vector<float>({0.5f, 0.25f}).to(DType::BFloat16));
  EXPECT_EQ(hf.to_vector<float>(), (std::vector<float>{1.5f, 2.25f}));
  Tensor i = from_vector<int64_t>({1, 2});
  kernels::add_(i, from_vector<int32_t>({5, 6}), -1);
  EXPECT_EQ(i.to_vector<int64_t>(), (std::vector<int64_t>{-4, -4}));
}

TEST(InPlace, AddErrors) {
  Tensor dst = zeros({3});
  std::string msg = error_of([&] { kernels::add_(dst, zeros({2, 3})); });
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3]"), std::string::npos) << msg;
  Tensor i = zeros({3}, DType::Int64);
  msg = error_of([&] { kernels::add_(i, ones({3})); });
  EXPECT_NE(msg.find("float32"), std::string::npos) << msg;
  Tensor expanded = kernels::expand(zeros({1}), {3});
  EXPECT_THROW(kernels::add_(expanded, ones({3})), Error);
}

// A source sharing memory with the destination adds the values it had before the call.
TEST(InPlace, AddFromAnOverlappingViewOfItself) {
  Tensor m = kernels::view(arange(0, 9, 1, DType::Float32), {3, 3});
  kernels::add_(m, kernels::transpose(m, 0, 1));
  EXPECT_EQ(m.to_vector<float>(), (std::vector<float>{0, 4, 8, 4, 8, 12, 8, 12, 16}));
  // A row of the destination, broadcast over all rows: rows after the first read its old values.
  Tensor r = kernels::view(arange(0, 9, 1, DType::Float64), {3, 3});
  kernels::add_(r, kernels::select(r, 0, 0), 2.0);
  EXPECT_EQ(r.to_vector<double>(), (std::vector<double>{0, 3, 6, 3, 6, 9, 6, 9, 12}));
  Tensor a = arange(0, 6, 1, DType::Int64);
  Tensor tail = kernels::narrow(a, 0, 1, 5);
  kernels::add_(tail, kernels::narrow(a, 0, 0, 5));
  EXPECT_EQ(a.to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 3, 5, 7, 9}));
  // The same view doubles in place without a copy.
  Tensor t = kernels::transpose(kernels::view(arange(0, 6, 1, DType::Float32), {2, 3}), 0, 1);
  const int64_t before = memory_stats().num_allocations;
  kernels::add_(t, t);
  EXPECT_EQ(memory_stats().num_allocations, before);
  EXPECT_EQ(t.contiguous().to_vector<float>(), (std::vector<float>{0, 6, 2, 8, 4, 10}));
  // A destination with two elements at one address is refused before anything is written.
  Tensor base = zeros({4});
  Tensor twice = base.as_strided({2, 2}, {1, 1}, 0);
  expect_error([&] { kernels::add_(twice, ones({2, 2})); }, {"add_", "more than one element"});
  EXPECT_EQ(base.to_vector<float>(), std::vector<float>(4, 0.0f));
}

TEST(InPlace, MulScalar) {
  Tensor base = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor col = kernels::select(base, 1, 1);  // strided [2]
  kernels::mul_scalar_(col, -2);
  EXPECT_EQ(base.to_vector<float>(), (std::vector<float>{1, -4, 3, 4, -10, 6}));
  Tensor i = from_vector<int32_t>({3, -1});
  kernels::mul_scalar_(i, 4);
  EXPECT_EQ(i.to_vector<int32_t>(), (std::vector<int32_t>{12, -4}));
  EXPECT_THROW(kernels::mul_scalar_(i, 0.5), Error);
}

// --- selection ---

TEST(Where, BroadcastsAllThreeAndPromotes) {
  Tensor cond = from_vector<bool>({true, false, true}, {3, 1});
  Tensor a = from_vector<float>({1, 2, 3, 4}, {1, 4});
  Tensor b = scalar_tensor(-1.0, DType::Float64);
  Tensor y = kernels::where(cond, a, b);
  EXPECT_EQ(y.shape(), (Shape{3, 4}));
  EXPECT_EQ(y.dtype(), DType::Float32);  // a 0-dim float64 does not widen a float32 operand
  EXPECT_EQ(y.to_vector<double>(), (std::vector<double>{1, 2, 3, 4, -1, -1, -1, -1, 1, 2, 3, 4}));
  EXPECT_EQ(kernels::where(cond, from_vector<int64_t>({1, 2, 3, 4}, {1, 4}), b).dtype(),
            DType::Float64);

  Tensor ia = from_vector<int64_t>({1, 2, 3});
  Tensor ib = kernels::transpose(from_vector<int64_t>({7, 8, 9}, {3, 1}), 0, 1);  // [1, 3]
  Tensor m = from_vector<bool>({false, true, false});
  EXPECT_EQ(kernels::where(m, ia, ib).to_vector<int64_t>(), (std::vector<int64_t>{7, 2, 9}));
  std::string msg = error_of([&] { kernels::where(ia, ia, ib); });
  EXPECT_NE(msg.find("bool"), std::string::npos) << msg;
  msg = error_of([&] { kernels::where(from_vector<bool>({true, false}), zeros({3}), zeros({3})); });
  EXPECT_NE(msg.find("[2]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3]"), std::string::npos) << msg;
}

TEST(MaskedFill, BroadcastMaskAndDtypes) {
  Tensor x = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor mask = from_vector<bool>({true, false, true});
  Tensor y = kernels::masked_fill(x, mask, -std::numeric_limits<double>::infinity());
  expect_close(y, {-INFINITY, 2, -INFINITY, -INFINITY, 5, -INFINITY}, 0, 0);
  Tensor xt = kernels::transpose(x, 0, 1);  // [3, 2] non-contiguous
  y = kernels::masked_fill(xt, from_vector<bool>({false, true}, {1, 2}), 0);
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{1, 0, 2, 0, 3, 0}));
  Tensor ids = from_vector<int64_t>({5, 6});
  EXPECT_EQ(kernels::masked_fill(ids, from_vector<bool>({false, true}), -100).to_vector<int64_t>(),
            (std::vector<int64_t>{5, -100}));
  const std::string msg = error_of([&] { kernels::masked_fill(x, zeros({2, 3}), 0); });
  EXPECT_NE(msg.find("bool"), std::string::npos) << msg;
  // A mask larger than x cannot be applied in x's shape.
  EXPECT_THROW(
      kernels::masked_fill(mask.to(DType::Bool), from_vector<bool>({true}, {1, 1, 1}), 0).numel(),
      Error);
}

TEST(SumToShape, UndoesBroadcasting) {
  const auto v = wavy(24, -1, 1);
  Tensor x = tensor_of(v, {2, 3, 4}, DType::Float64);
  auto ref = [&](const Shape& target) {
    // Sum each element into the target index it was broadcast from.
    std::vector<double> out(size_t(shape_numel(target)), 0.0);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j)
        for (int k = 0; k < 4; ++k) {
          const int64_t c[3] = {i, j, k};
          int64_t idx = 0;
          const size_t lead = 3 - target.size();
          for (size_t d = 0; d < target.size(); ++d)
            idx = idx * target[d] + (target[d] == 1 ? 0 : c[lead + d]);
          out[size_t(idx)] += v[size_t((i * 3 + j) * 4 + k)];
        }
    return out;
  };
  for (const Shape& target : {Shape{3, 1}, Shape{1, 4}, Shape{4}, Shape{2, 1, 4}, Shape{},
                              Shape{1, 1, 1}, Shape{2, 3, 4}}) {
    Tensor y = kernels::sum_to_shape(x, target);
    EXPECT_EQ(y.shape(), target);
    expect_close(y, ref(target), 1e-14, 1e-14, shape_str(target));
  }
  const std::string msg = error_of([&] { kernels::sum_to_shape(x, {5}); });
  EXPECT_NE(msg.find("[2, 3, 4]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[5]"), std::string::npos) << msg;
}
