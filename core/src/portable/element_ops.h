#pragma once
// Private to core: the per-element formulas every device computes alike. The CPU kernels and the
// device kernels (portable/kernels.h, compiled for CUDA and for the host emulation) call these
// same functions, so an op means one thing everywhere; only how elements are visited differs.
// The CPU computes some transcendentals through Eigen's vectorised forms instead (see
// cpu/elementwise_unary.cpp), which agree with these within an ulp or two.
#include <Random123/philox.h>
#include <Random123/boxmuller.hpp>
#include <Random123/uniform.hpp>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "tessera/core/host_device.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/random.h"

namespace tessera::kernels::portable {

// +infinity of a floating type, callable from device code (std::numeric_limits is host-only
// there).
template <class C>
TESSERA_HOST_DEVICE inline C infinity() {
  return C(HUGE_VAL);
}

template <class C>
TESSERA_HOST_DEVICE constexpr bool is_nan(C v) {
  if constexpr (std::is_floating_point_v<C>) {
    return v != v;
  } else {
    (void)v;
    return false;
  }
}

template <BinaryOp kOp, class C>
TESSERA_HOST_DEVICE inline C apply_binary(C a, C b) {
  if constexpr (std::is_integral_v<C>) {
    // Unsigned arithmetic wraps like PyTorch's integer ops instead of being undefined.
    using U = std::make_unsigned_t<C>;
    if constexpr (kOp == BinaryOp::Add) return C(U(a) + U(b));
    if constexpr (kOp == BinaryOp::Sub) return C(U(a) - U(b));
    if constexpr (kOp == BinaryOp::Mul) return C(U(a) * U(b));
  } else {
    if constexpr (kOp == BinaryOp::Add) return a + b;
    if constexpr (kOp == BinaryOp::Sub) return a - b;
    if constexpr (kOp == BinaryOp::Mul) return a * b;
    if constexpr (kOp == BinaryOp::Div) return a / b;
    if constexpr (kOp == BinaryOp::Pow) return std::pow(a, b);
  }
  // maximum/minimum propagate NaN, like torch.maximum.
  if constexpr (kOp == BinaryOp::Maximum) return is_nan(a) || b < a ? a : b;
  if constexpr (kOp == BinaryOp::Minimum) return is_nan(a) || a < b ? a : b;
  return C(0);
}

// The runtime-op form, for device kernels: one instantiation per element type instead of one per
// op, and every thread of a launch takes the same branch. Integer types never see Div or Pow
// (rejected before launch).
template <class C>
TESSERA_HOST_DEVICE inline C binary_value(BinaryOp op, C a, C b) {
  switch (op) {
    case BinaryOp::Add:
      return apply_binary<BinaryOp::Add>(a, b);
    case BinaryOp::Sub:
      return apply_binary<BinaryOp::Sub>(a, b);
    case BinaryOp::Mul:
      return apply_binary<BinaryOp::Mul>(a, b);
    case BinaryOp::Div:
      return apply_binary<BinaryOp::Div>(a, b);
    case BinaryOp::Pow:
      return apply_binary<BinaryOp::Pow>(a, b);
    case BinaryOp::Maximum:
      return apply_binary<BinaryOp::Maximum>(a, b);
    case BinaryOp::Minimum:
      return apply_binary<BinaryOp::Minimum>(a, b);
  }
  return C(0);
}

template <CompareOp kOp, class C>
TESSERA_HOST_DEVICE inline bool apply_compare(C a, C b) {
  if constexpr (kOp == CompareOp::Eq) return a == b;
  if constexpr (kOp == CompareOp::Ne) return a != b;
  if constexpr (kOp == CompareOp::Lt) return a < b;
  if constexpr (kOp == CompareOp::Le) return a <= b;
  if constexpr (kOp == CompareOp::Gt) return a > b;
  if constexpr (kOp == CompareOp::Ge) return a >= b;
  return false;
}

template <class C>
TESSERA_HOST_DEVICE inline bool compare_value(CompareOp op, C a, C b) {
  switch (op) {
    case CompareOp::Eq:
      return a == b;
    case CompareOp::Ne:
      return a != b;
    case CompareOp::Lt:
      return a < b;
    case CompareOp::Le:
      return a <= b;
    case CompareOp::Gt:
      return a > b;
    case CompareOp::Ge:
      return a >= b;
  }
  return false;
}

inline constexpr double kSqrt1_2 = 0.70710678118654752440;      // 1/sqrt(2)
inline constexpr double kInvSqrt2Pi = 0.39894228040143267794;   // 1/sqrt(2*pi)
inline constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2/pi)
inline constexpr double kGeluCubic = 0.044715;

