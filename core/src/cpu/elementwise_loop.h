#pragma once
// Private to the cpu elementwise kernels: the driver that feeds a kernel written for contiguous
// arrays in the compute type (float for 16-bit dtypes) with data of any strides and dtype.
#include <algorithm>
#include <array>
#include <type_traits>

#include "tessera/core/detail/strided_loop.h"
#include "tessera/core/tensor.h"

namespace tessera::kernels::cpu {

// Element count a kernel sees at once when the data must be gathered or converted first: small
// enough for the buffers to stay in L1, large enough to amortise the call.
inline constexpr int64_t kBlock = 256;

inline void check_cpu(const char* op, const Tensor& t) {
  TESSERA_CHECK(t.defined(), op, ": got an undefined tensor");
  TESSERA_CHECK(t.device().is_cpu(), op, ": ", t.str(),
                " is not a cpu tensor; the cpu kernels need cpu inputs");
}

// Strides that read `t` as if it had been broadcast to `shape` (0 along broadcast dims).
inline Shape broadcast_strides(const Tensor& t, const Shape& shape) {
  Shape st(shape.size(), 0);
  const size_t lead = shape.size() - size_t(t.dim());
  for (size_t i = 0; i < size_t(t.dim()); ++i)
    if (t.sizes()[i] != 1) st[lead + i] = t.strides()[i];
  return st;
}

template <class T>
constexpr bool is_nan(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    return v != v;
  } else {
    (void)v;
    return false;
  }
}

// Calls kernel(const std::array<const C*, N>& in, CO* out, int64_t n) over every element of
// `out`, where C/CO are the compute types of T/TO, the inputs all have dtype T and are read
// through `in_strides` (laid over out's shape). Runs that are contiguous and need no conversion
// go to the kernel directly, in one call; the rest pass through small stack buffers.
template <class T, class TO, size_t N, class Kernel>
void map_runs(const Tensor& out, const std::array<const Tensor*, N>& in,
              const std::array<Shape, N>& in_strides, Kernel&& kernel) {
  using C = compute_t<T>;
  using CO = compute_t<TO>;
  constexpr bool kInPlain = std::is_same_v<T, C>;
  constexpr bool kOutPlain = std::is_same_v<TO, CO>;
  TO* const o = static_cast<TO*>(out.raw_data());
  std::array<const T*, N> base;
  std::array<const Shape*, N + 1> strides;
  strides[0] = &out.strides();
  for (size_t k = 0; k < N; ++k) {
    base[k] = static_cast<const T*>(in[k]->raw_data());
    strides[k + 1] = &in_strides[k];
  }
  detail::for_each_run<N + 1>(out.shape(), strides, [&](const detail::Run<N + 1>& r) {
    std::array<const C*, N> ptr;
    bool direct = kInPlain && kOutPlain && r.stride[0] == 1;
    for (size_t k = 0; k < N && direct; ++k)
      direct = r.stride[k + 1] == 1;
    if (direct) {
      if constexpr (kInPlain && kOutPlain) {
        for (size_t k = 0; k < N; ++k)
          ptr[k] = base[k] + r.offset[k + 1];
        kernel(ptr, o + r.offset[0], r.length);
      }
      return;
    }
    alignas(64) C buf[N][kBlock];
    alignas(64) CO obuf[kBlock];
    for (int64_t start = 0; start < r.length; start += kBlock) {
      const int64_t n = std::min(kBlock, r.length - start);
      for (size_t k = 0; k < N; ++k) {
        const int64_t s = r.stride[k + 1];
        const T* p = base[k] + r.offset[k + 1] + start * s;
        if constexpr (kInPlain) {
          if (s == 1) {
            ptr[k] = p;
            continue;
          }
        }
        if (s == 0) {
          std::fill(buf[k], buf[k] + n, C(p[0]));
        } else {
          for (int64_t i = 0; i < n; ++i)
            buf[k][i] = C(p[i * s]);
        }
        ptr[k] = buf[k];
      }
      const int64_t so = r.stride[0];
      TO* q = o + r.offset[0] + start * so;
      if constexpr (kOutPlain) {
        if (so == 1) {
          kernel(ptr, q, n);
          continue;
        }
      }
      kernel(ptr, obuf, n);
      for (int64_t i = 0; i < n; ++i)
        q[i * so] = TO(obuf[i]);
    }
  });
}

}  // namespace tessera::kernels::cpu
