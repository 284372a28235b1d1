// embedding, cat, stack, index_select, index_add: values against plain-loop references,
// gradients by finite differences, error messages.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::error_of;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;

namespace {

Tensor leaf(const Shape& shape, uint64_t seed) {
  Tensor t = random_tensor(shape, seed, DType::Float64);
  t.set_requires_grad(true);
  return t;
}

void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      const std::vector<Tensor>& inputs) {
  GradcheckResult r = gradcheck(f, inputs);
  EXPECT_TRUE(r.ok) << r.message;
}

// Multi-index <-> row-major linear index.
Shape unravel(int64_t lin, const Shape& shape) {
  Shape idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = lin % shape[d];
    lin /= shape[d];
  }
  return idx;
}
int64_t ravel(const Shape& idx, const Shape& shape) {
  int64_t lin = 0;
  for (size_t d = 0; d < shape.size(); ++d)
    lin = lin * shape[d] + idx[d];
  return lin;
}

// out[..., k, ...] = x[..., idx[k], ...] along dim.
std::vector<double> ref_index_select(const std::vector<double>& x, const Shape& shape, int64_t dim,
                                     const std::vector<int64_t>& idx) {
  Shape out_shape = shape;
  out_shape[size_t(dim)] = int64_t(idx.size());
  std::vector<double> out(size_t(shape_numel(out_shape)));
  for (int64_t i = 0; i < int64_t(out.size()); ++i) {
    Shape mi = unravel(i, out_shape);
    mi[size_t(dim)] = idx[size_t(mi[size_t(dim)])];
    out[size_t(i)] = x[size_t(ravel(mi, shape))];
  }
  return out;
}

// Concatenation along dim of tensors given by value and shape.
std::vector<double> ref_cat(const std::vector<std::vector<double>>& xs,
                            const std::vector<Shape>& shapes, int64_t dim) {
  Shape out_shape = shapes[0];
  out_shape[size_t(dim)] = 0;
  for (const Shape& s : shapes)
    out_shape[size_t(dim)] += s[size_t(dim)];
  std::vector<double> out(size_t(shape_numel(out_shape)));
  for (int64_t i = 0; i < int64_t(out.size()); ++i) {
    Shape mi = unravel(i, out_shape);
    size_t piece = 0;
    while (mi[size_t(dim)] >= shapes[piece][size_t(dim)]) {
      mi[size_t(dim)] -= shapes[piece][size_t(dim)];
      ++piece;
    }
    out[size_t(i)] = xs[piece][size_t(ravel(mi, shapes[piece]))];
  }
  return out;
}

void expect_values(const Tensor& t, const std::vector<double>& want, double tol = 0.0) {
  std::vector<double> v = t.to_vector<double>();
  ASSERT_EQ(v.size(), want.size()) << t.str();
  for (size_t i = 0; i < v.size(); ++i)
    ASSERT_NEAR(v[i], want[i], tol) << "element " << i;
}

}  // namespace

TEST(Embedding, LooksUpRows) {
  Tensor w = random_tensor({10, 4}, 1, DType::Float32);
  std::vector<int64_t> idx = {3, 0, 9, 3, 7, 1};
  Tensor indices = from_vector<int64_t>(idx, {2, 3});
  Tensor out = kernels::embedding(w, indices);
  EXPECT_EQ(out.shape(), (Shape{2, 3, 4}));
  std::vector<double> vw = w.to_vector<double>(), want;
  for (int64_t i : idx)
    for (int64_t j = 0; j < 4; ++j)
      want.push_back(vw[size_t(i * 4 + j)]);
  expect_values(out, want);
  expect_values(tessera::embedding(indices, w), want);
  // int32 indices and a transposed (non-contiguous) table.
  Tensor wt = kernels::transpose(w.contiguous(), 0, 1).contiguous();  // [4, 10]
  Tensor w_view = kernels::transpose(wt, 0, 1);                       // [10, 4], strided
  ASSERT_FALSE(w_view.is_contiguous());
  expect_values(kernels::embedding(w_view, indices.to(DType::Int32)), want);
}

