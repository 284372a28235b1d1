// Unary kernels and their fused backward (grad * f'(x)). Transcendentals go through Eigen's
// array expressions, whose packet math vectorises exp/log/tanh/erf/sin/cos where std:: calls in a
// loop would not; the simple ops are plain loops the compiler vectorises on its own.
//
// GCC 12 reports false -W(maybe-)uninitialized errors inside its own AVX-512 intrinsics
// (_mm512_undefined_pd) when Eigen's pexp is inlined (GCC bug 105593); it is not about our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>
#include <cmath>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <unsupported/Eigen/SpecialFunctions>

#include "../portable/element_checks.h"
#include "../portable/element_ops.h"
#include "elementwise_loop.h"
#include "kernels.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"

namespace tessera::kernels::cpu {

namespace {

using cpu::check_cpu;
using cpu::map_runs;

using portable::kGeluCubic;
using portable::kInvSqrt2Pi;
using portable::kSqrt1_2;
using portable::kSqrt2OverPi;

using portable::unary_name;

template <class C>
using Arr = Eigen::Array<C, Eigen::Dynamic, 1>;

// Correctly rounded sqrt, vectorised. Eigen's packet sqrt under EIGEN_FAST_MATH is a hardware
// reciprocal estimate plus a Newton step (~3 ulp), and a std::sqrt loop does not vectorise
// while sqrt may set errno; the exact vector instructions are used directly instead.
template <class C>
void sqrt_exact(const C* x, C* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<C, float>) {
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(y + i, _mm512_sqrt_ps(_mm512_loadu_ps(x + i)));
  } else {
    for (; i + 8 <= n; i += 8)
      _mm512_storeu_pd(y + i, _mm512_sqrt_pd(_mm512_loadu_pd(x + i)));
  }
#elif defined(__AVX__)
  if constexpr (std::is_same_v<C, float>) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(y + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
  } else {
    for (; i + 4 <= n; i += 4)
      _mm256_storeu_pd(y + i, _mm256_sqrt_pd(_mm256_loadu_pd(x + i)));
  }
#endif
  for (; i < n; ++i)
    y[i] = std::sqrt(x[i]);
}

template <class C>
void unary_float(UnaryOp op, const C* x, C* y, int64_t n) {
  Eigen::Map<const Arr<C>> in(x, n);
  Eigen::Map<Arr<C>> out(y, n);
  switch (op) {
    case UnaryOp::Neg:
      for (int64_t i = 0; i < n; ++i)
        y[i] = -x[i];
      return;
    case UnaryOp::Exp:
      out = in.exp();
      return;
    case UnaryOp::Log:
      out = in.log();
      return;
    case UnaryOp::Sqrt:
      sqrt_exact(x, y, n);
      return;
    case UnaryOp::Rsqrt:
      // 1/sqrt rather than the hardware estimate: within an ulp, like torch.rsqrt.
      sqrt_exact(x, y, n);
      out = out.inverse();
      return;
    case UnaryOp::Tanh:
      out = in.tanh();
      return;
    case UnaryOp::Sigmoid:
      out = (C(1) + (-in).exp()).inverse();
      return;
    case UnaryOp::Relu:
      // NaN < 0 is false, so NaN propagates as in PyTorch.
      for (int64_t i = 0; i < n; ++i)
        y[i] = x[i] < C(0) ? C(0) : x[i];
      return;
    case UnaryOp::Gelu:
      out = C(0.5) * in * (C(1) + (in * C(kSqrt1_2)).erf());
      return;
    case UnaryOp::GeluTanh:
      out = C(0.5) * in * (C(1) + (C(kSqrt2OverPi) * (in + C(kGeluCubic) * in.cube())).tanh());
      return;
    case UnaryOp::Silu:
      out = in / (C(1) + (-in).exp());
      return;
    case UnaryOp::Abs:
      for (int64_t i = 0; i < n; ++i)
        y[i] = std::abs(x[i]);
      return;
    case UnaryOp::Sin:
      out = in.sin();
      return;
    case UnaryOp::Cos:
      out = in.cos();
      return;
    case UnaryOp::Square:
      for (int64_t i = 0; i < n; ++i)
        y[i] = x[i] * x[i];
      return;
    case UnaryOp::Reciprocal:
      for (int64_t i = 0; i < n; ++i)
        y[i] = C(1) / x[i];
      return;
  }
}

template <class C>
void unary_int(UnaryOp op, const C* x, C* y, int64_t n) {
  // Unsigned arithmetic wraps like PyTorch's integer ops instead of being undefined.
  using U = std::make_unsigned_t<C>;
  switch (op) {
    case UnaryOp::Neg:
      for (int64_t i = 0; i < n; ++i)
        y[i] = C(U(0) - U(x[i]));
      return;
    case UnaryOp::Abs:
      for (int64_t i = 0; i < n; ++i)
        y[i] = x[i] < 0 ? C(U(0) - U(x[i])) : x[i];
      return;
    case UnaryOp::Square:
      for (int64_t i = 0; i < n; ++i)
        y[i] = C(U(x[i]) * U(x[i]));
      return;
    case UnaryOp::Relu:
      for (int64_t i = 0; i < n; ++i)
        y[i] = x[i] < 0 ? C(0) : x[i];
      return;
    default:
      TESSERA_FAIL(unary_name(op), ": not defined for integer tensors");
  }
}

// y = g * f'(x). Where f'(x) reuses f(x), f(x) is written to y first and refined in place so that
// no transcendental is evaluated twice.
template <class C>
void unary_backward_float(UnaryOp op, const C* g, const C* x, C* y, int64_t n) {
  Eigen::Map<const Arr<C>> gr(g, n), in(x, n);
  Eigen::Map<Arr<C>> out(y, n);
  switch (op) {
    case UnaryOp::Neg:
      for (int64_t i = 0; i < n; ++i)
        y[i] = -g[i];
      return;
    case UnaryOp::Exp:
      out = gr * in.exp();
      return;
    case UnaryOp::Log:
      for (int64_t i = 0; i < n; ++i)
        y[i] = g[i] / x[i];
      return;
    case UnaryOp::Sqrt:
      sqrt_exact(x, y, n);
      out = C(0.5) * gr / out;
      return;
    case UnaryOp::Rsqrt:
      sqrt_exact(x, y, n);
      out = C(-0.5) * gr / (in * out);
      return;
    case UnaryOp::Tanh:
      out = in.tanh();
      out = gr * (C(1) - out.square());
      return;
    case UnaryOp::Sigmoid:
      out = (C(1) + (-in).exp()).inverse();
      out = gr * out * (C(1) - out);
      return;
    case UnaryOp::Relu:
      for (int64_t i = 0; i < n; ++i)
        y[i] = x[i] <= C(0) ? C(0) : g[i];  // a NaN passes the gradient, as in torch
      return;
    case UnaryOp::Gelu:
      // d/dx x*Phi(x) = Phi(x) + x*phi(x).
      out = C(0.5) * (C(1) + (in * C(kSqrt1_2)).erf());
      out = gr * (out + in * (C(-0.5) * in.square()).exp() * C(kInvSqrt2Pi));
      return;
    case UnaryOp::GeluTanh:
      out = (C(kSqrt2OverPi) * (in + C(kGeluCubic) * in.cube())).tanh();
      out = gr * (C(0.5) * (C(1) + out) + C(0.5) * in * (C(1) - out.square()) * C(kSqrt2OverPi) *
                                              (C(1) + C(3 * kGeluCubic) * in.square()));
      return;
    case UnaryOp::Silu:
      out = (C(1) + (-in).exp()).inverse();
      out = gr * out * (C(1) + in * (C(1) - out));
      return;
    case UnaryOp::Abs:
      // sign(0) = 0, as in PyTorch.
      for (int64_t i = 0; i < n; ++i)
        y[i] = x[i] > C(0) ? g[i] : (x[i] < C(0) ? -g[i] : C(0));
      return;
    case UnaryOp::Sin:
      out = gr * in.cos();
      return;
    case UnaryOp::Cos:
      out = -gr * in.sin();
      return;
    case UnaryOp::Square:
      for (int64_t i = 0; i < n; ++i)
        y[i] = C(2) * x[i] * g[i];
      return;
    case UnaryOp::Reciprocal:
      for (int64_t i = 0; i < n; ++i)
        y[i] = -g[i] / (x[i] * x[i]);
      return;
  }
}

}  // namespace

