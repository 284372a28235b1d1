#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;

namespace {
// The window of `full` (row-major, shape g) at `offset` with shape `local`.
std::vector<float> window_of(const std::vector<float>& full, const Shape& g, const Shape& offset,
                             const Shape& local) {
  Tensor t = from_vector<float>(full, g);
  for (size_t d = 0; d < g.size(); ++d)
    t = kernels::narrow(t, int64_t(d), offset[d], local[d]);
  return t.contiguous().to_vector<float>();
}
}  // namespace

class RandomWindowTest : public ::testing::TestWithParam<RandomKind> {};

TEST_P(RandomWindowTest, AnyWindowEqualsSliceOfFullDrawBitForBit) {
  const RandomKind kind = GetParam();
  const Shape g{7, 5, 6};
  const uint64_t seed = 42, base = 13;  // a base that is not a multiple of 4
  Tensor full = empty(g);
  philox_fill(full, kind, 0.3, 2.0, seed, base, {g, {0, 0, 0}});
  std::vector<float> fv = full.to_vector<float>();
  for (Shape off : {Shape{0, 0, 0}, Shape{1, 2, 3}, Shape{6, 4, 5}, Shape{3, 0, 1}}) {
    Shape local{g[0] - off[0], std::min<int64_t>(2, g[1] - off[1]), g[2] - off[2]};
    Tensor w = empty(local);
    philox_fill(w, kind, 0.3, 2.0, seed, base, {g, off});
    EXPECT_EQ(w.to_vector<float>(), window_of(fv, g, off, local)) << shape_str(off);
  }
  // Strided destination: a transposed buffer receives the same values.
  Tensor buf = empty({6, 5, 7});
  Tensor tview = kernels::permute(buf, {2, 1, 0});
  philox_fill(tview, kind, 0.3, 2.0, seed, base, {g, {0, 0, 0}});
  EXPECT_EQ(tview.contiguous().to_vector<float>(), fv);
}

INSTANTIATE_TEST_SUITE_P(Kinds, RandomWindowTest,
                         ::testing::Values(RandomKind::Uniform, RandomKind::Normal,
                                           RandomKind::Bernoulli));

TEST(Random, GeneratorAdvancesAndSplitsDrawsConsistently) {
  Generator g1(7), g2(7);
  Tensor a = rand({10}, g1);
  Tensor b = rand({6}, g1);
  Tensor whole = rand({16}, g2);
  std::vector<float> ab = a.to_vector<float>();
  for (float v : b.to_vector<float>())
    ab.push_back(v);
  EXPECT_EQ(ab, whole.to_vector<float>());
  EXPECT_EQ(g1.offset(), 16u);
  Generator g3(8);
  EXPECT_NE(rand({16}, g3).to_vector<float>(), whole.to_vector<float>());
}

TEST(Random, DistributionsHaveTheRightMoments) {
  Generator gen(1);
  const int64_t n = 200000;
  auto u = rand({n}, gen).to_vector<float>();
  auto z = randn({n}, gen, DType::Float64).to_vector<double>();
  double su = 0, sz = 0, sz2 = 0;
  float umin = 1, umax = 0;
  for (int64_t i = 0; i < n; ++i) {
    su += u[i];
    umin = std::min(umin, u[i]);
    umax = std::max(umax, u[i]);
    sz += z[i];
    sz2 += z[i] * z[i];
  }
  EXPECT_NEAR(su / n, 0.5, 0.005);
  EXPECT_GE(umin, 0.0f);
  EXPECT_LT(umax, 1.0f);
  EXPECT_NEAR(sz / n, 0.0, 0.01);
  EXPECT_NEAR(sz2 / n, 1.0, 0.02);
}

