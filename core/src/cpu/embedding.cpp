// Embedding lookup is index_select on the rows of the table, and its backward is index_add into
// a zero table. This file only adds the checks whose messages speak of the embedding (vocabulary
// size, indices tensor of any shape) before delegating.
#include <vector>

#include "kernels.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/core/kernels/shape_ops.h"
#include "tessera/core/kernels/views.h"

namespace tessera::kernels::cpu {

namespace {

// The indices as a flat int64 tensor, every value checked against the vocabulary size.
Tensor flat_indices(const char* op, const Tensor& indices, int64_t num_embeddings) {
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

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  TESSERA_CHECK(weight.defined() && weight.dim() == 2, "embedding: weight must be [V, D], got ",
                weight.defined() ? weight.str() : "undefined");
  Tensor flat = flat_indices("embedding", indices, weight.size(0));
  Shape out_shape = indices.shape();
  out_shape.push_back(weight.size(1));
  return view(index_select(weight, 0, flat), out_shape);
}

Tensor embedding_backward(const Tensor& grad_out, const Tensor& indices, int64_t num_embeddings) {
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
  return index_add({num_embeddings, d}, 0, flat, reshape(grad_out, {flat.numel(), d}));
}

}  // namespace tessera::kernels::cpu
