#pragma once
// Private to core: how a tensor that is written overlaps itself and the tensors it reads
// (PyTorch's MemOverlap), for the in-place kernels and Tensor::copy_. Loops write element after
// element, so a destination with two elements at one address cannot get one value per element,
// and a source whose bytes the destination covers may be read after it was overwritten.
#include <algorithm>
#include <utility>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::detail {

// Whether two elements of `t` share an address. The strides of every view but as_strided's nest
// (sorted, each exceeds the reach of the smaller ones), which proves there is none in O(ndim);
// other layouts are settled by listing the addresses.
inline bool has_internal_overlap(const Tensor& t) {
  if (t.numel() <= 1 || t.is_contiguous()) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with > 1 element
  for (size_t d = 0; d < t.strides().size(); ++d) {
    const int64_t size = t.sizes()[d], stride = t.strides()[d];
    if (size <= 1) continue;
    if (stride == 0) return true;
    dims.emplace_back(stride, size);
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the largest offset the dims sorted so far address
  bool nested = true;
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) {
      nested = false;
      break;
    }
    reach += (size - 1) * stride;
  }
  if (nested) return false;
  std::vector<int64_t> offsets{0};
  for (const auto& [stride, size] : dims) {
    const size_t n = offsets.size();
    for (int64_t i = 1; i < size; ++i)
      for (size_t k = 0; k < n; ++k)
        offsets.push_back(offsets[k] + i * stride);
  }
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end();
}

// Whether `a` and `b` are one view: same storage, offset, sizes, strides and dtype.
inline bool is_same_view(const Tensor& a, const Tensor& b) {
  return a.storage().is_same(b.storage()) && a.storage_offset() == b.storage_offset() &&
         a.dtype() == b.dtype() && a.sizes() == b.sizes() && a.strides() == b.strides();
}

// Whether writing `dst` element by element may change what `src` still has to give: they share
// storage and the bytes from first to last element of each meet, but they are not one view (an
// element that reads only itself is safe). O(ndim); it may say yes for interleaved views that
// never touch a common byte, which costs a copy, never a wrong result.
inline bool overlaps_partially(const Tensor& dst, const Tensor& src) {
  if (!dst.storage().is_same(src.storage()) || dst.numel() == 0 || src.numel() == 0) return false;
  if (is_same_view(dst, src)) return false;
  auto byte_range = [](const Tensor& t) {
    int64_t last = t.storage_offset();
    for (size_t d = 0; d < t.sizes().size(); ++d)
      last += (t.sizes()[d] - 1) * t.strides()[d];
    const int64_t es = int64_t(t.element_size());
    return std::pair<int64_t, int64_t>{t.storage_offset() * es, (last + 1) * es};
  };
  const auto [d0, d1] = byte_range(dst);
  const auto [s0, s1] = byte_range(src);
  return d0 < s1 && s0 < d1;
}

}  // namespace tessera::detail
