#pragma once
// What the optimizer tests share: double-precision vectors, parameters made from them, gradients
// set by hand, and element-wise comparison against a reference update (common/near.h).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/near.h"
#include "tessera/tessera.h"

namespace tessera::optim_test {

using Vec = std::vector<double>;

inline Vec random_vec(size_t n, uint64_t seed) {
  Generator gen(seed);
  return randn({int64_t(n)}, gen, DType::Float64).to_vector<double>();
}

inline Parameter make_param(const Vec& v, DType dtype = DType::Float64) {
  return Parameter(from_vector<double>(v).to(dtype));
}

inline void set_grad(Parameter& p, const Vec& g) {
  Tensor leaf = p.local();
  leaf.set_grad(from_vector<double>(g).to(p.dtype()));
}

using tessera::testing::expect_near_all;

}  // namespace tessera::optim_test