TEST(Embedding, DtypesAndEmptyIndices) {
  Tensor w = random_tensor({5, 3}, 2, DType::BFloat16);
  Tensor out = kernels::embedding(w, from_vector<int64_t>({4, 2}, {2}));
  EXPECT_EQ(out.dtype(), DType::BFloat16);
  std::vector<double> vw = w.to_vector<double>();
  expect_values(out, {vw[12], vw[13], vw[14], vw[6], vw[7], vw[8]});
  Tensor e = kernels::embedding(w, zeros({0}, DType::Int64));
  EXPECT_EQ(e.shape(), (Shape{0, 3}));
  Tensor s = kernels::embedding(w, scalar_tensor(1, DType::Int64));
  EXPECT_EQ(s.shape(), (Shape{3}));
  expect_values(s, {vw[3], vw[4], vw[5]});
}

TEST(Embedding, BackwardScatterAddsRepeatedIndices) {
  std::vector<int64_t> idx = {2, 0, 2, 2};
  Tensor indices = from_vector<int64_t>(idx, {2, 2});
  Tensor g = random_tensor({2, 2, 3}, 3, DType::Float64);
  std::vector<double> vg = g.to_vector<double>(), want(5 * 3, 0.0);
  for (size_t r = 0; r < idx.size(); ++r)
    for (size_t j = 0; j < 3; ++j)
      want[size_t(idx[r]) * 3 + j] += vg[r * 3 + j];
  Tensor gw = kernels::embedding_backward(g, indices, 5);
  EXPECT_EQ(gw.shape(), (Shape{5, 3}));
  expect_values(gw, want, 1e-14);
  // 16-bit gradients accumulate in float32 before the single rounding.
  Tensor gb = kernels::embedding_backward(g.to(DType::BFloat16), indices, 5);
  EXPECT_EQ(gb.dtype(), DType::BFloat16);
  expect_values(gb, want, 3e-2);
}

TEST(Embedding, Gradcheck) {
  Tensor indices = from_vector<int64_t>({1, 3, 1, 0, 3, 3}, {3, 2});
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) { return tessera::embedding(indices, in[0]); },
      {leaf({4, 3}, 4)});
}

TEST(Embedding, BadIndexNamesIndexAndVocabSize) {
  Tensor w = random_tensor({10, 4}, 5, DType::Float32);
  std::string msg = error_of([&] { kernels::embedding(w, from_vector<int64_t>({1, 12, 3})); });
  EXPECT_NE(msg.find("embedding"), std::string::npos) << msg;
  EXPECT_NE(msg.find("index 12"), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_embeddings 10"), std::string::npos) << msg;
  msg = error_of([&] { tessera::embedding(from_vector<int64_t>({-1}), w); });
  EXPECT_NE(msg.find("index -1"), std::string::npos) << msg;
  msg = error_of([&] { kernels::embedding(w, zeros({2}, DType::Float32)); });
  EXPECT_NE(msg.find("int64"), std::string::npos) << msg;
}

TEST(Cat, AlongEveryDimWithEmptyAndStridedPieces) {
  Tensor a = random_tensor({2, 3, 4}, 6, DType::Float32);
  Tensor b = kernels::permute(random_tensor({4, 2, 3}, 7, DType::Float32),
                              {1, 2, 0});  // [2, 3, 4] strided
  for (int64_t dim : {0, 1, 2}) {
    Shape sc = a.shape();
    sc[size_t(dim)] = 1;
    Shape se = a.shape();
    se[size_t(dim)] = 0;
    Tensor c = random_tensor(sc, uint64_t(8 + dim), DType::Float32);
    Tensor e = zeros(se);
    Tensor out = kernels::cat({a, e, b, c}, dim);
    std::vector<double> want =
        ref_cat({a.to_vector<double>(), {}, b.to_vector<double>(), c.to_vector<double>()},
                {a.shape(), se, b.shape(), sc}, dim);
    Shape want_shape = a.shape();
    want_shape[size_t(dim)] = 2 * a.size(dim) + 1;
    EXPECT_EQ(out.shape(), want_shape);
    expect_values(out, want);
    expect_values(tessera::cat({a, e, b, c}, dim - 3), want);
  }
}

TEST(Cat, PromotesDtypesAndChecksShapes) {
  Tensor a = random_tensor({2, 2}, 11, DType::Float32),
         b = random_tensor({1, 2}, 12, DType::Float64);
  Tensor out = kernels::cat({a, b}, 0);
  EXPECT_EQ(out.dtype(), DType::Float64);
  std::vector<double> want = a.to_vector<double>();
  for (double v : b.to_vector<double>())
    want.push_back(v);
  expect_values(out, want);
  std::string msg = error_of([&] {
    kernels::cat({a, random_tensor({2, 3}, 13, DType::Float32)}, 0);
  });
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 2]"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { kernels::cat({}, 0); }).find("non-empty"), std::string::npos);
}