Tensor unary(UnaryOp op, const Tensor& x) {
  const char* name = unary_name(op);
  check_cpu(name, x);
  const DType dt = x.dtype();
  portable::check_unary_dtype(name, op, x);
  Tensor out = empty(x.shape(), dt);
  dispatch_dtype(dt, [&]<class T>() {
    using C = compute_t<T>;
    if constexpr (std::is_floating_point_v<C>) {
      map_runs<T, T, 1>(out, {&x}, {x.strides()},
                        [op](const std::array<const C*, 1>& in, C* y, int64_t n) {
                          unary_float<C>(op, in[0], y, n);
                        });
    } else if constexpr (std::is_same_v<C, int64_t> || std::is_same_v<C, int32_t>) {
      map_runs<T, T, 1>(out, {&x}, {x.strides()},
                        [op](const std::array<const C*, 1>& in, C* y, int64_t n) {
                          unary_int<C>(op, in[0], y, n);
                        });
    }
  });
  return out;
}

Tensor unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x) {
  const char* name = unary_name(op);
  check_cpu(name, grad);
  check_cpu(name, x);
  portable::check_unary_backward(name, grad, x);
  const DType dt = promote_types(grad.dtype(), x.dtype());
  Tensor g = grad.to(dt), xc = x.to(dt);
  Tensor out = empty(x.shape(), dt);
  dispatch_dtype(dt, [&]<class T>() {
    using C = compute_t<T>;
    if constexpr (std::is_floating_point_v<C>) {
      map_runs<T, T, 2>(out, {&g, &xc}, {g.strides(), xc.strides()},
                        [op](const std::array<const C*, 2>& in, C* y, int64_t n) {
                          unary_backward_float<C>(op, in[0], in[1], y, n);
                        });
    }
  });
  return out;
}

}  // namespace tessera::kernels::cpu
