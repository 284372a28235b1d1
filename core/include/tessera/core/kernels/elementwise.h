#pragma once
// Raw elementwise kernels: no autograd, inputs of any strides, numpy broadcasting for binary
// ops. Results are new contiguous tensors. Float16/BFloat16 compute in float32.
#include "tessera/core/tensor.h"

namespace tessera::kernels {

enum class UnaryOp : uint8_t {
  Neg,
  Exp,
  Log,
  Sqrt,
  Rsqrt,
  Tanh,
  Sigmoid,
  Relu,
  Gelu,
  GeluTanh,
  Silu,
  Abs,
  Sin,
  Cos,
  Square,
  Reciprocal
};
enum class BinaryOp : uint8_t { Add, Sub, Mul, Div, Pow, Maximum, Minimum };
enum class CompareOp : uint8_t { Eq, Ne, Lt, Le, Gt, Ge };

Tensor unary(UnaryOp op, const Tensor& x);
// Result dtype: result_type(a, b) (tensor.h).
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b);
Tensor binary_scalar(BinaryOp op, const Tensor& a, double s);    // a op s
Tensor rbinary_scalar(BinaryOp op, double s, const Tensor& a);   // s op a
Tensor compare(CompareOp op, const Tensor& a, const Tensor& b);  // Bool, compared in result_type
Tensor compare_scalar(CompareOp op, const Tensor& a, double s);  // Bool

// dst += alpha * src, src broadcast to dst's shape; dst keeps its dtype.
void add_(Tensor& dst, const Tensor& src, double alpha = 1.0);
void mul_scalar_(Tensor& dst, double s);

// Fused backward kernels: grad * f'(x).
Tensor unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x);

// Result dtype: result_type(a, b).
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);

// Sums `x` down to `shape` (the inverse of broadcasting), for gradients of broadcast operands.
Tensor sum_to_shape(const Tensor& x, const Shape& shape);

}  // namespace tessera::kernels
