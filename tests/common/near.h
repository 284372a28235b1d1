#pragma once
// Element-wise comparison with a tolerance that is absolute near zero and relative for large
// values (|got - want| <= tol * (1 + |want|)), so that one tol serves references of any scale:
// the layer, norm, attention and optimizer tests all compare against hand-written formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::testing {

inline void expect_near_all(const std::vector<double>& got, const std::vector<double>& want,
                            double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::abs(want[i]))) << what << " element " << i;
}

inline void expect_near_all(const Tensor& got, const std::vector<double>& want, double tol,
                            const std::string& what) {
  expect_near_all(got.to_vector<double>(), want, tol, what);
}

}  // namespace tessera::testing
