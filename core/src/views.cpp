#include "tessera/core/kernels/views.h"

#include <algorithm>

namespace tessera::kernels {

Shape infer_shape(const Shape& shape, int64_t numel, const char* op) {
  Shape out = shape;
  int64_t infer = -1, known = 1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      TESSERA_CHECK(infer < 0, op, ": only one dim may be -1 in ", shape_str(shape));
      infer = int64_t(i);
    } else {
      TESSERA_CHECK(out[i] >= 0, op, ": invalid size in ", shape_str(shape));
      known *= out[i];
    }
  }
  if (infer >= 0) {
    TESSERA_CHECK(known != 0 && numel % known == 0, op, ": shape ", shape_str(shape),
                  " is invalid for ", numel, " elements");
    out[infer] = numel / known;
  }
  TESSERA_CHECK(shape_numel(out) == numel, op, ": shape ", shape_str(shape), " is invalid for ",
                numel, " elements");
  return out;
}

namespace {
// Strides for viewing (sizes, strides) as `shape` without copying, if possible (the algorithm
// PyTorch's computeStride uses: match chunks of contiguous old dims against new dims).
bool view_strides(const Shape& old_sizes, const Shape& old_strides, const Shape& shape,
                  Shape& out) {
  int64_t numel = shape_numel(old_sizes);
  out.assign(shape.size(), 0);
  if (numel == 0) {
    out = contiguous_strides(shape);
    return true;
  }
  // A 0-dim tensor's one element viewed as [1, 1, ...]: any strides address it.
  if (old_sizes.empty()) {
    out.assign(shape.size(), 1);
    return true;
  }
  int64_t view_d = int64_t(shape.size()) - 1;
  int64_t chunk_base_stride = old_strides.empty() ? 1 : old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = int64_t(old_sizes.size()) - 1; d >= 0; --d) {
    tensor_numel *= old_sizes[d];
    if (d == 0 ||
        (old_sizes[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) {
        chunk_base_stride = old_strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}
}  // namespace

Tensor view(const Tensor& x, const Shape& shape) {
  Shape s = infer_shape(shape, x.numel(), "view");
  Shape st;
  TESSERA_CHECK(view_strides(x.shape(), x.strides(), s, st), "view: cannot view ", x.str(),
                " with strides ", shape_str(x.strides()), " as ", shape_str(s),
                " without a copy; use reshape");
  return x.as_strided(s, st, x.storage_offset());
}

Tensor reshape(const Tensor& x, const Shape& shape) {
  Shape s = infer_shape(shape, x.numel(), "reshape");
  Shape st;
  if (view_strides(x.shape(), x.strides(), s, st)) return x.as_strided(s, st, x.storage_offset());
  Tensor c = x.clone();
  return c.as_strided(s, contiguous_strides(s), 0);
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  TESSERA_CHECK(x.dim() > 0, "narrow() cannot be applied to a 0-dim tensor ", x.str());
  dim = wrap_dim(dim, x.dim(), "narrow");
  int64_t n = x.size(dim);
  if (start < 0) start += n;
  TESSERA_CHECK(start >= 0 && length >= 0 && start + length <= n, "narrow: [", start, ", ",
                start + length, ") is out of range for dim ", dim, " of size ", n, " in ", x.str());
  Shape sizes = x.shape();
  sizes[dim] = length;
  int64_t off = x.storage_offset() + (length > 0 ? start * x.stride(dim) : 0);
  return x.as_strided(sizes, x.strides(), off);
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  TESSERA_CHECK(x.dim() > 0, "slice() cannot be applied to a 0-dim tensor ", x.str());
  dim = wrap_dim(dim, x.dim(), "slice");
  TESSERA_CHECK(step > 0, "slice: step must be positive, got ", step);
  int64_t n = x.size(dim);
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape sizes = x.shape(), strides = x.strides();
  sizes[dim] = (end - start + step - 1) / step;
  int64_t off = x.storage_offset() + (sizes[dim] > 0 ? start * strides[dim] : 0);
  strides[dim] *= step;
  return x.as_strided(sizes, strides, off);
}

Tensor select(const Tensor& x, int64_t dim, int64_t index) {
  TESSERA_CHECK(x.dim() > 0, "select() cannot be applied to a 0-dim tensor ", x.str());
  dim = wrap_dim(dim, x.dim(), "select");
  int64_t n = x.size(dim);
  TESSERA_CHECK(index >= -n && index < n, "select: index ", index, " out of range for dim ", dim,
                " of size ", n);
  if (index < 0) index += n;
  Shape sizes = x.shape(), strides = x.strides();
  int64_t off = x.storage_offset() + index * strides[dim];
  sizes.erase(sizes.begin() + dim);
  strides.erase(strides.begin() + dim);
  return x.as_strided(sizes, strides, off);
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  d0 = wrap_dim(d0, x.dim(), "transpose");
  d1 = wrap_dim(d1, x.dim(), "transpose");
  if (x.dim() == 0) return x.as_strided({}, {}, x.storage_offset());  // dims 0 and -1: itself
  Shape sizes = x.shape(), strides = x.strides();
  std::swap(sizes[d0], sizes[d1]);
  std::swap(strides[d0], strides[d1]);
  return x.as_strided(sizes, strides, x.storage_offset());
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  TESSERA_CHECK(int64_t(dims.size()) == x.dim(), "permute: ", dims.size(),
                " dims given for a tensor of ", x.dim(), " dims");
  Shape sizes(dims.size()), strides(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrap_dim(dims[i], x.dim(), "permute");
    TESSERA_CHECK(!seen[d], "permute: dim ", d, " repeated in ", shape_str(dims));
    seen[d] = true;
    sizes[i] = x.size(d);
    strides[i] = x.stride(d);
  }
  return x.as_strided(sizes, strides, x.storage_offset());
}

Tensor expand(const Tensor& x, const Shape& shape) {
  TESSERA_CHECK(shape.size() >= size_t(x.dim()), "expand: cannot expand ", x.str(), " to ",
                shape_str(shape), " (fewer dims)");
  size_t lead = shape.size() - size_t(x.dim());
  Shape sizes(shape.size()), strides(shape.size(), 0);
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i < lead) {
      TESSERA_CHECK(shape[i] >= 0, "expand: -1 not allowed for new leading dims");
      sizes[i] = shape[i];
      continue;
    }
    int64_t cur = x.size(int64_t(i - lead));
    int64_t want = shape[i] == -1 ? cur : shape[i];
    TESSERA_CHECK(cur == want || cur == 1, "expand: cannot expand ", x.str(), " to ",
                  shape_str(shape), " (dim ", i, ": ", cur, " -> ", want, ")");
    sizes[i] = want;
    strides[i] = cur == want ? x.stride(int64_t(i - lead)) : 0;
  }
  return x.as_strided(sizes, strides, x.storage_offset());
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim() + 1, "unsqueeze");
  Shape sizes = x.shape(), strides = x.strides();
  int64_t st = dim < x.dim() ? x.stride(dim) * x.size(dim) : 1;
  sizes.insert(sizes.begin() + dim, 1);
  strides.insert(strides.begin() + dim, st);
  return x.as_strided(sizes, strides, x.storage_offset());
}

