// Embedding lookup and its backward: compositions of index_select and index_add shared with
// devices (portable/composite.h).
#include "../portable/composite.h"
#include "kernels.h"

namespace tessera::kernels::cpu {

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  return portable::embedding(weight, indices);
}

Tensor embedding_backward(const Tensor& grad_out, const Tensor& indices, int64_t num_embeddings) {
  return portable::embedding_backward(grad_out, indices, num_embeddings);
}

}  // namespace tessera::kernels::cpu