// f(x) for a floating compute type; the formulas of cpu/elementwise_unary.cpp.
template <class C>
TESSERA_HOST_DEVICE inline C unary_float(UnaryOp op, C x) {
  switch (op) {
    case UnaryOp::Neg:
      return -x;
    case UnaryOp::Exp:
      return std::exp(x);
    case UnaryOp::Log:
      return std::log(x);
    case UnaryOp::Sqrt:
      return std::sqrt(x);
    case UnaryOp::Rsqrt:
      return C(1) / std::sqrt(x);
    case UnaryOp::Tanh:
      return std::tanh(x);
    case UnaryOp::Sigmoid:
      return C(1) / (C(1) + std::exp(-x));
    case UnaryOp::Relu:
      return x < C(0) ? C(0) : x;  // NaN < 0 is false, so NaN propagates as in PyTorch
    case UnaryOp::Gelu:
      return C(0.5) * x * (C(1) + std::erf(x * C(kSqrt1_2)));
    case UnaryOp::GeluTanh:
      return C(0.5) * x * (C(1) + std::tanh(C(kSqrt2OverPi) * (x + C(kGeluCubic) * x * x * x)));
    case UnaryOp::Silu:
      return x / (C(1) + std::exp(-x));
    case UnaryOp::Abs:
      return std::abs(x);
    case UnaryOp::Sin:
      return std::sin(x);
    case UnaryOp::Cos:
      return std::cos(x);
    case UnaryOp::Square:
      return x * x;
    case UnaryOp::Reciprocal:
      return C(1) / x;
  }
  return x;
}

// f(x) for int32/int64: the ops exact on integers (others are rejected before launch).
template <class C>
TESSERA_HOST_DEVICE inline C unary_int(UnaryOp op, C x) {
  using U = std::make_unsigned_t<C>;
  switch (op) {
    case UnaryOp::Neg:
      return C(U(0) - U(x));
    case UnaryOp::Abs:
      return x < 0 ? C(U(0) - U(x)) : x;
    case UnaryOp::Square:
      return C(U(x) * U(x));
    case UnaryOp::Relu:
      return x < 0 ? C(0) : x;
    default:
      return x;
  }
}

// g * f'(x); the formulas of cpu/elementwise_unary.cpp.
template <class C>
TESSERA_HOST_DEVICE inline C unary_grad(UnaryOp op, C g, C x) {
  switch (op) {
    case UnaryOp::Neg:
      return -g;
    case UnaryOp::Exp:
      return g * std::exp(x);
    case UnaryOp::Log:
      return g / x;
    case UnaryOp::Sqrt:
      return C(0.5) * g / std::sqrt(x);
    case UnaryOp::Rsqrt:
      return C(-0.5) * g / (x * std::sqrt(x));
    case UnaryOp::Tanh: {
      const C t = std::tanh(x);
      return g * (C(1) - t * t);
    }
    case UnaryOp::Sigmoid: {
      const C s = C(1) / (C(1) + std::exp(-x));
      return g * s * (C(1) - s);
    }
    case UnaryOp::Relu:
      return x <= C(0) ? C(0) : g;  // a NaN passes the gradient, as in torch
    case UnaryOp::Gelu: {
      // d/dx x*Phi(x) = Phi(x) + x*phi(x).
      const C cdf = C(0.5) * (C(1) + std::erf(x * C(kSqrt1_2)));
      return g * (cdf + x * std::exp(C(-0.5) * x * x) * C(kInvSqrt2Pi));
    }
    case UnaryOp::GeluTanh: {
      const C t = std::tanh(C(kSqrt2OverPi) * (x + C(kGeluCubic) * x * x * x));
      return g * (C(0.5) * (C(1) + t) + C(0.5) * x * (C(1) - t * t) * C(kSqrt2OverPi) *
                                            (C(1) + C(3 * kGeluCubic) * x * x));
    }
    case UnaryOp::Silu: {
      const C s = C(1) / (C(1) + std::exp(-x));
      return g * s * (C(1) + x * (C(1) - s));
    }
    case UnaryOp::Abs:
      return x > C(0) ? g : (x < C(0) ? -g : C(0));  // sign(0) = 0, as in PyTorch
    case UnaryOp::Sin:
      return g * std::cos(x);
    case UnaryOp::Cos:
      return -g * std::sin(x);
    case UnaryOp::Square:
      return C(2) * x * g;
    case UnaryOp::Reciprocal:
      return -g / (x * x);
  }
  return g;
}

