#pragma once
#include "tessera/core/tensor.h"

namespace tessera::kernels {

// op(a) @ op(b) where op transposes the last two dims when asked. 2-D, or batched with
// broadcast batch dims ([..., m, k] x [..., k, n]); a 1-D b is not accepted (reshape first).
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);
// beta * c + alpha * op(a) @ op(b), 2-D.
Tensor addmm(const Tensor& c, const Tensor& a, const Tensor& b, double beta = 1.0,
             double alpha = 1.0, bool trans_a = false, bool trans_b = false);
// c += alpha * op(a) @ op(b) in place: c contiguous, 2-D, float32 or float64 like a and b. What a
// sum of products (a linear layer plus a low-rank update) writes without a separate addition.
void matmul_accumulate_(Tensor& c, const Tensor& a, const Tensor& b, double alpha = 1.0,
                        bool trans_a = false, bool trans_b = false);
// x @ w^T + bias over the last dim of x ([..., in] x [out, in] -> [..., out]); bias optional.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias = {});

}  // namespace tessera::kernels
