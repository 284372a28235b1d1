// Differentiable elementwise ops. Broadcasting is undone in backward by sum_to_shape, and every
// gradient is cast back to its operand's dtype, so a float32 parameter combined with a float64
// tensor still receives a float32 gradient of its own shape.
#include <cmath>

#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"

namespace tessera {

namespace {

using kernels::BinaryOp;
using kernels::CompareOp;
using kernels::UnaryOp;

struct OperandMeta {
  Shape shape;
  DType dtype = DType::Float32;
};

OperandMeta meta_of(const Tensor& t) {
  return {t.shape(), t.dtype()};
}

// The gradient of a broadcast operand: summed back to its shape, in its dtype.
Tensor reduce_grad(const Tensor& g, const OperandMeta& m) {
  Tensor r = kernels::sum_to_shape(g, m.shape);
  return r.dtype() == m.dtype ? r : r.to(m.dtype);
}

Tensor zero_like_scalar(const Tensor& g) {
  return zeros({}, TensorOptions(g.dtype(), g.device()));
}

class BinaryFn final : public autograd::Function {
 public:
  explicit BinaryFn(BinaryOp op) : op_(op) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    a_ = meta_of(in[0]);
    b_ = meta_of(in[1]);
    Tensor out = kernels::binary(op_, in[0], in[1]);
    switch (op_) {
      case BinaryOp::Add:
      case BinaryOp::Sub:
        break;
      case BinaryOp::Pow:
        save_for_backward({in[0], in[1], out});
        break;
      default:
        save_for_backward({in[0], in[1]});
    }
    return {out};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    Tensor ga, gb;
    const bool need_a = needs_input_grad(0), need_b = needs_input_grad(1);
    switch (op_) {
      case BinaryOp::Add:
        if (need_a) ga = g;
        if (need_b) gb = g;
        break;
      case BinaryOp::Sub:
        if (need_a) ga = g;
        if (need_b) gb = kernels::unary(UnaryOp::Neg, g);
        break;
      case BinaryOp::Mul: {
        const Tensor& a = saved_tensors()[0];
        const Tensor& b = saved_tensors()[1];
        if (need_a) ga = kernels::binary(BinaryOp::Mul, g, b);
        if (need_b) gb = kernels::binary(BinaryOp::Mul, g, a);
        break;
      }
      case BinaryOp::Div: {
        const Tensor& a = saved_tensors()[0];
        const Tensor& b = saved_tensors()[1];
        Tensor g_over_b = kernels::binary(BinaryOp::Div, g, b);
        if (need_b) {
          // d(a/b)/db = -a/b^2 = -(g/b) * (a/b)
          Tensor q = kernels::binary(BinaryOp::Div, a, b);
          gb = kernels::unary(UnaryOp::Neg, kernels::binary(BinaryOp::Mul, g_over_b, q));
        }
        if (need_a) ga = g_over_b;
        break;
      }
      case BinaryOp::Pow: {
        const Tensor& a = saved_tensors()[0];
        const Tensor& b = saved_tensors()[1];
        const Tensor& out = saved_tensors()[2];
        if (need_a) {
          // b * a^(b-1); at b == 0 this is 0 even where a^(b-1) is infinite.
          Tensor d = kernels::binary(
              BinaryOp::Mul, b,
              kernels::binary(BinaryOp::Pow, a, kernels::binary_scalar(BinaryOp::Sub, b, 1)));
          d = kernels::where(kernels::compare_scalar(CompareOp::Eq, b, 0), zero_like_scalar(d), d);
          ga = kernels::binary(BinaryOp::Mul, g, d);
        }
        if (need_b) {
          // a^b * log(a); torch defines it as 0 where a == 0 and b >= 0 (the limit from a > 0).
          Tensor d = kernels::binary(BinaryOp::Mul, out, kernels::unary(UnaryOp::Log, a));
          Tensor a_zero = kernels::compare_scalar(CompareOp::Eq, a, 0);
          Tensor b_nonneg = kernels::compare_scalar(CompareOp::Ge, b, 0);
          Tensor limit = kernels::where(a_zero, b_nonneg, a_zero);  // a == 0 && b >= 0
          d = kernels::where(limit, zero_like_scalar(d), d);
          gb = kernels::binary(BinaryOp::Mul, g, d);
        }
        break;
      }
      case BinaryOp::Maximum:
      case BinaryOp::Minimum: {
        // The larger (smaller) operand takes the gradient, ties split it evenly, and an operand
        // that does not lose (a NaN beside anything) keeps it: torch's where(a == b, g / 2, g)
        // with zeros where a loses.
        const Tensor& a = saved_tensors()[0];
        const Tensor& b = saved_tensors()[1];
        const CompareOp a_loses = op_ == BinaryOp::Maximum ? CompareOp::Lt : CompareOp::Gt;
        const CompareOp b_loses = op_ == BinaryOp::Maximum ? CompareOp::Gt : CompareOp::Lt;
        Tensor tie = kernels::compare(CompareOp::Eq, a, b);
        Tensor half = kernels::binary_scalar(BinaryOp::Mul, g, 0.5);
        Tensor zero = zero_like_scalar(g);
        Tensor shared = kernels::where(tie, half, g);
        if (need_a) ga = kernels::where(kernels::compare(a_loses, a, b), zero, shared);
        if (need_b) gb = kernels::where(kernels::compare(b_loses, a, b), zero, shared);
        break;
      }
    }
    if (ga.defined()) ga = reduce_grad(ga, a_);
    if (gb.defined()) gb = reduce_grad(gb, b_);
    return {ga, gb};
  }

