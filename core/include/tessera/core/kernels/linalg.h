#pragma once
#include "tessera/core/tensor.h"

namespace tessera::kernels {

// op(a) @ op(b) where op transposes the last two dims when asked. 2-D, or batched with
// broadcast batch dims ([..., m, k] x [..., k, n]); a 1-D b is not accepted (reshape first).
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);
// beta * c + alpha * op(a) @ op(b), 2-D.
Tensor addmm(const Tensor& c, const Tensor& a, const Tensor& b, double beta = 1.0,
             double alpha = 1.0, bool trans_a = false, bool trans_b = false);
// x @ w^T + bias over the last dim of x ([..., in] x [out, in] -> [..., out]); bias optional.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias = {});

}  // namespace tessera::kernels
