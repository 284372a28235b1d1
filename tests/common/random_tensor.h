#pragma once
// Standard normal test inputs drawn from Generator(seed). The dtype has no default: which dtype a
// test computes in is part of what it tests, so every call names it.
#include <cstdint>
#include <vector>

#include "tessera/core/factory.h"
#include "tessera/core/random.h"

namespace tessera::testing {

inline Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype) {
  Generator gen(seed);
  return randn(shape, gen, dtype);
}

// The same draws times `scale`, multiplied in double and rounded to `dtype` once (large logits
// in float32 that are still exactly the double values rounded).
inline Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype, double scale) {
  std::vector<double> v = random_tensor(shape, seed, DType::Float64).to_vector<double>();
  for (double& x : v)
    x *= scale;
  return from_vector<double>(v, shape).to(dtype);
}

}  // namespace tessera::testing