// PyTorch skips legacy empty tensors [0] whatever the others' shapes (torch.cat([torch.empty(0),
// x]) is x), counting them only in the result's dtype.
TEST(Cat, SkipsLegacyEmptyTensors) {
  Tensor a = random_tensor({2, 3, 4}, 15, DType::Float32),
         b = random_tensor({2, 1, 4}, 16, DType::Float32);
  Tensor e32 = empty({0}, DType::Float32), e64 = empty({0}, DType::Float64);
  for (int64_t dim : {1, -2}) {
    Tensor out = kernels::cat({e32, a, e64, b, e32}, dim);
    EXPECT_EQ(out.shape(), (Shape{2, 4, 4}));
    EXPECT_EQ(out.dtype(), DType::Float64);
    expect_values(out, kernels::cat({a, b}, dim).to_vector<double>());
  }
  Tensor all_empty = kernels::cat({e32, e32}, 3);
  EXPECT_EQ(all_empty.shape(), Shape{0});
  // Only the 1-D empty tensor is skipped: [2, 0] must still match the others.
  std::string msg = error_of([&] { kernels::cat({a, empty({2, 0})}, 1); });
  EXPECT_NE(msg.find("[2, 0]"), std::string::npos) << msg;
  msg = error_of([&] { kernels::cat({e32, a, random_tensor({}, 17, DType::Float32)}, 0); });
  EXPECT_NE(msg.find("zero-dimensional tensor 2"), std::string::npos) << msg;
}

TEST(Stack, NewDimAtEveryPosition) {
  Tensor a = random_tensor({2, 3}, 14, DType::Float32),
         b = random_tensor({2, 3}, 15, DType::Float32);
  Tensor bt = kernels::transpose(random_tensor({3, 2}, 16, DType::Float32), 0, 1);
  std::vector<std::vector<double>> vs = {a.to_vector<double>(), b.to_vector<double>(),
                                         bt.to_vector<double>()};
  for (int64_t dim : {0, 1, 2}) {
    Tensor out = kernels::stack({a, b, bt}, dim);
    Shape want_shape = {2, 3};
    want_shape.insert(want_shape.begin() + dim, 3);
    EXPECT_EQ(out.shape(), want_shape);
    std::vector<double> want(size_t(out.numel()));
    for (int64_t i = 0; i < out.numel(); ++i) {
      Shape mi = unravel(i, want_shape);
      int64_t piece = mi[size_t(dim)];
      mi.erase(mi.begin() + dim);
      want[size_t(i)] = vs[size_t(piece)][size_t(ravel(mi, {2, 3}))];
    }
    expect_values(out, want);
    expect_values(tessera::stack({a, b, bt}, dim - 3), want);
  }
  std::string msg = error_of([&] {
    kernels::stack({a, random_tensor({3, 2}, 17, DType::Float32)}, 0);
  });
  EXPECT_NE(msg.find("[3, 2]"), std::string::npos) << msg;
}

