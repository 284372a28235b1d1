#pragma once
// Private to core: the argument checks and product dimensions of the matrix kernels, shared by
// the CPU implementation and the device one (portable/linalg.h).
#include "tessera/core/error.h"
#include "tessera/core/tensor.h"

namespace tessera::kernels::portable {

inline void check_matmul_operands(const char* op, const Tensor& a, const Tensor& b) {
  TESSERA_CHECK(a.defined() && b.defined(), op, ": undefined operand");
  TESSERA_CHECK(a.dim() >= 2 && b.dim() >= 2, op, ": operands must have at least 2 dims, got a ",
                shape_str(a.shape()), " and b ", shape_str(b.shape()),
                " (reshape a vector to [1, k] or [k, 1] first)");
  TESSERA_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch, a is ", dtype_name(a.dtype()), " ",
                shape_str(a.shape()), " and b is ", dtype_name(b.dtype()), " ",
                shape_str(b.shape()));
  TESSERA_CHECK(is_floating(a.dtype()), op, ": needs floating-point operands, got ",
                dtype_name(a.dtype()));
}

inline void check_two_dims(const char* op, const Tensor& a, const Tensor& b) {
  TESSERA_CHECK(a.dim() == 2 && b.dim() == 2, op, ": needs 2-D operands, got a ",
                shape_str(a.shape()), " and b ", shape_str(b.shape()));
}

struct ProductDims {
  int64_t m, n, k;
};

inline ProductDims product_dims(const char* op, const Tensor& a, const Tensor& b, bool trans_a,
                                bool trans_b) {
  int64_t m = trans_a ? a.size(-1) : a.size(-2), k = trans_a ? a.size(-2) : a.size(-1);
  int64_t kb = trans_b ? b.size(-1) : b.size(-2), n = trans_b ? b.size(-2) : b.size(-1);
  TESSERA_CHECK(k == kb, op, ": inner dimensions differ: a ", shape_str(a.shape()),
                trans_a ? " (transposed)" : "", " x b ", shape_str(b.shape()),
                trans_b ? " (transposed)" : "", ": the columns of ", trans_a ? "a^T" : "a", " (", k,
                ") must equal the rows of ", trans_b ? "b^T" : "b", " (", kb, ")");
  return {m, n, k};
}

// addmm's c: defined when beta is not 0, of the operands' dtype, broadcasting to [m, n].
inline void check_addmm_c(const Tensor& c, const Tensor& a, const Shape& out_shape, double beta) {
  TESSERA_CHECK(c.defined(), "addmm: c is undefined but beta is ", beta);
  TESSERA_CHECK(c.dtype() == a.dtype(), "addmm: c is ", dtype_name(c.dtype()),
                " but the operands are ", dtype_name(a.dtype()));
  TESSERA_CHECK(c.dim() <= 2 && broadcast_shapes(c.shape(), out_shape, "addmm") == out_shape,
                "addmm: c ", shape_str(c.shape()), " does not broadcast to the product's shape ",
                shape_str(out_shape));
}

inline void check_accumulate_target(const Tensor& c, const Tensor& a, const Tensor& b,
                                    const ProductDims& d) {
  TESSERA_CHECK(c.defined() && c.is_contiguous() && c.shape() == Shape({d.m, d.n}) &&
                    c.dtype() == a.dtype() && !is_half(a.dtype()),
                "matmul_accumulate_: c ", c.defined() ? c.str() : std::string("(undefined)"),
                " must be a contiguous ", dtype_name(a.dtype()), " [", d.m, ", ", d.n,
                "] (float32 or float64)");
  // The product is accumulated into c while a and b are read: c must not be either's memory.
  TESSERA_CHECK(!c.storage().is_same(a.storage()) && !c.storage().is_same(b.storage()),
                "matmul_accumulate_: c ", c.str(), " shares memory with ",
                c.storage().is_same(a.storage()) ? "a " + a.str() : "b " + b.str(),
                "; accumulate into a separate tensor (or clone the operand)");
}

inline void check_linear(const Tensor& x, const Tensor& w, const Tensor& bias) {
  TESSERA_CHECK(x.defined() && w.defined(), "linear: undefined input or weight");
  TESSERA_CHECK(w.dim() == 2, "linear: weight must be [out_features, in_features], got ",
                shape_str(w.shape()));
  TESSERA_CHECK(x.dim() >= 1 && x.size(-1) == w.size(1), "linear: input ", shape_str(x.shape()),
                " has ", x.dim() >= 1 ? x.size(-1) : 0, " features but weight ",
                shape_str(w.shape()), " expects in_features = ", w.size(1));
  if (bias.defined()) {
    TESSERA_CHECK(bias.dim() == 1 && bias.size(0) == w.size(0), "linear: bias ",
                  shape_str(bias.shape()), " does not match weight ", shape_str(w.shape()),
                  " (expected [", w.size(0), "])");
  }
}

}  // namespace tessera::kernels::portable
