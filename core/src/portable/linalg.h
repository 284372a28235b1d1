#pragma once
// Private to core: the matrix kernels for devices (see kernels.h for executors). Each product
// becomes one GemmCall in BLAS's column-major, strided-batched terms, which a CUDA executor hands
// to cuBLAS unchanged and the host emulation computes by its reference loop, so the translation
// from Tensor layouts to BLAS arguments (transposes, leading dims, batch strides) is the same
// code on both. Row-major C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T.
// 16-bit operands go through float32 copies, as on the CPU.
#include <algorithm>

#include "../kernel_table.h"
#include "linalg_checks.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/views.h"

namespace tessera::kernels::portable {

// C = alpha * op(A) op(B) + beta * C for each of `batch` matrices, column-major (BLAS's
// gemmStridedBatched). C is m x n; op(A) m x k; op(B) k x n. beta == 0 never reads C.
struct GemmCall {
  DType dtype = DType::Float32;  // Float32 or Float64
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 1, stride_a = 0;
  const void* b = nullptr;
  int64_t ldb = 1, stride_b = 0;
  void* c = nullptr;
  int64_t ldc = 1, stride_c = 0;
  int64_t batch = 1;
  double alpha = 1, beta = 0;
};

// The argument rules cuBLAS's gemmStridedBatched enforces (CUBLAS_STATUS_INVALID_VALUE
// otherwise), checked by every executor, so that the host emulation refuses a call the GPU
// would: a leading dimension at least 1 and at least the stored matrix's row count, even where
// a dimension of 0 or 1 means it is never used to address anything.
inline void check_gemm_call(const char* op, Device device, const GemmCall& g) {
  TESSERA_CHECK(g.dtype == DType::Float32 || g.dtype == DType::Float64, op, " on ", device.str(),
                ": gemm of ", dtype_name(g.dtype), " (BLAS takes float32 and float64)");
  // k = 0 is run_gemm's to write: cuBLAS has left C untouched there.
  TESSERA_CHECK(g.m >= 0 && g.n >= 0 && g.k > 0 && g.batch >= 0, op, " on ", device.str(),
                ": gemm with m ", g.m, ", n ", g.n, ", k ", g.k, ", batch ", g.batch);
  const int64_t rows_a = g.trans_a ? g.k : g.m, rows_b = g.trans_b ? g.n : g.k;
  TESSERA_CHECK(g.lda >= std::max<int64_t>(1, rows_a) && g.ldb >= std::max<int64_t>(1, rows_b) &&
                    g.ldc >= std::max<int64_t>(1, g.m),
                op, " on ", device.str(), ": gemm leading dimensions lda ", g.lda, ", ldb ", g.ldb,
                ", ldc ", g.ldc, " below BLAS's minimum ", std::max<int64_t>(1, rows_a), ", ",
                std::max<int64_t>(1, rows_b), ", ", std::max<int64_t>(1, g.m), " (m ", g.m, ", n ",
                g.n, ", k ", g.k, ", op(A) ", g.trans_a ? "T" : "N", ", op(B) ",
                g.trans_b ? "T" : "N", ")");
}

// One operand as BLAS sees it: a pointer, whether BLAS must transpose what it reads, the leading
// dimension and the stride between batch entries.
struct BlasOperand {
  Tensor keep;  // the tensor whose memory `data` points into
  const void* data;
  bool trans;
  int64_t ld;
  int64_t batch_stride;
};

// The one stride that steps through every entry of `sizes` in row-major order, if there is one.
inline bool single_stride(const Shape& sizes, const Shape& strides, int64_t& stride) {
  stride = 0;
  int64_t expected = -1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] == 1) continue;
    if (expected < 0)
      stride = strides[i];
    else if (strides[i] != expected)
      return false;
    expected = strides[i] * sizes[i];
  }
  return true;
}