TEST(IndexSelect, AnyDimRepeatedIndicesStridedInput) {
  Tensor x = random_tensor({4, 5, 3}, 18, DType::Float32);
  std::vector<double> vx = x.to_vector<double>();
  std::vector<int64_t> idx = {2, 0, 2};
  for (int64_t dim : {0, 1, 2}) {
    Tensor out = kernels::index_select(x, dim, from_vector<int64_t>(idx));
    Shape want_shape = x.shape();
    want_shape[size_t(dim)] = 3;
    EXPECT_EQ(out.shape(), want_shape);
    expect_values(out, ref_index_select(vx, x.shape(), dim, idx));
    expect_values(tessera::index_select(x, dim, from_vector<int32_t>({2, 0, 2})),
                  ref_index_select(vx, x.shape(), dim, idx));
  }
  Tensor xs = kernels::permute(x, {2, 0, 1});  // [3, 4, 5] strided
  std::vector<double> vxs = xs.to_vector<double>();
  expect_values(kernels::index_select(xs, 1, from_vector<int64_t>({3, 1})),
                ref_index_select(vxs, xs.shape(), 1, {3, 1}));
  Tensor e = kernels::index_select(x, 1, zeros({0}, DType::Int64));
  EXPECT_EQ(e.shape(), (Shape{4, 0, 3}));
  Tensor h = kernels::index_select(x.to(DType::Float16), 2, from_vector<int64_t>({1}));
  EXPECT_EQ(h.dtype(), DType::Float16);
  expect_values(h, ref_index_select(x.to(DType::Float16).to_vector<double>(), x.shape(), 2, {1}));

  std::string msg = error_of([&] { kernels::index_select(x, 1, from_vector<int64_t>({5})); });
  EXPECT_NE(msg.find("index 5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("size 5"), std::string::npos) << msg;
}

// A 0-dim input acts as a vector of one element and gives a 0-dim result, as in PyTorch.
TEST(IndexSelect, ZeroDimInput) {
  Tensor s = scalar_tensor(2.5, DType::Float64);
  for (int64_t dim : {0, -1}) {
    Tensor y = kernels::index_select(s, dim, from_vector<int64_t>({0}));
    EXPECT_EQ(y.shape(), Shape{});
    EXPECT_EQ(y.item<double>(), 2.5);
  }
  EXPECT_EQ(kernels::index_select(s, 0, full({}, 0, DType::Int64)).shape(), Shape{});
  expect_error(
      [&] {
        kernels::index_select(s, 0, from_vector<int64_t>({0, 0}));
      },
      {"index_select", "only 1 value", "got 2"});
  expect_error([&] { kernels::index_select(s, 0, from_vector<int64_t>({1})); },
               {"index_select", "index 1"});
  expect_error([&] { kernels::index_select(s, 1, from_vector<int64_t>({0})); },
               {"index_select", "dim 1"});
}

TEST(IndexAdd, AccumulatesRepeatedIndices) {
  Tensor src = random_tensor({2, 3, 2}, 19, DType::Float64);
  std::vector<double> vs = src.to_vector<double>();
  std::vector<int64_t> idx = {1, 3, 1};
  Shape shape = {2, 4, 2};
  std::vector<double> want(16, 0.0);
  for (int64_t i = 0; i < src.numel(); ++i) {
    Shape mi = unravel(i, src.shape());
    mi[1] = idx[size_t(mi[1])];
    want[size_t(ravel(mi, shape))] += vs[size_t(i)];
  }
  Tensor out = kernels::index_add(shape, 1, from_vector<int64_t>(idx), src);
  EXPECT_EQ(out.shape(), shape);
  expect_values(out, want, 1e-14);
  std::string msg = error_of([&] {
    kernels::index_add({2, 4, 2}, 1, from_vector<int64_t>({0, 1}), src);
  });
  EXPECT_NE(msg.find("[2, 3, 2]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 2, 2]"), std::string::npos) << msg;
}

TEST(ShapeOpsAutograd, Gradcheck) {
  expect_gradcheck([](const std::vector<Tensor>& in) { return tessera::cat(in, 1); },
                   {leaf({2, 3}, 20), leaf({2, 1}, 21), leaf({2, 2}, 22)});
  expect_gradcheck([](const std::vector<Tensor>& in) { return tessera::stack(in, 1); },
                   {leaf({2, 3}, 23), leaf({2, 3}, 24)});
  Tensor idx = from_vector<int64_t>({2, 0, 2, 1});
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) { return tessera::index_select(in[0], 1, idx); },
      {leaf({2, 3, 2}, 25)});
}

