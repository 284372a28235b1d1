#pragma once
// Tensors whose elements are arbitrary bit patterns (NaN payloads, infinities, subnormals,
// negative zeros, every integer), each a function of (seed, element index) alone: a copy that
// changes any bit of any element shows, and another program can recompute the values
// (tests/python/check_safetensors.py has the same rule).
#include <cstdint>
#include <cstring>
#include <vector>

#include "tessera/core/factory.h"

namespace tessera::testing {

// splitmix64's finalizer of seed * golden + i.
inline uint64_t pattern_bits(uint64_t seed, uint64_t i) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + i;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Element i's bytes: the low element_size(dt) bytes of pattern_bits(seed, i) in little-endian
// order, except bool, which is its lowest bit (other bytes are not valid bools).
inline std::vector<unsigned char> pattern_bytes(DType dt, uint64_t seed, int64_t numel) {
  const size_t es = element_size(dt);
  std::vector<unsigned char> out(size_t(numel) * es);
  for (int64_t i = 0; i < numel; ++i) {
    uint64_t b = pattern_bits(seed, uint64_t(i));
    if (dt == DType::Bool) b &= 1;
    for (size_t k = 0; k < es; ++k)
      out[size_t(i) * es + k] = static_cast<unsigned char>(b >> (8 * k));
  }
  return out;
}

// A contiguous CPU tensor holding pattern_bytes(dt, seed, numel) in row-major order.
inline Tensor pattern_tensor(const Shape& shape, DType dt, uint64_t seed) {
  Tensor t = empty(shape, dt);
  const std::vector<unsigned char> bytes = pattern_bytes(dt, seed, t.numel());
  if (!bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size());
  return t;
}

// The bytes of a contiguous CPU tensor.
inline std::vector<unsigned char> raw_bytes(const Tensor& t) {
  TESSERA_CHECK(t.is_contiguous(), "raw_bytes of a non-contiguous ", t.str());
  const auto* p = static_cast<const unsigned char*>(t.raw_data());
  return p ? std::vector<unsigned char>(p, p + t.nbytes()) : std::vector<unsigned char>();
}

}  // namespace tessera::testing