// x's role in C^T = op(B)^T op(A)^T: `rows` x `cols` is op(x) (x transposed when `trans`), and
// BLAS is to read op(x)^T from it. Row-major op(x) read as column-major is op(x)^T already
// (no BLAS transpose); column-major op(x) needs one. Anything else is copied contiguous first.
inline BlasOperand blas_operand(const Tensor& x, bool trans, const Shape& batch) {
  auto attempt = [&](const Tensor& t, BlasOperand& out) {
    const int64_t r = t.size(-2), c = t.size(-1);
    int64_t rows = trans ? c : r, cols = trans ? r : c;
    int64_t rs = trans ? t.stride(-1) : t.stride(-2), cs = trans ? t.stride(-2) : t.stride(-1);
    Shape bsizes = batch, bstrides(batch.size(), 0);
    const int64_t nb = t.dim() - 2, lead = int64_t(batch.size()) - nb;
    for (int64_t i = 0; i < nb; ++i)
      if (t.size(i) != 1) bstrides[size_t(lead + i)] = t.stride(i);
    int64_t bstride = 0;
    if (!single_stride(bsizes, bstrides, bstride)) return false;
    // BLAS wants ld >= max(1, rows of the stored matrix) even where it addresses nothing with
    // it: one stored column (rows <= 1 here), or none stored (cols 0, whose strides may be 0).
    if ((cols <= 1 || cs == 1) && (rows <= 1 || rs >= cols)) {
      out = {t, t.raw_data(), false,
             rows <= 1 ? std::max<int64_t>(cols, 1) : std::max<int64_t>(rs, 1), bstride};
      return true;
    }
    if ((rows <= 1 || rs == 1) && (cols <= 1 || cs >= rows)) {
      out = {t, t.raw_data(), true,
             cols <= 1 ? std::max<int64_t>(rows, 1) : std::max<int64_t>(cs, 1), bstride};
      return true;
    }
    return false;
  };
  BlasOperand out;
  if (attempt(x, out)) return out;
  Shape full = batch;
  full.push_back(x.size(-2));
  full.push_back(x.size(-1));
  const Tensor dense = expand(x, full).contiguous();
  const bool ok = attempt(dense, out);
  TESSERA_CHECK(ok, "matmul: no BLAS layout for a contiguous ", dense.str());
  return out;
}

// out[batch..., m, n] (contiguous) = alpha * op(a) @ op(b) + beta * out, with a and b as
// blas_operand made them (they must outlive the call).
inline GemmCall gemm_call(const Tensor& out, const BlasOperand& oa, const BlasOperand& ob,
                          const Shape& batch, const ProductDims& d, double alpha, double beta) {
  GemmCall g;
  g.dtype = out.dtype();
  g.m = d.n;
  g.n = d.m;
  g.k = d.k;
  g.trans_a = ob.trans;
  g.a = ob.data;
  g.lda = ob.ld;
  g.stride_a = ob.batch_stride;
  g.trans_b = oa.trans;
  g.b = oa.data;
  g.ldb = oa.ld;
  g.stride_b = oa.batch_stride;
  g.c = const_cast<void*>(out.raw_data());
  g.ldc = std::max<int64_t>(d.n, 1);
  g.stride_c = d.m * d.n;
  g.batch = shape_numel(batch);
  g.alpha = alpha;
  g.beta = beta;
  return g;
}

// The executor's gemm on `out`'s device, keeping the operands alive until it returns.
template <class Exec>
void run_gemm(const char* op, const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a,
              bool trans_b, const Shape& batch, const ProductDims& d, double alpha, double beta) {
  if (out.numel() == 0) return;
  // An empty sum: C = beta * C, written here. cuBLAS's strided-batched gemm has left C untouched
  // for k = 0 (pytorch/pytorch#31421), where `out` may hold a reused block's bytes.
  if (d.k == 0) {
    Tensor c = out;
    if (beta == 0.0)
      c.zero_();
    else if (beta != 1.0)
      mul_scalar_(c, beta);
    return;
  }
  const BlasOperand oa = blas_operand(a, trans_a, batch), ob = blas_operand(b, trans_b, batch);
  Exec::gemm(op, out.device(), gemm_call(out, oa, ob, batch, d, alpha, beta));
}

