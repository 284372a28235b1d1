#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/kernels/nn.h"

namespace tessera {

namespace {

// Inputs {indices, weight}; only the weight is differentiable.
class EmbeddingFn final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    save_for_backward({in[0]});
    num_embeddings_ = in[1].size(0);
    return {kernels::embedding(in[1], in[0])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& indices = saved_tensors()[0];
    return {Tensor(), kernels::embedding_backward(grads[0], indices, num_embeddings_)};
  }

 private:
  int64_t num_embeddings_ = 0;
};

}  // namespace

Tensor embedding(const Tensor& indices, const Tensor& weight) {
  TESSERA_CHECK(weight.defined() && weight.dim() == 2, "embedding: weight must be [V, D], got ",
                weight.defined() ? weight.str() : "undefined");
  return autograd::Function::apply<EmbeddingFn>({indices, weight})[0];
}

}  // namespace tessera
