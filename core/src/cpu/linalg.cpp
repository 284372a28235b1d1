// Matrix products on Eigen. Operands are handed to Eigen as Maps over their own storage, in
// whichever storage order their strides already have, so a transposed or row-sliced operand costs
// no copy: Eigen's GEMM packs both operands anyway and is as happy to pack from a column-major
// view as from a row-major one. Only strides Eigen cannot express (no unit stride in either
// matrix dim, or broadcast zero strides inside a matrix) are copied first.
#include <algorithm>

#include <Eigen/Core>

#include "../portable/composite.h"
#include "../portable/linalg.h"
#include "../portable/linalg_checks.h"
#include "kernels.h"
#include "tessera/core/detail/strided_loop.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/linalg.h"
#include "tessera/core/kernels/views.h"

namespace tessera::kernels::cpu {

namespace {

// One operand matrix op(x) as seen by one batch element: the logical [rows, cols] matrix with the
// element strides between rows and between columns.
struct MatStrides {
  int64_t rows, cols, rs, cs;
};

// How Eigen reads a matrix: storage order plus the stride between consecutive outer vectors.
struct EigenLayout {
  bool row_major;
  int64_t outer;
};

bool eigen_layout(const MatStrides& m, EigenLayout& out) {
  // A dim of extent <= 1 is never stepped over, so its stride is free to choose.
  bool rows_free = m.rows <= 1, cols_free = m.cols <= 1;
  int64_t rows1 = std::max<int64_t>(m.rows, 1), cols1 = std::max<int64_t>(m.cols, 1);
  if ((cols_free || m.cs == 1) && (rows_free || m.rs >= cols1)) {
    out = {true, rows_free ? cols1 : m.rs};
    return true;
  }
  if ((rows_free || m.rs == 1) && (cols_free || m.cs >= rows1)) {
    out = {false, cols_free ? rows1 : m.cs};
    return true;
  }
  return false;
}

template <class T, int Order>
using ConstMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>,
                            Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using OutMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                          Eigen::Unaligned, Eigen::OuterStride<>>;

// C (row-major, leading dim ldc) = alpha * A B, or += when accumulate.
template <class T, int OrderA, int OrderB>
void gemm_ordered(T* c, int64_t ldc, const T* a, int64_t lda, const T* b, int64_t ldb, int64_t m,
                  int64_t n, int64_t k, T alpha, bool accumulate) {
  ConstMap<T, OrderA> A(a, m, k, Eigen::OuterStride<>(lda));
  ConstMap<T, OrderB> B(b, k, n, Eigen::OuterStride<>(ldb));
  OutMap<T> C(c, m, n, Eigen::OuterStride<>(ldc));
  if (accumulate) {
    if (alpha == T(1))
      C.noalias() += A * B;
    else
      C.noalias() += alpha * A * B;
  } else {
    if (alpha == T(1))
      C.noalias() = A * B;
    else
      C.noalias() = alpha * A * B;
  }
}

template <class T>
void gemm(T* c, int64_t ldc, const T* a, EigenLayout la, const T* b, EigenLayout lb, int64_t m,
          int64_t n, int64_t k, T alpha, bool accumulate) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // Eigen would do the same, but its Maps would then point at storage that may not exist.
    if (!accumulate) {
      for (int64_t i = 0; i < m; ++i)
        std::fill(c + i * ldc, c + i * ldc + n, T(0));
    }
    return;
  }
  constexpr int R = Eigen::RowMajor, C = Eigen::ColMajor;
  if (la.row_major && lb.row_major)
    gemm_ordered<T, R, R>(c, ldc, a, la.outer, b, lb.outer, m, n, k, alpha, accumulate);
  else if (la.row_major)
    gemm_ordered<T, R, C>(c, ldc, a, la.outer, b, lb.outer, m, n, k, alpha, accumulate);
  else if (lb.row_major)
    gemm_ordered<T, C, R>(c, ldc, a, la.outer, b, lb.outer, m, n, k, alpha, accumulate);
  else
    gemm_ordered<T, C, C>(c, ldc, a, la.outer, b, lb.outer, m, n, k, alpha, accumulate);
}

// op(x) for the last two dims of x.
MatStrides op_strides(const Tensor& x, bool trans) {
  int64_t r = x.size(-2), c = x.size(-1), rs = x.stride(-2), cs = x.stride(-1);
  return trans ? MatStrides{c, r, cs, rs} : MatStrides{r, c, rs, cs};
}

// An operand ready for Eigen: possibly a contiguous copy of the original when its strides were
// not expressible.
struct Operand {
  Tensor t;
  MatStrides mat;
  EigenLayout layout;
};

Operand prepare(const Tensor& x, bool trans) {
  Operand op{x, op_strides(x, trans), {}};
  if (!eigen_layout(op.mat, op.layout)) {
    op.t = x.contiguous();
    op.mat = op_strides(op.t, trans);
    eigen_layout(op.mat, op.layout);
  }
  return op;
}

// Strides of x's batch dims right-aligned to `batch` (broadcast dims get stride 0).
Shape batch_strides(const Tensor& x, const Shape& batch) {
  Shape st(batch.size(), 0);
  int64_t nb = x.dim() - 2, lead = int64_t(batch.size()) - nb;
  for (int64_t i = 0; i < nb; ++i)
    if (x.size(i) != 1) st[size_t(lead + i)] = x.stride(i);
  return st;
}

