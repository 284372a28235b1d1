#pragma once
// Element-wise comparison of two tensors of one shape: |got - want| <= tol * (1 + |want|), so
// tol is relative for large values and absolute near zero. Names the first element off.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "tessera/core/tensor.h"

namespace tessera::testing {

inline void expect_close(const Tensor& got, const Tensor& want, double tol,
                         const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": undefined";
  ASSERT_EQ(got.shape(), want.shape()) << what;
  auto g = got.to_vector<double>(), w = want.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_NEAR(g[i], w[i], tol * (1.0 + std::abs(w[i])))
        << what << " element " << i << " of " << shape_str(got.shape());
}

// The largest |a - b| over the elements of two tensors of one shape.
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  auto x = a.to_vector<double>(), y = b.to_vector<double>();
  double m = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i)
    m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

}  // namespace tessera::testing
