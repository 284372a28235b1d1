// Concatenation and indexing along one dim. cat/stack are compositions shared with devices
// (portable/composite.h).
// index_select/index_add view their operands as [outer, size, inner] and move whole inner
// blocks at a time.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../portable/composite.h"
#include "../portable/nn_checks.h"
#include "kernels.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/shape_ops.h"
#include "tessera/core/kernels/views.h"

namespace tessera::kernels::cpu {

namespace {

struct Blocks {
  int64_t outer = 1, inner = 1;
};

Blocks blocks(const Shape& shape, int64_t dim) {
  Blocks b;
  for (int64_t i = 0; i < dim; ++i)
    b.outer *= shape[size_t(i)];
  for (size_t i = size_t(dim) + 1; i < shape.size(); ++i)
    b.inner *= shape[i];
  return b;
}

// dst[o, k, :] = src[o, idx[k], :] on contiguous buffers, moving elements of type U (any type
// of the element's size: the bits are copied, not converted).
template <class U>
void gather_blocks(const U* src, U* dst, const Blocks& b, int64_t src_size,
                   const std::vector<int64_t>& idx) {
  const int64_t n = int64_t(idx.size());
  for (int64_t o = 0; o < b.outer; ++o) {
    for (int64_t k = 0; k < n; ++k) {
      const U* s = src + (o * src_size + idx[size_t(k)]) * b.inner;
      U* d = dst + (o * n + k) * b.inner;
      if (b.inner == 1)
        *d = *s;
      else
        std::memcpy(d, s, size_t(b.inner) * sizeof(U));
    }
  }
}

}  // namespace

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  return portable::cat(tensors, dim);
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  return portable::stack(tensors, dim);
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  TESSERA_CHECK(x.defined(), "index_select: undefined input");
  TESSERA_CHECK(x.device().is_cpu(), "index_select: the CPU kernel got ", x.str());
  // A 0-d tensor behaves as 1-D of size 1, as in PyTorch.
  if (x.dim() == 0) {
    portable::check_zero_dim_index_select(x, dim, index);
    return view(index_select(view(x, {1}), 0, index), {});
  }
  dim = wrap_dim(dim, x.dim(), "index_select");
  std::vector<int64_t> idx = portable::checked_indices("index_select", index, x.size(dim), dim);
  Shape out_shape = x.shape();
  out_shape[size_t(dim)] = int64_t(idx.size());
  Tensor out = empty(out_shape, x.dtype());
  if (out.numel() == 0) return out;
  if (!x.is_contiguous()) {
    // Strided source: let copy_ walk each selected slice rather than copying all of x.
    for (size_t k = 0; k < idx.size(); ++k)
      select(out, dim, int64_t(k)).copy_(select(x, dim, idx[k]));
    return out;
  }
  Blocks b = blocks(x.shape(), dim);
  const void* src = x.raw_data();
  void* dst = out.raw_data();
  switch (x.element_size()) {
    case 1:
      gather_blocks(static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), b, x.size(dim),
                    idx);
      break;
    case 2:
      gather_blocks(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), b, x.size(dim),
                    idx);
      break;
    case 4:
      gather_blocks(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), b, x.size(dim),
                    idx);
      break;
    case 8:
      gather_blocks(static_cast<const uint64_t*>(src), static_cast<uint64_t*>(dst), b, x.size(dim),
                    idx);
      break;
    default:
      TESSERA_FAIL("index_select: unsupported element size ", x.element_size(), " for ", x.str());
  }
  return out;
}

Tensor index_add(const Shape& shape, int64_t dim, const Tensor& index, const Tensor& src) {
  TESSERA_CHECK(src.defined(), "index_add: undefined source");
  TESSERA_CHECK(src.device().is_cpu(), "index_add: the CPU kernel got ", src.str());
  TESSERA_CHECK(src.dtype() != DType::Bool, "index_add: bool tensors cannot be added");
  if (shape.empty()) {
    return view(index_add({1}, 0, index, src.dim() == 0 ? view(src, {1}) : src), {});
  }
  dim = wrap_dim(dim, int64_t(shape.size()), "index_add");
  std::vector<int64_t> idx = portable::checked_indices("index_add", index, shape[size_t(dim)], dim);
  Shape expected = shape;
  expected[size_t(dim)] = int64_t(idx.size());
  TESSERA_CHECK(src.shape() == expected, "index_add: source ", shape_str(src.shape()),
                " does not match destination ", shape_str(shape), " with ", idx.size(),
                " indices along dim ", dim, " (expected ", shape_str(expected), ")");
  // 16-bit types accumulate in float32, so repeated indices do not round at every addition.
  DType acc_dtype = compute_dtype(src.dtype());
  Tensor acc = zeros(shape, acc_dtype);
  if (src.numel() == 0) return acc.to(src.dtype());
  Tensor s = src.contiguous();
  Blocks b = blocks(shape, dim);
  const int64_t n = int64_t(idx.size()), size = shape[size_t(dim)];
  dispatch_dtype(src.dtype(), [&]<class T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      using C = compute_t<T>;
      const T* ps = s.data<T>();
      C* pa = acc.data<C>();
      for (int64_t o = 0; o < b.outer; ++o) {
        for (int64_t k = 0; k < n; ++k) {
          const T* from = ps + (o * n + k) * b.inner;
          C* to = pa + (o * size + idx[size_t(k)]) * b.inner;
          for (int64_t i = 0; i < b.inner; ++i)
            to[i] += C(from[i]);
        }
      }
    }
  });
  return acc.to(src.dtype());
}

}  // namespace tessera::kernels::cpu