using portable::check_matmul_operands;
using portable::product_dims;
using portable::ProductDims;
using portable::single_stride;
template <class T>
void batched_matmul(const Operand& a, const Operand& b, const Shape& batch, Tensor& out) {
  const int64_t m = a.mat.rows, k = a.mat.cols, n = b.mat.cols;
  const T* pa = a.t.data<T>();
  const T* pb = b.t.data<T>();
  T* pc = out.data<T>();
  Shape sa = batch_strides(a.t, batch), sb = batch_strides(b.t, batch);
  Shape sc(out.strides().begin(), out.strides().end() - 2);

  // A weight shared by the whole batch (x @ W): fold the batch into the rows of one big GEMM
  // when a's batch and row dims form a single run, which is what a contiguous activation has.
  bool b_shared = std::all_of(sb.begin(), sb.end(), [](int64_t s) { return s == 0; });
  if (b_shared && !batch.empty()) {
    Shape sizes = batch, strides = sa;
    sizes.push_back(m);
    strides.push_back(a.mat.rs);
    int64_t rs;
    EigenLayout la;
    if (single_stride(sizes, strides, rs) &&
        eigen_layout({shape_numel(sizes), k, rs, a.mat.cs}, la)) {
      gemm<T>(pc, n, pa, la, pb, b.layout, shape_numel(sizes), n, k, T(1), false);
      return;
    }
  }
  detail::for_each_run<3>(batch, {&sa, &sb, &sc}, [&](const detail::Run<3>& r) {
    for (int64_t i = 0; i < r.length; ++i) {
      gemm<T>(pc + r.offset[2] + i * r.stride[2], n, pa + r.offset[0] + i * r.stride[0], a.layout,
              pb + r.offset[1] + i * r.stride[1], b.layout, m, n, k, T(1), false);
    }
  });
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  check_matmul_operands("matmul", a, b);
  ProductDims d = product_dims("matmul", a, b, trans_a, trans_b);
  Shape batch = broadcast_shapes(Shape(a.shape().begin(), a.shape().end() - 2),
                                 Shape(b.shape().begin(), b.shape().end() - 2), "matmul");
  Shape out_shape = batch;
  out_shape.push_back(d.m);
  out_shape.push_back(d.n);
  if (is_half(a.dtype())) {
    return matmul(a.to(DType::Float32), b.to(DType::Float32), trans_a, trans_b).to(a.dtype());
  }
  Tensor out = empty(out_shape, a.dtype());
  if (out.numel() == 0) return out;
  Operand oa = prepare(a, trans_a), ob = prepare(b, trans_b);
  if (a.dtype() == DType::Float64)
    batched_matmul<double>(oa, ob, batch, out);
  else
    batched_matmul<float>(oa, ob, batch, out);
  return out;
}

Tensor addmm(const Tensor& c, const Tensor& a, const Tensor& b, double beta, double alpha,
             bool trans_a, bool trans_b) {
  check_matmul_operands("addmm", a, b);
  portable::check_two_dims("addmm", a, b);
  ProductDims d = product_dims("addmm", a, b, trans_a, trans_b);
  Shape out_shape{d.m, d.n};
  bool use_c = beta != 0.0;
  if (use_c) portable::check_addmm_c(c, a, out_shape, beta);
  if (is_half(a.dtype())) {
    Tensor c32 = use_c ? c.to(DType::Float32) : c;
    return addmm(c32, a.to(DType::Float32), b.to(DType::Float32), beta, alpha, trans_a, trans_b)
        .to(a.dtype());
  }
  Tensor out = empty(out_shape, a.dtype());
  if (out.numel() == 0) return out;
  if (use_c) {
    out.copy_(expand(c, out_shape));
  }
  Operand oa = prepare(a, trans_a), ob = prepare(b, trans_b);
  auto run = [&]<class T>() {
    T* pc = out.data<T>();
    if (use_c && beta != 1.0) {
      T s = T(beta);
      for (int64_t i = 0; i < out.numel(); ++i)
        pc[i] *= s;
    }
    gemm<T>(pc, d.n, oa.t.data<T>(), oa.layout, ob.t.data<T>(), ob.layout, d.m, d.n, d.k, T(alpha),
            use_c);
  };
  if (a.dtype() == DType::Float64)
    run.template operator()<double>();
  else
    run.template operator()<float>();
  return out;
}

void matmul_accumulate_(Tensor& c, const Tensor& a, const Tensor& b, double alpha, bool trans_a,
                        bool trans_b) {
  check_matmul_operands("matmul_accumulate_", a, b);
  portable::check_two_dims("matmul_accumulate_", a, b);
  ProductDims d = product_dims("matmul_accumulate_", a, b, trans_a, trans_b);
  portable::check_accumulate_target(c, a, b, d);
  if (c.numel() == 0) return;
  Operand oa = prepare(a, trans_a), ob = prepare(b, trans_b);
  auto run = [&]<class T>() {
    gemm<T>(c.data<T>(), d.n, oa.t.data<T>(), oa.layout, ob.t.data<T>(), ob.layout, d.m, d.n, d.k,
            T(alpha), true);
  };
  if (a.dtype() == DType::Float64)
    run.template operator()<double>();
  else
    run.template operator()<float>();
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias) {
  return portable::linear(x, w, bias);
}

}  // namespace tessera::kernels::cpu