TEST(ShapeOpsAutograd, CatGradientOnlyToInputsThatNeedIt) {
  Tensor a = leaf({2, 2}, 26);
  Tensor b = random_tensor({3, 2}, 27, DType::Float32);  // promoted, no grad
  Tensor y = tessera::cat({a, b}, 0);
  EXPECT_EQ(y.dtype(), DType::Float64);
  tessera::backward(y, ones({5, 2}, DType::Float64));
  ASSERT_TRUE(a.grad().defined());
  EXPECT_EQ(a.grad().to_vector<double>(), std::vector<double>(4, 1.0));
  EXPECT_FALSE(b.grad().defined());
}

TEST(ShapeOpsAutograd, CatGivesSkippedEmptyInputAnEmptyGradient) {
  Tensor e = leaf({0}, 28);
  Tensor a = leaf({2, 3}, 29);
  Tensor y = tessera::cat({e, a, e}, 1);
  EXPECT_EQ(y.shape(), (Shape{2, 3}));
  Tensor w = random_tensor({2, 3}, 30, DType::Float64);
  tessera::backward(y, w);
  ASSERT_TRUE(e.grad().defined());
  EXPECT_EQ(e.grad().shape(), Shape{0});
  EXPECT_EQ(a.grad().to_vector<double>(), w.to_vector<double>());
  expect_gradcheck([](const std::vector<Tensor>& in) { return tessera::cat(in, 0); },
                   {leaf({0}, 31), leaf({2, 2}, 32)});
  Tensor only = leaf({0}, 33);
  Tensor z = tessera::cat({only, only}, 2);
  EXPECT_EQ(z.shape(), Shape{0});
  tessera::backward(z, empty({0}, DType::Float64));
  EXPECT_EQ(only.grad().shape(), Shape{0});
}

TEST(CopyRuns, MovesEveryRunAndLeavesTheRestAlone) {
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Int64, DType::Bool}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor src = random_tensor({40}, 3, DType::Float64, 10.0).to(dt);
    Tensor dst = full({50}, 1.0, dt);
    kernels::copy_runs_(dst, src, {{0, 10, 5}, {20, 0, 7}, {5, 30, 0}, {33, 40, 7}});
    const std::vector<double> s = src.to(DType::Float64).to_vector<double>();
    std::vector<double> want = full({50}, 1.0, dt).to(DType::Float64).to_vector<double>();
    for (int64_t i = 0; i < 5; ++i)
      want[size_t(10 + i)] = s[size_t(i)];
    for (int64_t i = 0; i < 7; ++i) {
      want[size_t(i)] = s[size_t(20 + i)];
      want[size_t(40 + i)] = s[size_t(33 + i)];
    }
    EXPECT_EQ(dst.to(DType::Float64).to_vector<double>(), want);
  }
}

TEST(CopyRuns, RefusesRunsThatDoNotFitOrOverlap) {
  Tensor src = zeros({8});
  Tensor dst = zeros({8});
  auto fails = [&](Tensor& d, const Tensor& s, std::vector<kernels::CopyRun> runs) {
    return error_of([&] { kernels::copy_runs_(d, s, runs); });
  };
  Tensor ints = zeros({8}, DType::Int32);
  EXPECT_NE(fails(ints, src, {}).find("differ in dtype"), std::string::npos);
  Tensor strided = zeros({16}).as_strided({8}, {2}, 0);
  EXPECT_NE(fails(strided, src, {}).find("contiguous"), std::string::npos);
  Tensor half = src.as_strided({4}, {1}, 4);
  EXPECT_NE(fails(half, src, {}).find("share storage"), std::string::npos);
  const std::string past = fails(dst, src, {{6, 0, 3}});
  EXPECT_NE(past.find("run {src 6, dst 0, length 3} does not fit"), std::string::npos) << past;
  const std::string overlap = fails(dst, src, {{0, 0, 4}, {4, 3, 2}});
  EXPECT_NE(overlap.find("runs {src 0, dst 0, length 4} and {src 4, dst 3, length 2} overlap"),
            std::string::npos)
      << overlap;
}