// One AdamW step of one element, in PyTorch's single-tensor order. The scalars are the
// AdamWStep's, already in T.
template <class T>
// `vmax` is null without amsgrad.
struct AdamWScalars {
  T decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps,
      l2_weight_decay;
  bool has_l2, maximize;
};
template <class T>
TESSERA_HOST_DEVICE inline void adamw_element(T& w, T& m, T& v, T* vmax, T g,
                                              const AdamWScalars<T>& s) {
  if (s.maximize) g = -g;
  if (s.has_l2) g += s.l2_weight_decay * w;
  w *= s.decay;
  m += s.one_minus_beta1 * (g - m);  // PyTorch's lerp
  v = s.beta2 * v + s.one_minus_beta2 * g * g;
  T second = v;
  if (vmax) {
    // torch.maximum: a NaN on either side wins, so a NaN is never forgotten.
    if (v != v || v > *vmax) *vmax = v;
    second = *vmax;
  }
  const T denom = std::sqrt(second) / s.bias_correction2_sqrt + s.eps;
  w -= s.step_size * (m / denom);
}

// One SGD step of one element; `buf` is null without momentum.
template <class T>
struct SgdScalars {
  T lr, momentum, weight_decay, one_minus_dampening;
  bool has_weight_decay, first, nesterov, maximize;
};
template <class T>
TESSERA_HOST_DEVICE inline void sgd_element(T& w, T* buf, T g, const SgdScalars<T>& s) {
  T d = s.maximize ? -g : g;
  if (s.has_weight_decay) d += s.weight_decay * w;
  if (buf) {
    *buf = s.first ? d : s.momentum * *buf + s.one_minus_dampening * d;
    d = s.nesterov ? d + s.momentum * *buf : *buf;
  }
  w -= s.lr * d;
}

// The Philox draw: element `i` (absolute stream position) of stream `kind` under `seed`. Uniform
// and Bernoulli use one 32-bit word per element (4 per counter block); Normal uses a Box-Muller
// pair per 2 elements. Counter-based, so any device computes any element without the others.
TESSERA_HOST_DEVICE inline r123::Philox4x32::ctr_type philox_block(uint64_t seed, RandomKind kind,
                                                                   uint64_t c) {
  r123::Philox4x32::key_type key = {{uint32_t(seed), uint32_t(seed >> 32)}};
  r123::Philox4x32::ctr_type ctr = {{uint32_t(c), uint32_t(c >> 32), uint32_t(kind), 0x7e55e7a}};
  return r123::Philox4x32()(ctr, key);
}

TESSERA_HOST_DEVICE inline double philox_value(uint64_t seed, RandomKind kind, double a, double b,
                                               uint64_t i) {
  switch (kind) {
    case RandomKind::Uniform: {
      auto r = philox_block(seed, kind, i >> 2);
      float u = r123::u01<float>(r.v[i & 3]);  // (0, 1]
      return a + (b - a) * (1.0 - double(u));  // [a, b)
    }
    case RandomKind::Bernoulli: {
      auto r = philox_block(seed, kind, i >> 2);
      float u = r123::u01<float>(r.v[i & 3]);
      return (1.0 - double(u)) < a ? 1.0 : 0.0;
    }
    case RandomKind::Normal: {
      auto r = philox_block(seed, kind, i >> 1);
      r123::float2 z = r123::boxmuller(r.v[0], r.v[1]);
      return a + b * double((i & 1) ? z.y : z.x);
    }
  }
  return 0;
}

// Element `i` of the draw rounded to the element type T. A uniform value lies in [a, b) before
// rounding, but rounding to T can reach b (1 - 2^-10 is 1 in bfloat16, so rand gave exactly 1
// about once in 512 draws there); that value becomes a, as PyTorch's uniform_ does, so the draw
// stays in [a, b) in every dtype.
template <class T>
TESSERA_HOST_DEVICE inline T philox_element(uint64_t seed, RandomKind kind, double a, double b,
                                            uint64_t i) {
  using C = compute_t<T>;
  const T v = T(C(philox_value(seed, kind, a, b, i)));
  if (kind == RandomKind::Uniform && C(v) == C(T(C(b)))) return T(C(a));
  return v;
}

}  // namespace tessera::kernels::portable
