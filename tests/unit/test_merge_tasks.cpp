// White-box: the SVD factors of add_weighted_adapter's "svd" combination, taken from the
// low-rank product (lora/src/merge_tasks.h) against the SVD of the whole update.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "merge_tasks.h"

namespace {

using tessera::lora_detail::svd_factors;
using tessera::lora_detail::svd_factors_of_product;
using Values = std::vector<double>;

Values normal_values(size_t n, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  Values v(n);
  for (double& x : v)
    x = normal(rng);
  return v;
}

// [m, r] x [r, n], row-major.
Values product(const Values& b, const Values& a, int64_t m, int64_t r, int64_t n) {
  Values c(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < r; ++p)
      for (int64_t j = 0; j < n; ++j)
        c[size_t(i * n + j)] += b[size_t(i * r + p)] * a[size_t(p * n + j)];
  return c;
}

double dot_rows(const Values& a, int64_t in, int64_t i, int64_t j) {
  double d = 0;
  for (int64_t c = 0; c < in; ++c)
    d += a[size_t(i * in + c)] * a[size_t(j * in + c)];
  return d;
}

struct Case {
  int64_t out, r, in, k;
};

std::string name_of(const Case& c) {
  return "[" + std::to_string(c.out) + ", " + std::to_string(c.r) + "] x [" + std::to_string(c.r) +
         ", " + std::to_string(c.in) + "] at rank " + std::to_string(c.k);
}

// Same factors as the SVD of B A up to each pair's sign; A's rows orthonormal as far as the
// full SVD has rows (min(out, in)), even past B A's rank r, with B's columns 0 there.
TEST(MergeTasks, FactorsOfTheProductAreTheSvdOfTheWholeUpdate) {
  for (const Case& c : {Case{7, 3, 5, 3}, Case{7, 3, 5, 2}, Case{7, 3, 5, 5}, Case{7, 3, 5, 6},
                        Case{3, 4, 9, 3}, Case{9, 4, 3, 2}, Case{12, 6, 10, 8}}) {
    SCOPED_TRACE(name_of(c));
    const Values b = normal_values(size_t(c.out * c.r), 1),
                 a = normal_values(size_t(c.r * c.in), 2);
    const auto [fb, fa] = svd_factors(product(b, a, c.out, c.r, c.in), c.out, c.in, c.k, {});
    const auto [lb, la] = svd_factors_of_product(b, a, c.out, c.r, c.in, c.k, {});
    ASSERT_EQ(lb.size(), size_t(c.out * c.k));
    ASSERT_EQ(la.size(), size_t(c.k * c.in));
    const Values want = product(fb, fa, c.out, c.k, c.in), got = product(lb, la, c.out, c.k, c.in);
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-10) << "B A at " << i;
    const int64_t rank = std::min({c.r, c.out, c.in}), rows = std::min({c.k, c.out, c.in});
    for (int64_t col = 0; col < c.k; ++col) {
      // Each pair, where B's column is not 0 (a singular value; these are distinct), is the
      // full SVD's up to its sign.
      double sign = 0;
      for (int64_t i = 0; i < c.out; ++i)
        sign += lb[size_t(i * c.k + col)] * fb[size_t(i * c.k + col)];
      sign = sign < 0 ? -1 : 1;
      for (int64_t i = 0; i < c.out; ++i)
        EXPECT_NEAR(lb[size_t(i * c.k + col)], col < rank ? sign * fb[size_t(i * c.k + col)] : 0,
                    1e-10)
            << "B[" << i << ", " << col << "]";
      if (col < rank) {
        for (int64_t j = 0; j < c.in; ++j)
          EXPECT_NEAR(la[size_t(col * c.in + j)], sign * fa[size_t(col * c.in + j)], 1e-10)
              << "A[" << col << ", " << j << "]";
      }
      for (int64_t other = 0; other <= col; ++other)
        EXPECT_NEAR(dot_rows(la, c.in, col, other), col == other && col < rows ? 1.0 : 0.0, 1e-10)
            << "A's rows " << col << " and " << other;
    }
  }
}

// PEFT's clamp on the factors of the product: every value cut to [-h, h], h the q-quantile of
// the unclamped values (here all of them: k is the product's rank, nothing is padding). Against
// the low-rank factors themselves, since a pair's sign moves the quantile of signed values.
TEST(MergeTasks, ClampCutsTheFactorsOfTheProductAtTheirQuantile) {
  const int64_t out = 8, r = 3, in = 6, k = 3;
  const Values b = normal_values(size_t(out * r), 3), a = normal_values(size_t(r * in), 4);
  const auto [ub, ua] = svd_factors_of_product(b, a, out, r, in, k, {});
  const auto [cb, ca] = svd_factors_of_product(b, a, out, r, in, k, 0.7);
  Values all = ub;
  all.insert(all.end(), ua.begin(), ua.end());
  std::sort(all.begin(), all.end());
  const double pos = 0.7 * double(all.size() - 1), lo = std::floor(pos);
  const double h = all[size_t(lo)] + (all[size_t(std::ceil(pos))] - all[size_t(lo)]) * (pos - lo);
  for (size_t i = 0; i < ub.size(); ++i)
    EXPECT_DOUBLE_EQ(cb[i], std::min(std::max(ub[i], -h), h)) << "B value " << i;
  for (size_t i = 0; i < ua.size(); ++i)
    EXPECT_DOUBLE_EQ(ca[i], std::min(std::max(ua[i], -h), h)) << "A value " << i;
}

TEST(MergeTasks, FactorsOfTheProductRefuseValuesThatDoNotFitTheShapes) {
  try {
    svd_factors_of_product(Values(6), Values(6), 3, 2, 4, 2, {});
    FAIL() << "6 values for [2, 4] taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("[3, 2] x [2, 4]"), std::string::npos) << e.what();
  }
}

}  // namespace
