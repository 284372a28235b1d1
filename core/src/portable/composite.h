#pragma once
// Private to core: kernels that are compositions of other kernels and views, written once for
// every device. They touch no tensor data themselves: they check, shape and call the dispatching
// kernels (kernels::index_select, kernels::addmm, Tensor::copy_ ...), which run on the tensors'
// device. The CPU's kernel list and a device's table both point here.
#include <vector>

#include "element_checks.h"
#include "linalg_checks.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/linalg.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/core/kernels/shape_ops.h"
#include "tessera/core/kernels/views.h"

namespace tessera::kernels::portable {

inline void check_same_device(const char* op, const std::vector<Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TESSERA_CHECK(tensors[i].defined(), op, ": tensor ", i, " is undefined");
    TESSERA_CHECK(tensors[i].device() == tensors[0].device(), op, ": tensor ", i, " is on ",
                  tensors[i].device().str(), " but tensor 0 is on ", tensors[0].device().str());
  }
}

inline DType common_dtype(const std::vector<Tensor>& tensors) {
  DType dt = tensors[0].dtype();
  for (const Tensor& t : tensors)
    dt = promote_types(dt, t.dtype());
  return dt;
}

// PyTorch's legacy empty tensor: a 1-D tensor with no elements, which cat skips whatever the
// others' shapes, so that an accumulator started as empty(0) can be concatenated to.
inline bool cat_skips(const Tensor& t) {
  return t.dim() == 1 && t.size(0) == 0;
}

// cat and stack copy each input into its window of the output through Tensor::copy_, which
// handles any strides and dtype conversion on the output's device. Skipped inputs still take part
// in the result's dtype, as in PyTorch; when all are skipped the result is empty [0].
inline Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  TESSERA_CHECK(!tensors.empty(), "cat: expected a non-empty list of tensors");
  check_same_device("cat", tensors);
  for (size_t i = 0; i < tensors.size(); ++i)
    TESSERA_CHECK(tensors[i].dim() > 0, "cat: zero-dimensional tensor ", i,
                  " cannot be concatenated");
  const TensorOptions options(common_dtype(tensors), tensors[0].device());
  size_t ref = 0;
  while (ref < tensors.size() && cat_skips(tensors[ref]))
    ++ref;
  if (ref == tensors.size()) return empty({0}, options);
  const Tensor& first = tensors[ref];
  dim = wrap_dim(dim, first.dim(), "cat");
  Shape out_shape = first.shape();
  out_shape[size_t(dim)] = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (cat_skips(tensors[i])) continue;
    const Shape& s = tensors[i].shape();
    bool ok = s.size() == out_shape.size();
    for (size_t d = 0; ok && d < s.size(); ++d)
      ok = int64_t(d) == dim || s[d] == first.size(d);
    TESSERA_CHECK(ok, "cat: tensor ", i, " has shape ", shape_str(s), " but tensor ", ref, " has ",
                  shape_str(first.shape()), "; all sizes but dim ", dim, " must match");
    out_shape[size_t(dim)] += s[size_t(dim)];
  }
  Tensor out = empty(out_shape, options);
  int64_t offset = 0;
  for (const Tensor& t : tensors) {
    if (cat_skips(t)) continue;
    int64_t len = t.size(dim);
    if (len > 0) narrow(out, dim, offset, len).copy_(t);
    offset += len;
  }
  return out;
}

inline Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
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

// Embedding lookup is index_select on the rows of the table, and its backward is index_add into
// a zero table; these add the checks whose messages speak of the embedding first.
inline Tensor flat_indices(const char* op, const Tensor& indices, int64_t num_embeddings) {
  TESSERA_CHECK(indices.defined(), op, ": undefined indices");
  TESSERA_CHECK(indices.dtype() == DType::Int64 || indices.dtype() == DType::Int32, op,
                ": indices must be int64 or int32, got ", indices.str());
  Tensor flat = reshape(indices, {indices.numel()});
  std::vector<int64_t> v = flat.to_vector<int64_t>();
  for (size_t i = 0; i < v.size(); ++i) {
    TESSERA_CHECK(v[i] >= 0 && v[i] < num_embeddings, op, ": index ", v[i], " at position ", i,
                  " of indices ", shape_str(indices.shape()),
                  " is out of range for num_embeddings ", num_embeddings);
  }
  return flat;
}

inline Tensor embedding(const Tensor& weight, const Tensor& indices) {
  TESSERA_CHECK(weight.defined() && weight.dim() == 2, "embedding: weight must be [V, D], got ",
                weight.defined() ? weight.str() : "undefined");
  Tensor flat = flat_indices("embedding", indices, weight.size(0));
  Shape out_shape = indices.shape();
  out_shape.push_back(weight.size(1));
  return view(kernels::index_select(weight, 0, flat), out_shape);
}

inline Tensor embedding_backward(const Tensor& grad_out, const Tensor& indices,
                                 int64_t num_embeddings) {
  TESSERA_CHECK(grad_out.defined() && indices.defined(),
                "embedding_backward: undefined grad_out or indices");
  TESSERA_CHECK(grad_out.dim() == indices.dim() + 1, "embedding_backward: grad_out ",
                shape_str(grad_out.shape()), " must be indices ", shape_str(indices.shape()),
                " plus an embedding dim");
  Shape lead(grad_out.shape().begin(), grad_out.shape().end() - 1);
  TESSERA_CHECK(lead == indices.shape(), "embedding_backward: grad_out ",
                shape_str(grad_out.shape()), " does not match indices ", shape_str(indices.shape()),
                " (expected ", shape_str(indices.shape()), " + [D])");
  int64_t d = grad_out.size(-1);
  Tensor flat = flat_indices("embedding_backward", indices, num_embeddings);
  return kernels::index_add({num_embeddings, d}, 0, flat, reshape(grad_out, {flat.numel(), d}));
}

// x @ w^T + bias over the last dim of x, as one 2-D product.
inline Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias) {
  check_linear(x, w, bias);
  const int64_t in = w.size(1), out_features = w.size(0);
  const int64_t rows =
      in == 0 ? shape_numel(Shape(x.shape().begin(), x.shape().end() - 1)) : x.numel() / in;
  const Tensor x2 = reshape(x, {rows, in});
  const Tensor y = bias.defined() ? kernels::addmm(bias, x2, w, 1.0, 1.0, false, true)
                                  : kernels::matmul(x2, w, false, true);
  Shape out_shape = x.shape();
  out_shape.back() = out_features;
  return view(y, out_shape);
}

inline Tensor sum_to_shape(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  const std::vector<int64_t> dims = sum_to_shape_dims(x.shape(), shape);
  Tensor r = dims.empty() ? x : kernels::sum(x, dims, /*keepdim=*/true);
  if (r.dtype() != x.dtype()) r = r.to(x.dtype());
  return reshape(r, shape);
}

}  // namespace tessera::kernels::portable