 private:
  BinaryOp op_;
  OperandMeta a_, b_;
};

// a op s with a scalar s (the scalar is a constant, not an input).
class ScalarFn final : public autograd::Function {
 public:
  ScalarFn(BinaryOp op, double s) : op_(op), s_(s) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    if (op_ == BinaryOp::Pow) save_for_backward({in[0]});
    return {kernels::binary_scalar(op_, in[0], s_)};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    switch (op_) {
      case BinaryOp::Add:
      case BinaryOp::Sub:
        return {g};
      case BinaryOp::Mul:
        return {kernels::binary_scalar(BinaryOp::Mul, g, s_)};
      case BinaryOp::Div:
        return {kernels::binary_scalar(BinaryOp::Div, g, s_)};
      case BinaryOp::Pow: {
        // d(a^s)/da = s * a^(s-1); exactly 0 for s == 0 (a^-1 may be infinite).
        if (s_ == 0) return {zeros_like(g)};
        const Tensor& a = saved_tensors()[0];
        Tensor d = s_ == 2
                       ? kernels::binary_scalar(BinaryOp::Mul, a, 2)
                       : kernels::binary_scalar(
                             BinaryOp::Mul, kernels::binary_scalar(BinaryOp::Pow, a, s_ - 1), s_);
        return {kernels::binary(BinaryOp::Mul, g, d)};
      }
      case BinaryOp::Maximum:
      case BinaryOp::Minimum:
        break;
    }
    TESSERA_FAIL("scalar op backward: unsupported op");
  }

 private:
  BinaryOp op_;
  double s_;
};

class UnaryFn final : public autograd::Function {
 public:
  explicit UnaryFn(UnaryOp op) : op_(op) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    // Neg's derivative does not depend on x: nothing to keep alive.
    if (op_ != UnaryOp::Neg) save_for_backward({in[0]});
    return {kernels::unary(op_, in[0])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    if (op_ == UnaryOp::Neg) return {kernels::unary(UnaryOp::Neg, grads[0])};
    return {kernels::unary_backward(op_, grads[0], saved_tensors()[0])};
  }

 private:
  UnaryOp op_;
};

class WhereFn final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    a_ = meta_of(in[1]);
    b_ = meta_of(in[2]);
    save_for_backward({in[0]});
    return {kernels::where(in[0], in[1], in[2])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    const Tensor& cond = saved_tensors()[0];
    Tensor zero = zero_like_scalar(g);
    Tensor ga, gb;
    if (needs_input_grad(1)) ga = reduce_grad(kernels::where(cond, g, zero), a_);
    if (needs_input_grad(2)) gb = reduce_grad(kernels::where(cond, zero, g), b_);
    return {Tensor(), ga, gb};
  }

 private:
  OperandMeta a_, b_;
};

class MaskedFillFn final : public autograd::Function {
 public:
  explicit MaskedFillFn(double value) : value_(value) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    save_for_backward({in[1]});
    return {kernels::masked_fill(in[0], in[1], value_)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    // Filled positions no longer depend on x.
    return {kernels::masked_fill(grads[0], saved_tensors()[0], 0.0), Tensor()};
  }