template <class Exec>
struct Linalg {
  static Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
    check_matmul_operands("matmul", a, b);
    const ProductDims d = product_dims("matmul", a, b, trans_a, trans_b);
    const Shape batch = broadcast_shapes(Shape(a.shape().begin(), a.shape().end() - 2),
                                         Shape(b.shape().begin(), b.shape().end() - 2), "matmul");
    if (is_half(a.dtype()))
      return matmul(a.to(DType::Float32), b.to(DType::Float32), trans_a, trans_b).to(a.dtype());
    Shape out_shape = batch;
    out_shape.push_back(d.m);
    out_shape.push_back(d.n);
    Tensor out = empty(out_shape, TensorOptions(a.dtype(), a.device()));
    run_gemm<Exec>("matmul", out, a, b, trans_a, trans_b, batch, d, 1.0, 0.0);
    return out;
  }

  static Tensor addmm(const Tensor& c, const Tensor& a, const Tensor& b, double beta, double alpha,
                      bool trans_a, bool trans_b) {
    check_matmul_operands("addmm", a, b);
    check_two_dims("addmm", a, b);
    const ProductDims d = product_dims("addmm", a, b, trans_a, trans_b);
    const Shape out_shape{d.m, d.n};
    const bool use_c = beta != 0.0;
    if (use_c) check_addmm_c(c, a, out_shape, beta);
    if (is_half(a.dtype())) {
      const Tensor c32 = use_c ? c.to(DType::Float32) : c;
      return addmm(c32, a.to(DType::Float32), b.to(DType::Float32), beta, alpha, trans_a, trans_b)
          .to(a.dtype());
    }
    Tensor out = empty(out_shape, TensorOptions(a.dtype(), a.device()));
    if (use_c) out.copy_(expand(c, out_shape));
    run_gemm<Exec>("addmm", out, a, b, trans_a, trans_b, {}, d, alpha, use_c ? beta : 0.0);
    return out;
  }

  static void matmul_accumulate_(Tensor& c, const Tensor& a, const Tensor& b, double alpha,
                                 bool trans_a, bool trans_b) {
    check_matmul_operands("matmul_accumulate_", a, b);
    check_two_dims("matmul_accumulate_", a, b);
    const ProductDims d = product_dims("matmul_accumulate_", a, b, trans_a, trans_b);
    check_accumulate_target(c, a, b, d);
    run_gemm<Exec>("matmul_accumulate_", c, a, b, trans_a, trans_b, {}, d, alpha, 1.0);
  }

  static void fill_table(registry::KernelTable& table) {
    table.matmul = &matmul;
    table.addmm = &addmm;
    table.matmul_accumulate_ = &matmul_accumulate_;
  }
};

// The reference column-major gemm a host executor runs: what BLAS computes, one output element
// at a time, accumulating in T.
template <class T>
void reference_gemm(const GemmCall& g) {
  const T* a = static_cast<const T*>(g.a);
  const T* b = static_cast<const T*>(g.b);
  T* c = static_cast<T*>(g.c);
  for (int64_t e = 0; e < g.batch; ++e) {
    const T* ae = a + e * g.stride_a;
    const T* be = b + e * g.stride_b;
    T* ce = c + e * g.stride_c;
    for (int64_t j = 0; j < g.n; ++j) {
      for (int64_t i = 0; i < g.m; ++i) {
        T acc = 0;
        for (int64_t p = 0; p < g.k; ++p) {
          const T av = g.trans_a ? ae[p + i * g.lda] : ae[i + p * g.lda];
          const T bv = g.trans_b ? be[j + p * g.ldb] : be[p + j * g.ldb];
          acc += av * bv;
        }
        T& cv = ce[i + j * g.ldc];
        cv = g.beta == 0 ? T(g.alpha) * acc : T(g.alpha) * acc + T(g.beta) * cv;
      }
    }
  }
}

}  // namespace tessera::kernels::portable
