#pragma once
// Element-wise comparison of two tensors of one shape: |got - want| <= tol * (1 + |want|), so
// tol is relative for large values and absolute near zero. Names the first element off.
#include <gtest/gtest.h>

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

}  // namespace tessera::testing
