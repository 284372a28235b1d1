#pragma once
// The token batches of the parity tests: each row follows x' = (5x + 3) mod V from a start that
// depends only on (step, row), so every rank builds the same global batch without communicating
// and the model has something to learn.
#include <cstdint>
#include <vector>

#include "tessera/core/factory.h"

namespace tessera::testing {

inline uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

struct Batch {
  Tensor ids, targets;  // int64 [rows, seq]
};

inline Batch affine_batch(int step, int64_t rows, int64_t seq, int64_t vocab) {
  std::vector<int64_t> ids, targets;
  for (int64_t b = 0; b < rows; ++b) {
    int64_t x = int64_t(splitmix(uint64_t(step) * 1009 + uint64_t(b)) % uint64_t(vocab));
    for (int64_t t = 0; t < seq; ++t) {
      ids.push_back(x);
      x = (5 * x + 3) % vocab;
      targets.push_back(x);
    }
  }
  return {from_vector<int64_t>(ids, {rows, seq}), from_vector<int64_t>(targets, {rows, seq})};
}

}  // namespace tessera::testing