Tensor squeeze(const Tensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim(), "squeeze");
  if (x.dim() == 0 || x.size(dim) != 1)
    return x.as_strided(x.shape(), x.strides(), x.storage_offset());
  Shape sizes = x.shape(), strides = x.strides();
  sizes.erase(sizes.begin() + dim);
  strides.erase(strides.begin() + dim);
  return x.as_strided(sizes, strides, x.storage_offset());
}

Tensor squeeze(const Tensor& x) {
  Shape sizes, strides;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (x.size(d) == 1) continue;
    sizes.push_back(x.size(d));
    strides.push_back(x.stride(d));
  }
  return x.as_strided(sizes, strides, x.storage_offset());
}

Shape flatten_shape(const Shape& shape, int64_t start_dim, int64_t end_dim) {
  const int64_t nd = int64_t(shape.size());
  if (nd == 0) return {1};
  start_dim = wrap_dim(start_dim, nd, "flatten");
  end_dim = wrap_dim(end_dim, nd, "flatten");
  TESSERA_CHECK(start_dim <= end_dim, "flatten: start_dim ", start_dim, " > end_dim ", end_dim);
  Shape s(shape.begin(), shape.begin() + start_dim);
  int64_t m = 1;
  for (int64_t d = start_dim; d <= end_dim; ++d)
    m *= shape[size_t(d)];
  s.push_back(m);
  s.insert(s.end(), shape.begin() + end_dim + 1, shape.end());
  return s;
}

Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim) {
  return reshape(x, flatten_shape(x.shape(), start_dim, end_dim));
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  TESSERA_CHECK(x.dim() > 0, "chunk expects at least a 1-dimensional tensor, got ", x.str());
  TESSERA_CHECK(chunks > 0, "chunk: chunks must be positive, got ", chunks);
  dim = wrap_dim(dim, x.dim(), "chunk");
  int64_t n = x.size(dim);
  int64_t each = (n + chunks - 1) / chunks;
  std::vector<Tensor> out;
  if (each == 0) {
    // An empty dim gives `chunks` empty pieces, as in PyTorch (any number of them sums to 0).
    for (int64_t i = 0; i < chunks; ++i)
      out.push_back(narrow(x, dim, 0, 0));
    return out;
  }
  for (int64_t start = 0; start < n; start += each)
    out.push_back(narrow(x, dim, start, std::min(each, n - start)));
  return out;
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  TESSERA_CHECK(x.dim() > 0, "split expects at least a 1-dimensional tensor, got ", x.str());
  dim = wrap_dim(dim, x.dim(), "split");
  int64_t total = 0;
  for (int64_t s : sizes)
    total += s;
  TESSERA_CHECK(total == x.size(dim), "split: sizes ", shape_str(sizes), " sum to ", total,
                " but dim ", dim, " has size ", x.size(dim));
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t s : sizes) {
    out.push_back(narrow(x, dim, start, s));
    start += s;
  }
  return out;
}

}  // namespace tessera::kernels
