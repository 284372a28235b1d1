// Differentiable RMSNorm and LayerNorm. The forward keeps the per-row statistics the kernel
// returns, so the backward never recomputes a reduction over the row.
#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"

namespace tessera {

namespace {

// A parameter gradient in the parameter's own dtype (the kernels accumulate in float64 and
// cannot know, for instance, a bias's dtype).
Tensor as_param_grad(const Tensor& grad, const Tensor& param) {
  if (!grad.defined() || !param.defined()) return Tensor();
  return grad.to(param.dtype());
}

class RmsNormFunction final : public autograd::Function {
 public:
  explicit RmsNormFunction(double eps) : eps_(eps) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    kernels::NormResult r = kernels::rms_norm(in[0], in[1], eps_);
    save_for_backward({in[0], in[1], r.rstd});
    return {r.out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    const std::vector<Tensor>& s = saved_tensors();
    kernels::NormGrads grads = kernels::rms_norm_backward(g[0], s[0], s[1], s[2]);
    return {grads.grad_x, as_param_grad(grads.grad_weight, s[1])};
  }

 private:
  double eps_;
};

class LayerNormFunction final : public autograd::Function {
 public:
  explicit LayerNormFunction(double eps) : eps_(eps) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    kernels::NormResult r = kernels::layer_norm(in[0], in[1], in[2], eps_);
    save_for_backward({in[0], in[1], in[2], r.mean, r.rstd});
    return {r.out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    const std::vector<Tensor>& s = saved_tensors();
    kernels::NormGrads grads = kernels::layer_norm_backward(g[0], s[0], s[1], s[3], s[4]);
    return {grads.grad_x, as_param_grad(grads.grad_weight, s[1]),
            as_param_grad(grads.grad_bias, s[2])};
  }

 private:
  double eps_;
};

}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  return autograd::Function::apply<RmsNormFunction>({x, weight}, eps)[0];
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  return autograd::Function::apply<LayerNormFunction>({x, weight, bias}, eps)[0];
}

}  // namespace tessera
