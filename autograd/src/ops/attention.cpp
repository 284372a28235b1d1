// Differentiable rotary embedding and scaled dot-product attention.
#include <cmath>

#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"

namespace tessera {

namespace {

// cos/sin are fixed tables, not parameters: only x receives a gradient.
class RopeFunction final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    save_for_backward({in[1], in[2]});
    return {kernels::rope(in[0], in[1], in[2])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    const std::vector<Tensor>& s = saved_tensors();
    // A rotation's Jacobian is its transpose's inverse: the rotation by -angle.
    return {kernels::rope(g[0], s[0], s[1], /*inverse=*/true), Tensor(), Tensor()};
  }
};

class AttentionFunction final : public autograd::Function {
 public:
  AttentionFunction(bool causal, double scale) : causal_(causal), scale_(scale) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    kernels::AttentionResult r =
        kernels::scaled_dot_product_attention(in[0], in[1], in[2], causal_, scale_);
    save_for_backward({in[0], in[1], in[2], r.out, r.lse});
    return {r.out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    const std::vector<Tensor>& s = saved_tensors();
    kernels::AttentionGrads grads = kernels::scaled_dot_product_attention_backward(
        g[0], s[0], s[1], s[2], s[3], s[4], causal_, scale_);
    return {grads.dq, grads.dk, grads.dv};
  }

 private:
  bool causal_;
  double scale_;
};

}  // namespace

Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return autograd::Function::apply<RopeFunction>({x, cos, sin})[0];
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    double scale) {
  TESSERA_CHECK(q.defined() && q.dim() == 4, "scaled_dot_product_attention: q must be [B, H, T, D]",
                ", got ", q.defined() ? shape_str(q.shape()) : std::string("undefined"));
  if (scale <= 0) {
    const int64_t d = q.size(3);
    TESSERA_CHECK(d > 0, "scaled_dot_product_attention: default scale 1/sqrt(D) needs D > 0, q is ",
                  shape_str(q.shape()));
    scale = 1.0 / std::sqrt(double(d));
  }
  return autograd::Function::apply<AttentionFunction>({q, k, v}, causal, scale)[0];
}

}  // namespace tessera
