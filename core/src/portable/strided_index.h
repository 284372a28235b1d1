#pragma once
// Private to core: how a device thread finds its elements. A launch numbers the elements of the
// iteration shape 0..n-1 in row-major order; StridedIndex turns such a number into the element
// offset of each operand (its own strides, 0 along broadcast dims). Dims of size 1 are dropped
// and neighbours contiguous for every operand merged first (the rule of detail::for_each_run),
// so a contiguous operand costs one division per element, not one per dim.
#include <array>
#include <cstdint>

#include "tessera/core/error.h"
#include "tessera/core/host_device.h"
#include "tessera/core/shape.h"

namespace tessera::kernels::portable {

// Dims an iteration space may keep after merging; a kernel argument holds them by value.
inline constexpr int kMaxDims = 8;

template <int N>
struct StridedIndex {
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[N][kMaxDims] = {};

  TESSERA_HOST_DEVICE void offsets(int64_t i, int64_t (&off)[N]) const {
    for (int k = 0; k < N; ++k)
      off[k] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t q = i / sizes[d];
      const int64_t r = i - q * sizes[d];
      i = q;
      for (int k = 0; k < N; ++k)
        off[k] += r * strides[k][d];
    }
  }
};

template <int N>
StridedIndex<N> make_index(const char* op, const Shape& shape,
                           const std::array<const Shape*, N>& strides) {
  StridedIndex<N> ix;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = ix.ndim > 0;
    for (int k = 0; k < N && merge; ++k)
      merge = ix.strides[k][ix.ndim - 1] == (*strides[k])[d] * shape[d];
    if (merge) {
      ix.sizes[ix.ndim - 1] *= shape[d];
      for (int k = 0; k < N; ++k)
        ix.strides[k][ix.ndim - 1] = (*strides[k])[d];
      continue;
    }
    TESSERA_CHECK(ix.ndim < kMaxDims, op, ": shape ", shape_str(shape), " keeps more than ",
                  kMaxDims, " dims after merging contiguous ones; device kernels take at most ",
                  kMaxDims, " (make the tensor contiguous first)");
    ix.sizes[ix.ndim] = shape[d];
    for (int k = 0; k < N; ++k)
      ix.strides[k][ix.ndim] = (*strides[k])[d];
    ++ix.ndim;
  }
  return ix;
}

}  // namespace tessera::kernels::portable
