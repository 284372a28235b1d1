// Differentiable matrix products. Backward products read the saved operands through the
// kernel's trans flags, so no transposed copy is ever made; gradients of broadcast batch dims are
// summed back to each operand's shape.
#include "tessera/core/kernels/linalg.h"
#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/core/kernels/views.h"

namespace tessera {

namespace {

Tensor reduce_to(const Tensor& g, const Shape& shape) {
  return g.shape() == shape ? g : kernels::sum_to_shape(g, shape);
}

// Rows of x viewed as a matrix [rows, x.size(-1)]; explicit because a -1 cannot be inferred
// when the last dim is empty.
int64_t leading_numel(const Tensor& x) {
  return shape_numel(Shape(x.shape().begin(), x.shape().end() - 1));
}

int64_t batch_numel(const Tensor& x) {
  return shape_numel(Shape(x.shape().begin(), x.shape().end() - 2));
}

class MatmulFn final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    save_for_backward({in[0], in[1]});
    return {kernels::matmul(in[0], in[1])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& a = saved_tensors()[0];
    const Tensor& b = saved_tensors()[1];
    const Tensor& g = grads[0];
    Tensor ga, gb;
    if (needs_input_grad(0)) ga = reduce_to(kernels::matmul(g, b, false, true), a.shape());
    if (needs_input_grad(1)) {
      if (batch_numel(b) == 1 && a.dim() >= b.dim()) {
        // A weight shared across the batch: one [k, B*m] x [B*m, n] product sums the batch
        // inside the GEMM instead of materialising B partial gradients.
        int64_t k = a.size(-1), n = g.size(-1);
        Tensor a2 = kernels::reshape(a, {leading_numel(a), k});
        Tensor g2 = kernels::reshape(g, {leading_numel(g), n});
        gb = kernels::view(kernels::matmul(a2, g2, true, false), b.shape());
      } else {
        gb = reduce_to(kernels::matmul(a, g, true, false), b.shape());
      }
    }
    return {ga, gb};
  }
};

class LinearFn final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    save_for_backward({in[0], in[1]});
    return {kernels::linear(in[0], in[1], in[2])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& x = saved_tensors()[0];
    const Tensor& w = saved_tensors()[1];
    const int64_t out = w.size(0), in = w.size(1);
    Tensor g2 = kernels::reshape(grads[0], {leading_numel(grads[0]), out});
    Tensor gx, gw, gb;
    if (needs_input_grad(0)) gx = kernels::view(kernels::matmul(g2, w), x.shape());
    if (needs_input_grad(1))
      gw = kernels::matmul(g2, kernels::reshape(x, {leading_numel(x), in}), true, false);
    if (needs_input_grad(2)) gb = kernels::sum(g2, {0});
    return {gx, gw, gb};
  }
};

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  TESSERA_CHECK(a.defined() && b.defined(), "matmul: undefined operand");
  TESSERA_CHECK(a.dim() >= 1 && b.dim() >= 1, "matmul: operands must have at least 1 dim, got ",
                shape_str(a.shape()), " and ", shape_str(b.shape()));
  // Vectors follow torch.matmul: a 1-D a is a row [1, k], a 1-D b a column [k, 1], and the
  // added dim is removed from the result.
  int64_t kb = b.dim() == 1 ? b.size(0) : b.size(-2);
  TESSERA_CHECK(a.size(-1) == kb, "matmul: inner dimensions differ: a ", shape_str(a.shape()),
                " and b ", shape_str(b.shape()), " (a's last dim ", a.size(-1), " vs b's ",
                b.dim() == 1 ? "only" : "second-to-last", " dim ", kb, ")");
  if (a.dim() == 1) return squeeze(matmul(unsqueeze(a, 0), b), -2);
  if (b.dim() == 1) return squeeze(matmul(a, unsqueeze(b, 1)), -1);
  return autograd::Function::apply<MatmulFn>({a, b})[0];
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return autograd::Function::apply<LinearFn>({x, weight, bias})[0];
}

}  // namespace tessera
