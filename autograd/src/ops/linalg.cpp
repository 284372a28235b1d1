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

// The fused low-rank linear (one dtype throughout): inputs x, weight, bias, a, b, x_lowrank.
class LowRankLinearFn final : public autograd::Function {
 public:
  explicit LowRankLinearFn(double scale) : scale_(scale) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    const Tensor& w = in[1];
    const Tensor& a = in[3];
    const Tensor& b = in[4];
    low_ = in[5].defined();
    const Tensor xl = low_ ? in[5] : x;
    const int64_t out = w.size(0), n = leading_numel(x);
    Tensor y = kernels::linear(x, w, in[2]).contiguous();
    Tensor y2 = kernels::view(y, {n, out});
    Tensor h = kernels::matmul(kernels::reshape(xl, {n, w.size(1)}), a, false, true);
    if (scale_ != 1.0) kernels::mul_scalar_(h, scale_);
    kernels::matmul_accumulate_(y2, h, b, 1.0, false, true);
    save_for_backward({x, w, a, b, xl, h});
    return {y};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& x = saved_tensors()[0];
    const Tensor& w = saved_tensors()[1];
    const Tensor& a = saved_tensors()[2];
    const Tensor& b = saved_tensors()[3];
    const Tensor& xl = saved_tensors()[4];
    const Tensor& h = saved_tensors()[5];
    const int64_t out = w.size(0), in = w.size(1), n = leading_numel(x);
    Tensor g2 = kernels::reshape(grads[0], {n, out}).contiguous();
    // Through h = s * (xl a^T): its gradient, then scaled like h.
    Tensor gh = kernels::matmul(g2, b);
    if (scale_ != 1.0) kernels::mul_scalar_(gh, scale_);
    Tensor gx, gw, gbias, ga, gb, gxl;
    const Tensor xl2 = kernels::reshape(xl, {n, in});
    if (needs_input_grad(1)) gw = kernels::matmul(g2, kernels::reshape(x, {n, in}), true, false);
    if (needs_input_grad(2)) gbias = kernels::sum(g2, {0});
    if (needs_input_grad(3)) ga = kernels::matmul(gh, xl2, true, false);
    // As (h^T g)^T: Eigen runs g^T h, whose output is only r wide, at 70% of the speed of the
    // transposed product (measured at n 1024, out 512, r 16), and the transpose is r x out.
    if (needs_input_grad(4))
      gb = kernels::transpose(kernels::matmul(h, g2, true, false), 0, 1).contiguous();
    if (needs_input_grad(0)) {
      gx = kernels::matmul(g2, w);
      if (!low_) kernels::matmul_accumulate_(gx, gh, a);
      gx = kernels::view(gx, x.shape());
    }
    if (low_ && needs_input_grad(5)) gxl = kernels::view(kernels::matmul(gh, a), xl.shape());
    return {gx, gw, gbias, ga, gb, gxl};
  }

 private:
  double scale_;
  bool low_ = false;
};

}  // namespace

Tensor linear_lowrank(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& a,
                      const Tensor& b, double scale, const Tensor& x_lowrank,
                      const LowRankRouting& routing) {
  TESSERA_CHECK(x.defined() && weight.defined() && a.defined() && b.defined() &&
                    weight.dim() == 2 && a.dim() == 2 && b.dim() == 2 && x.dim() >= 1 &&
                    x.size(-1) == weight.size(1) && a.size(1) == weight.size(1) &&
                    b.size(0) == weight.size(0) && a.size(0) == b.size(1),
                "linear_lowrank: input ", x.defined() ? shape_str(x.shape()) : "undefined",
                ", weight ", weight.defined() ? shape_str(weight.shape()) : "undefined", ", a ",
                a.defined() ? shape_str(a.shape()) : "undefined", " and b ",
                b.defined() ? shape_str(b.shape()) : "undefined",
                " do not fit (weight [out, in], a [r, in], b [out, r])");
  const Tensor& xl = x_lowrank.defined() ? x_lowrank : x;
  const DType dt = x.dtype();
  const bool fused = (dt == DType::Float32 || dt == DType::Float64) && weight.dtype() == dt &&
                     a.dtype() == dt && b.dtype() == dt && xl.dtype() == dt &&
                     (!bias.defined() || bias.dtype() == dt) && xl.shape() == x.shape();
  if (fused && !routing.defined())
    return autograd::Function::apply<LowRankLinearFn>({x, weight, bias, a, b, x_lowrank}, scale)[0];
  // Mixed dtypes (a bfloat16 base and float32 adapters), or a mixed batch: the update in a's
  // dtype, then added.
  Tensor low_in = xl.dtype() == a.dtype() ? xl : cast(xl, a.dtype());
  Tensor h = routing.defined() ? lowrank_down(low_in, a, routing) : linear(low_in, a);
  if (scale != 1.0) h = mul(h, scale);
  Tensor low = routing.defined() ? lowrank_up(h, b, routing) : linear(h, b);
  Tensor y = linear(x, weight, bias);
  return add(y, low.dtype() == y.dtype() ? low : cast(low, y.dtype()));
}

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
  // Two vectors: the dot product, a 0-dim tensor ([1, k] @ [k, 1] with both dims removed).
  if (a.dim() == 1 && b.dim() == 1) return reshape(matmul(unsqueeze(a, 0), unsqueeze(b, 1)), {});
  if (a.dim() == 1) return squeeze(matmul(unsqueeze(a, 0), b), -2);
  if (b.dim() == 1) return squeeze(matmul(a, unsqueeze(b, 1)), -1);
  return autograd::Function::apply<MatmulFn>({a, b})[0];
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return autograd::Function::apply<LinearFn>({x, weight, bias})[0];
}

}  // namespace tessera