TEST(Random, KaimingUsesFansOfTheGlobalShape) {
  // torch.nn.init.kaiming_uniform_'s default a = 0: bound sqrt(6 / fan_in).
  for (const auto& [a, bound] :
       {std::pair{std::optional<double>(), std::sqrt(6.0 / 128)},
        std::pair{std::optional<double>(std::sqrt(5.0)), 1.0 / std::sqrt(128.0)}}) {
    Generator gen(3);
    Tensor w = empty({64, 128});
    if (a)
      kaiming_uniform_(w, gen, *a);
    else
      kaiming_uniform_(w, gen);
    EXPECT_NEAR(kaiming_uniform_bound({64, 128}, a.value_or(0.0), FanMode::FanIn), bound, 1e-12);
    double mx = 0;
    for (float v : w.to_vector<float>())
      mx = std::max(mx, double(std::abs(v)));
    EXPECT_LE(mx, bound);
    EXPECT_GT(mx, 0.9 * bound);
  }
  EXPECT_NEAR(xavier_uniform_bound({64, 128}, 1.0), std::sqrt(6.0 / 192), 1e-12);
}

TEST(Random, BadWindowIsAnError) {
  Tensor w = empty({4, 4});
  EXPECT_THROW(philox_fill(w, RandomKind::Uniform, 0, 1, 1, 0, {{4, 6}, {1, 0}}), Error);
  try {
    philox_fill(w, RandomKind::Uniform, 0, 1, 1, 0, {{4, 6}, {1, 0}});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds global shape [4, 6]"), std::string::npos);
  }
}

TEST(Random, UniformStaysBelowItsUpperBoundInEveryDtype) {
  // The value before rounding lies in [a, b); rounded to a 16-bit dtype it reached b (about one
  // bfloat16 draw in 512 was exactly 1.0). As in PyTorch, such a value becomes a.
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32, DType::Float64}) {
    Generator gen(11);
    const std::vector<double> u = rand({1 << 16}, gen, dt).to_vector<double>();
    EXPECT_GE(*std::min_element(u.begin(), u.end()), 0.0) << dtype_name(dt);
    EXPECT_LT(*std::max_element(u.begin(), u.end()), 1.0) << dtype_name(dt);
    Tensor w = empty({1 << 16}, dt);
    uniform_(w, -2.0, 3.0, gen);
    const std::vector<double> v = w.to_vector<double>();
    EXPECT_GE(*std::min_element(v.begin(), v.end()), -2.0) << dtype_name(dt);
    EXPECT_LT(*std::max_element(v.begin(), v.end()), 3.0) << dtype_name(dt);
  }
}

TEST(Random, BadArgumentsAreRefusedBeforeTheGeneratorMoves) {
  // PyTorch's checks: uniform_ needs finite low <= high, normal_ std >= 0, a fill a floating
  // dtype. A refused call leaves the generator where it was, so the next draw is the one the
  // program would have made without it.
  Generator gen(3);
  Tensor t = empty({4, 2});
  tessera::testing::expect_error([&] { uniform_(t, 3.0, 1.0, gen); },
                                 {"uniform_: expects a [low, high) range", "low=3, high=1"});
  tessera::testing::expect_error([&] { uniform_(t, 0.0, INFINITY, gen); }, {"high=inf"});
  tessera::testing::expect_error([&] { normal_(t, 0.0, -1.0, gen); },
                                 {"normal_: expects std >= 0, got std=-1"});
  Tensor ints = zeros({4}, DType::Int64);
  tessera::testing::expect_error([&] { uniform_(ints, 0.0, 1.0, gen); },
                                 {"uniform_: random fill of a int64 tensor"});
  EXPECT_EQ(gen.offset(), 0u);
  // A tensor of no elements (fan in 0: an infinite bound) is left alone, as in PyTorch.
  Tensor none = empty({4, 0});
  EXPECT_NO_THROW(kaiming_uniform_(none, gen));
  EXPECT_NO_THROW(xavier_uniform_(none, gen));
  // Equal bounds are a valid range: every element is low.
  uniform_(t, 2.0, 2.0, gen);
  for (double v : t.to_vector<double>())
    EXPECT_EQ(v, 2.0);
}
