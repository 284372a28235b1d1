#pragma once
// 16-bit floating types are storage formats: arithmetic converts to float32 and back with
// round-to-nearest-even, which is what every kernel does, on the host and on a device alike.
#include <cstdint>
#include <cstring>

#include "tessera/core/host_device.h"

namespace tessera {

TESSERA_HOST_DEVICE inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
TESSERA_HOST_DEVICE inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  TESSERA_HOST_DEVICE BFloat16(float f)
      : bits(from_float(f)) {}  // NOLINT: implicit like a numeric type
  TESSERA_HOST_DEVICE operator float() const { return bits_float(uint32_t(bits) << 16); }
  TESSERA_HOST_DEVICE static uint16_t from_float(float f) {
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
    uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return uint16_t((u + rounding) >> 16);
  }
};

struct Float16 {
  uint16_t bits = 0;
  Float16() = default;
  TESSERA_HOST_DEVICE Float16(float f) : bits(from_float(f)) {}  // NOLINT
  TESSERA_HOST_DEVICE operator float() const { return to_float(bits); }

  TESSERA_HOST_DEVICE static uint16_t from_float(float f) {
    uint32_t x = float_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
    if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflow to inf (incl. rounding)
    if (ax < 0x38800000u) {
      // Subnormal or zero in half: shift the mantissa (with implicit 1) and round to nearest even.
      if (ax < 0x33000000u) return uint16_t(sign);  // below half the smallest subnormal
      uint32_t exp = ax >> 23;
      uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
      uint32_t shift = 126u - exp;  // 113 - exp + 13
      uint32_t half_mant = mant >> shift;
      uint32_t rem = mant & ((1u << shift) - 1u);
      uint32_t halfway = 1u << (shift - 1u);
      if (rem > halfway || (rem == halfway && (half_mant & 1u))) ++half_mant;
      return uint16_t(sign | half_mant);
    }
    // Normal: rebias exponent, round mantissa from 23 to 10 bits (carry may bump the exponent).
    uint32_t r = ax - 0x38000000u;  // exponent bias 127 -> 15
    uint32_t rounding = 0xfffu + ((r >> 13) & 1u);
    r += rounding;
    return uint16_t(sign | (r >> 13));
  }
  TESSERA_HOST_DEVICE static float to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
      if (mant == 0) return bits_float(sign);
      // Subnormal: value = mant * 2^-24.
      float v = float(mant) * 5.9604644775390625e-8f;
      return sign ? -v : v;
    }
    if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
    return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  }
};

}  // namespace tessera
