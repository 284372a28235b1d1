#pragma once
// Shared by the vocabulary-parallel loss tests.
#include <algorithm>
#include <vector>

#include "tessera/tessera.h"

namespace tessera::testing {

// Targets in [0, vocab) with every third row ignored.
inline Tensor targets(const Shape& s, int64_t vocab, int64_t ignore_index, uint64_t seed) {
  Generator g(seed);
  std::vector<double> u = rand(s, g, DType::Float64).to_vector<double>();
  std::vector<int64_t> t;
  for (size_t i = 0; i < u.size(); ++i)
    t.push_back(i % 3 == 1 ? ignore_index
                           : std::min<int64_t>(vocab - 1, int64_t(u[i] * double(vocab))));
  return from_vector<int64_t>(t, s);
}

}  // namespace tessera::testing
