#pragma once
// Shared by the layer tests: element-wise comparisons of tensors with tolerances (common/near.h)
// or exactly, and the names of a module's parameters in registration order.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/near.h"
#include "tessera/tessera.h"

namespace tessera::layers_test {

using tessera::testing::expect_near_all;

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
