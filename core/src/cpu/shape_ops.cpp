// Concatenation and indexing along one dim. cat/stack copy each input into its window of the
// output through Tensor::copy_, which already handles any strides and dtype conversion.
// index_select/index_add view their operands as [outer, size, inner] and move whole inner
// blocks at a time.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/shape_ops.h"
#include "tessera/core/kernels/views.h"

namespace tessera::kernels::cpu {

namespace {

void check_same_device(const char* op, const std::vector<Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TESSERA_CHECK(tensors[i].defined(), op, ": tensor ", i, " is undefined");
    TESSERA_CHECK(tensors[i].device() == tensors[0].device(), op, ": tensor ", i, " is on ",
                  tensors[i].device().str(), " but tensor 0 is on ", tensors[0].device().str());
  }
}

DType common_dtype(const std::vector<Tensor>& tensors) {
  DType dt = tensors[0].dtype();
  for (const Tensor& t : tensors)
    dt = promote_types(dt, t.dtype());
  return dt;
}

// Index values as int64, each checked against `size`.
std::vector<int64_t> checked_indices(const char* op, const Tensor& index, int64_t size,
                                     int64_t dim) {
  TESSERA_CHECK(index.defined(), op, ": undefined index");
  TESSERA_CHECK(index.dtype() == DType::Int64 || index.dtype() == DType::Int32, op,
                ": index must be int64 or int32, got ", index.str());
  TESSERA_CHECK(index.dim() <= 1, op, ": index must be 1-D, got ", shape_str(index.shape()));
  std::vector<int64_t> idx = index.to_vector<int64_t>();
  for (size_t i = 0; i < idx.size(); ++i) {
    TESSERA_CHECK(idx[i] >= 0 && idx[i] < size, op, ": index ", idx[i], " at position ", i,
                  " is out of range for dim ", dim, " of size ", size);
  }
  return idx;
}

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
  TESSERA_CHECK(!tensors.empty(), "cat: expected a non-empty list of tensors");
  check_same_device("cat", tensors);
  const Tensor& first = tensors[0];
  TESSERA_CHECK(first.dim() > 0, "cat: zero-dimensional tensor 0 cannot be concatenated");
  dim = wrap_dim(dim, first.dim(), "cat");
  Shape out_shape = first.shape();
  out_shape[size_t(dim)] = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Shape& s = tensors[i].shape();
    bool ok = s.size() == out_shape.size();
    for (size_t d = 0; ok && d < s.size(); ++d)
      ok = int64_t(d) == dim || s[d] == first.size(d);
    TESSERA_CHECK(ok, "cat: tensor ", i, " has shape ", shape_str(s), " but tensor 0 has ",
                  shape_str(first.shape()), "; all sizes but dim ", dim, " must match");
    out_shape[size_t(dim)] += s[size_t(dim)];
  }
  Tensor out = empty(out_shape, TensorOptions(common_dtype(tensors), first.device()));
  int64_t offset = 0;
  for (const Tensor& t : tensors) {
    int64_t len = t.size(dim);
    if (len > 0) narrow(out, dim, offset, len).copy_(t);
    offset += len;
  }
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  TESSERA_CHECK(!tensors.empty(), "stack: expected a non-empty list of tensors");
  check_same_device("stack", tensors);
  const Shape& shape = tensors[0].shape();
  for (size_t i = 0; i < tensors.size(); ++i) {
    TESSERA_CHECK(tensors[i].shape() == shape, "stack: tensor ", i, " has shape ",
                  shape_str(tensors[i].shape()), " but tensor 0 has ", shape_str(shape),
                  "; all shapes must match");
  }
  dim = wrap_dim(dim, int64_t(shape.size()) + 1, "stack");
  Shape out_shape = shape;
  out_shape.insert(out_shape.begin() + dim, int64_t(tensors.size()));
  Tensor out = empty(out_shape, TensorOptions(common_dtype(tensors), tensors[0].device()));
  for (size_t i = 0; i < tensors.size(); ++i)
    select(out, dim, int64_t(i)).copy_(tensors[i]);
  return out;
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  TESSERA_CHECK(x.defined(), "index_select: undefined input");
  TESSERA_CHECK(x.device().is_cpu(), "index_select: the CPU kernel got ", x.str());
  // A 0-d tensor behaves as 1-D of size 1, as in PyTorch.
  if (x.dim() == 0) return view(index_select(view(x, {1}), 0, index), {});
  dim = wrap_dim(dim, x.dim(), "index_select");
  std::vector<int64_t> idx = checked_indices("index_select", index, x.size(dim), dim);
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
  std::vector<int64_t> idx = checked_indices("index_add", index, shape[size_t(dim)], dim);
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
