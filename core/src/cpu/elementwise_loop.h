#pragma once
// Private to the cpu kernels: their input check (the reductions' too), and the elementwise
// kernels' driver that feeds a kernel written for contiguous arrays in the compute type (float
// for 16-bit dtypes) with data of any strides and dtype.
#include <algorithm>
#include <array>
#include <type_traits>

#include "../portable/elementwise.h"
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

using portable::broadcast_strides;

// One 1-D run of map_runs: direct when contiguous and unconverted, else through buffers.
template <class T, class TO, size_t N, class Kernel>
void map_run(TO* o, const std::array<const T*, N>& base, const detail::Run<N + 1>& r,
             const Kernel& kernel) {
  using C = compute_t<T>;
  using CO = compute_t<TO>;
  constexpr bool kInPlain = std::is_same_v<T, C>;
  constexpr bool kOutPlain = std::is_same_v<TO, CO>;
  std::array<const C*, N> ptr;
  if constexpr (kInPlain && kOutPlain) {
    bool direct = r.stride[0] == 1;
    for (size_t k = 0; k < N && direct; ++k)
      direct = r.stride[k + 1] == 1;
    if (direct) {
      for (size_t k = 0; k < N; ++k)
        ptr[k] = base[k] + r.offset[k + 1];
      kernel(ptr, o + r.offset[0], r.length);
      return;
    }
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
}

// Side of the square tiles a transposing map is cut into: kTile * kTile == kBlock.
inline constexpr int64_t kTile = 16;

// An iteration space shared by M operands, with size-1 dims dropped and neighbours merged where
// every operand is contiguous across them (the rule of detail::for_each_run).
template <size_t M>
struct Collapsed {
  Shape sizes;
  std::array<Shape, M> strides;
};

template <size_t M>
Collapsed<M> collapse(const Shape& shape, const std::array<const Shape*, M>& strides) {
  Collapsed<M> c;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = !c.sizes.empty();
    for (size_t k = 0; k < M && merge; ++k)
      merge = c.strides[k].back() == (*strides[k])[d] * shape[d];
    if (merge) {
      c.sizes.back() *= shape[d];
      for (size_t k = 0; k < M; ++k)
        c.strides[k].back() = (*strides[k])[d];
    } else {
      c.sizes.push_back(shape[d]);
      for (size_t k = 0; k < M; ++k)
        c.strides[k].push_back((*strides[k])[d]);
    }
  }
  return c;
}

// The dim to tile against the innermost one when some input is read across its rows: that
// input is strided along the innermost dim but unit-stride along another (a transpose or
// permute). -1 when every input streams along the innermost dim anyway.
template <size_t M>
int64_t transposed_dim(const Collapsed<M>& c) {
  const size_t nd = c.sizes.size();
  if (nd < 2) return -1;
  for (size_t k = 1; k < M; ++k) {
    const int64_t inner = c.strides[k][nd - 1];
    if (inner == 0 || inner == 1) continue;
    for (size_t d = 0; d + 1 < nd; ++d)
      if (c.strides[k][d] == 1) return int64_t(d);
  }
  return -1;
}

// A kernel called through a function pointer. The driver below is then compiled once per
// element type instead of once per kernel: its gathering, converting and tiling loops were most
// of the code (and of the compile time) of every elementwise op. The indirect call is made once
// per run or per block of kBlock elements, which costs nothing measurable.
template <class C, class CO, size_t N>
struct KernelRef {
  void* kernel;
  void (*call)(void* kernel, const std::array<const C*, N>& in, CO* out, int64_t n);
  void operator()(const std::array<const C*, N>& in, CO* out, int64_t n) const {
    call(kernel, in, out, n);
  }
};

template <class T, class TO, size_t N>
void map_runs_ref(const Tensor& out, const std::array<const Tensor*, N>& in,
                  const std::array<Shape, N>& in_strides,
                  KernelRef<compute_t<T>, compute_t<TO>, N> kernel);