 private:
  double value_;
};

Tensor binary_fn(BinaryOp op, const Tensor& a, const Tensor& b) {
  return autograd::Function::apply<BinaryFn>({a, b}, op)[0];
}
Tensor scalar_fn(BinaryOp op, const Tensor& a, double s) {
  return autograd::Function::apply<ScalarFn>({a}, op, s)[0];
}
Tensor unary_fn(UnaryOp op, const Tensor& x) {
  return autograd::Function::apply<UnaryFn>({x}, op)[0];
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  return binary_fn(BinaryOp::Add, a, b);
}
Tensor sub(const Tensor& a, const Tensor& b) {
  return binary_fn(BinaryOp::Sub, a, b);
}
Tensor mul(const Tensor& a, const Tensor& b) {
  return binary_fn(BinaryOp::Mul, a, b);
}
Tensor div(const Tensor& a, const Tensor& b) {
  return binary_fn(BinaryOp::Div, a, b);
}
Tensor pow(const Tensor& a, const Tensor& b) {
  return binary_fn(BinaryOp::Pow, a, b);
}
Tensor maximum(const Tensor& a, const Tensor& b) {
  return binary_fn(BinaryOp::Maximum, a, b);
}
Tensor minimum(const Tensor& a, const Tensor& b) {
  return binary_fn(BinaryOp::Minimum, a, b);
}

Tensor add(const Tensor& a, double s) {
  return scalar_fn(BinaryOp::Add, a, s);
}
Tensor sub(const Tensor& a, double s) {
  return scalar_fn(BinaryOp::Sub, a, s);
}
Tensor mul(const Tensor& a, double s) {
  return scalar_fn(BinaryOp::Mul, a, s);
}
Tensor div(const Tensor& a, double s) {
  return scalar_fn(BinaryOp::Div, a, s);
}
Tensor pow(const Tensor& a, double exponent) {
  return scalar_fn(BinaryOp::Pow, a, exponent);
}

Tensor neg(const Tensor& x) {
  return unary_fn(UnaryOp::Neg, x);
}
Tensor exp(const Tensor& x) {
  return unary_fn(UnaryOp::Exp, x);
}
Tensor log(const Tensor& x) {
  return unary_fn(UnaryOp::Log, x);
}
Tensor sqrt(const Tensor& x) {
  return unary_fn(UnaryOp::Sqrt, x);
}
Tensor rsqrt(const Tensor& x) {
  return unary_fn(UnaryOp::Rsqrt, x);
}
Tensor tanh(const Tensor& x) {
  return unary_fn(UnaryOp::Tanh, x);
}
Tensor sigmoid(const Tensor& x) {
  return unary_fn(UnaryOp::Sigmoid, x);
}
Tensor relu(const Tensor& x) {
  return unary_fn(UnaryOp::Relu, x);
}
Tensor gelu(const Tensor& x, bool approximate) {
  return unary_fn(approximate ? UnaryOp::GeluTanh : UnaryOp::Gelu, x);
}
Tensor silu(const Tensor& x) {
  return unary_fn(UnaryOp::Silu, x);
}
Tensor abs(const Tensor& x) {
  return unary_fn(UnaryOp::Abs, x);
}
Tensor square(const Tensor& x) {
  return unary_fn(UnaryOp::Square, x);
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  return autograd::Function::apply<WhereFn>({cond, a, b})[0];
}
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  return autograd::Function::apply<MaskedFillFn>({x, mask}, value)[0];
}

Tensor operator+(const Tensor& a, const Tensor& b) {
  return add(a, b);
}
Tensor operator-(const Tensor& a, const Tensor& b) {
  return sub(a, b);
}
Tensor operator*(const Tensor& a, const Tensor& b) {
  return mul(a, b);
}
Tensor operator/(const Tensor& a, const Tensor& b) {
  return div(a, b);
}
Tensor operator+(const Tensor& a, double s) {
  return add(a, s);
}
Tensor operator-(const Tensor& a, double s) {
  return sub(a, s);
}
Tensor operator*(const Tensor& a, double s) {
  return mul(a, s);
}
Tensor operator/(const Tensor& a, double s) {
  return div(a, s);
}
Tensor operator*(double s, const Tensor& a) {
  return mul(a, s);
}
Tensor operator-(const Tensor& x) {
  return neg(x);
}

}  // namespace tessera
