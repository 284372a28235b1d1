// Differentiable dropout: the backward multiplies by the very mask the forward drew, so it needs
// neither the generator nor a second draw.
#include <type_traits>

#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"

namespace tessera {

namespace {

// grad * mask in the mask's dtype (16-bit dtypes multiply in float32 and round once).
Tensor apply_mask(const Tensor& grad, const Tensor& mask) {
  TESSERA_CHECK(grad.shape() == mask.shape(), "dropout backward: grad ", shape_str(grad.shape()),
                " does not match the mask ", shape_str(mask.shape()));
  return kernels::binary(kernels::BinaryOp::Mul, grad.to(mask.dtype()), mask);
}

class DropoutFunction final : public autograd::Function {
 public:
  DropoutFunction(double p, Generator& gen) : p_(p), gen_(&gen) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    kernels::DropoutResult r = kernels::dropout(in[0], p_, *gen_);
    gen_ = nullptr;  // the generator may not outlive the graph; only the mask is needed later
    save_for_backward({r.mask});
    return {r.out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    return {apply_mask(g[0], saved_tensors()[0])};
  }

 private:
  double p_;
  Generator* gen_;
};

}  // namespace

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  // p is validated even when it has no effect, so a bad value fails in evaluation too.
  TESSERA_CHECK(p >= 0 && p <= 1, "dropout: probability p must be in [0, 1], got ", p, " for x ",
                x.defined() ? shape_str(x.shape()) : std::string("undefined"));
  if (!training || p == 0) return x;
  // Everything dropped: zeros and a zero gradient, by multiplying as PyTorch does (no 1 / (1 - p)).
  if (p == 1) return mul(x, 0.0);
  return autograd::Function::apply<DropoutFunction>({x}, p, gen)[0];
}

}  // namespace tessera
