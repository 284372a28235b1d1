#pragma once
// Shared by the layer tests: element-wise comparisons of tensors with tolerances or exactly, and
// the names of a module's parameters in registration order.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tessera/tessera.h"

namespace tessera::layers_test {

inline void expect_near_all(const Tensor& got, const std::vector<double>& want, double tol,
                            const std::string& what) {
  std::vector<double> g = got.to_vector<double>();
  ASSERT_EQ(g.size(), want.size()) << what;
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_NEAR(g[i], want[i], tol * (1.0 + std::abs(want[i]))) << what << " element " << i;
}

inline void expect_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  EXPECT_EQ(got.to_vector<double>(), want.to_vector<double>()) << what;
}

inline std::vector<std::string> names_of(Module& m) {
  std::vector<std::string> out;
  for (auto& [name, p] : m.named_parameters())
    out.push_back(name);
  return out;
}

}  // namespace tessera::layers_test