// Calls kernel(const std::array<const C*, N>& in, CO* out, int64_t n) over every element of
// `out`, where C/CO are the compute types of T/TO, the inputs all have dtype T and are read
// through `in_strides` (laid over out's shape). Runs that are contiguous and need no conversion
// go to the kernel directly, in one call; the rest pass through small stack buffers. When an
// input is transposed relative to the output, the work is cut into kTile x kTile tiles so that
// both sides are read and written a cache line at a time instead of one element per line.
template <class T, class TO, size_t N, class Kernel>
void map_runs(const Tensor& out, const std::array<const Tensor*, N>& in,
              const std::array<Shape, N>& in_strides, Kernel&& kernel) {
  using C = compute_t<T>;
  using CO = compute_t<TO>;
  using K = std::remove_reference_t<Kernel>;
  const KernelRef<C, CO, N> ref{const_cast<void*>(static_cast<const void*>(&kernel)),
                                [](void* k, const std::array<const C*, N>& p, CO* q, int64_t n) {
                                  (*static_cast<K*>(k))(p, q, n);
                                }};
  map_runs_ref<T, TO, N>(out, in, in_strides, ref);
}

template <class T, class TO, size_t N>
void map_runs_ref(const Tensor& out, const std::array<const Tensor*, N>& in,
                  const std::array<Shape, N>& in_strides,
                  KernelRef<compute_t<T>, compute_t<TO>, N> kernel) {
  using C = compute_t<T>;
  using CO = compute_t<TO>;
  TO* const o = static_cast<TO*>(out.raw_data());
  std::array<const T*, N> base;
  std::array<const Shape*, N + 1> strides;
  strides[0] = &out.strides();
  for (size_t k = 0; k < N; ++k) {
    base[k] = static_cast<const T*>(in[k]->raw_data());
    strides[k + 1] = &in_strides[k];
  }
  if (out.numel() == 0) return;
  const Collapsed<N + 1> c = collapse<N + 1>(out.shape(), strides);
  const int64_t td = transposed_dim(c);
  if (td < 0) {
    std::array<const Shape*, N + 1> cs;
    for (size_t k = 0; k <= N; ++k)
      cs[k] = &c.strides[k];
    detail::for_each_run<N + 1>(
        c.sizes, cs, [&](const detail::Run<N + 1>& r) { map_run<T, TO, N>(o, base, r, kernel); });
    return;
  }
  const size_t nd = c.sizes.size();
  const int64_t rows = c.sizes[size_t(td)], cols = c.sizes[nd - 1];
  std::array<int64_t, N + 1> sr, sc;
  Shape outer;
  std::array<Shape, N + 1> outer_strides;
  for (size_t k = 0; k <= N; ++k) {
    sr[k] = c.strides[k][size_t(td)];
    sc[k] = c.strides[k][nd - 1];
  }
  for (size_t d = 0; d + 1 < nd; ++d) {
    if (int64_t(d) == td) continue;
    outer.push_back(c.sizes[d]);
    for (size_t k = 0; k <= N; ++k)
      outer_strides[k].push_back(c.strides[k][d]);
  }
  std::array<const Shape*, N + 1> os;
  for (size_t k = 0; k <= N; ++k)
    os[k] = &outer_strides[k];
  alignas(64) C buf[N][kBlock];
  alignas(64) CO obuf[kBlock];
  std::array<const C*, N> ptr;
  for (size_t k = 0; k < N; ++k)
    ptr[k] = buf[k];
  detail::for_each_run<N + 1>(outer, os, [&](const detail::Run<N + 1>& r) {
    for (int64_t e = 0; e < r.length; ++e) {
      for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
        const int64_t tr = std::min(kTile, rows - r0);
        for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
          const int64_t tc = std::min(kTile, cols - c0);
          for (size_t k = 0; k < N; ++k) {
            const T* p =
                base[k] + r.offset[k + 1] + e * r.stride[k + 1] + r0 * sr[k + 1] + c0 * sc[k + 1];
            const int64_t a = sr[k + 1], b = sc[k + 1];
            if (a == 1) {  // walk the input along its unit stride
              for (int64_t j = 0; j < tc; ++j)
                for (int64_t i = 0; i < tr; ++i)
                  buf[k][i * tc + j] = C(p[j * b + i]);
            } else {
              for (int64_t i = 0; i < tr; ++i)
                for (int64_t j = 0; j < tc; ++j)
                  buf[k][i * tc + j] = C(p[i * a + j * b]);
            }
          }
          kernel(ptr, obuf, tr * tc);
          TO* q = o + r.offset[0] + e * r.stride[0] + r0 * sr[0] + c0 * sc[0];
          for (int64_t i = 0; i < tr; ++i)
            for (int64_t j = 0; j < tc; ++j)
              q[i * sr[0] + j * sc[0]] = TO(obuf[i * tc + j]);
        }
      }
    }
  });
}

}  // namespace tessera::kernels::cpu
