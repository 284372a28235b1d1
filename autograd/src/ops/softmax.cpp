// Softmax and log-softmax keep only their output for backward: both gradients are functions of
// the output alone.
#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/kernels/nn.h"

namespace tessera {

namespace {

template <bool kLog>
class SoftmaxFn final : public autograd::Function {
 public:
  explicit SoftmaxFn(int64_t dim) : dim_(dim) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    Tensor y = kLog ? kernels::log_softmax(in[0], dim_) : kernels::softmax(in[0], dim_);
    save_for_backward({y});
    return {y};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& y = saved_tensors()[0];
    return {kLog ? kernels::log_softmax_backward(grads[0], y, dim_)
                 : kernels::softmax_backward(grads[0], y, dim_)};
  }

 private:
  int64_t dim_;
};

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  return autograd::Function::apply<SoftmaxFn<false>>({x}, dim)[0];
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  return autograd::Function::apply<SoftmaxFn<true>>({x}, dim)[0];
}

}  // namespace tessera
