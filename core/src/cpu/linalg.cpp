// Matrix products on Eigen. Operands are handed to Eigen as Maps over their own storage, in
// whichever storage order their strides already have, so a transposed or row-sliced operand costs
// no copy: Eigen's GEMM packs both operands anyway and is as happy to pack from a column-major
// view as from a row-major one. Only strides Eigen cannot express (no unit stride in either
// matrix dim, or broadcast zero strides inside a matrix) are copied first.
#include <algorithm>

#include <Eigen/Core>

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

void check_operands(const char* op, const Tensor& a, const Tensor& b) {
  TESSERA_CHECK(a.defined() && b.defined(), op, ": undefined operand");
  TESSERA_CHECK(a.dim() >= 2 && b.dim() >= 2, op, ": operands must have at least 2 dims, got a ",
                shape_str(a.shape()), " and b ", shape_str(b.shape()),
                " (reshape a vector to [1, k] or [k, 1] first)");
  TESSERA_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch, a is ", dtype_name(a.dtype()), " ",
                shape_str(a.shape()), " and b is ", dtype_name(b.dtype()), " ",
                shape_str(b.shape()));
  TESSERA_CHECK(is_floating(a.dtype()), op, ": needs floating-point operands, got ",
                dtype_name(a.dtype()));
  TESSERA_CHECK(a.device().is_cpu() && b.device().is_cpu(), op, ": the CPU kernel got operands on ",
                a.device().str(), " and ", b.device().str());
}

struct ProductDims {
  int64_t m, n, k;
};

ProductDims product_dims(const char* op, const Tensor& a, const Tensor& b, bool trans_a,
                         bool trans_b) {
  int64_t m = trans_a ? a.size(-1) : a.size(-2), k = trans_a ? a.size(-2) : a.size(-1);
  int64_t kb = trans_b ? b.size(-1) : b.size(-2), n = trans_b ? b.size(-2) : b.size(-1);
  TESSERA_CHECK(k == kb, op, ": inner dimensions differ: a ", shape_str(a.shape()),
                trans_a ? " (transposed)" : "", " x b ", shape_str(b.shape()),
                trans_b ? " (transposed)" : "", ": the columns of ", trans_a ? "a^T" : "a", " (", k,
                ") must equal the rows of ", trans_b ? "b^T" : "b", " (", kb, ")");
  return {m, n, k};
}

// Collapses (sizes, strides) to a single stride if the dims are one evenly strided run.
bool single_stride(const Shape& sizes, const Shape& strides, int64_t& stride) {
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
  check_operands("matmul", a, b);
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
  check_operands("addmm", a, b);
  TESSERA_CHECK(a.dim() == 2 && b.dim() == 2, "addmm: needs 2-D operands, got a ",
                shape_str(a.shape()), " and b ", shape_str(b.shape()));
  ProductDims d = product_dims("addmm", a, b, trans_a, trans_b);
  Shape out_shape{d.m, d.n};
  bool use_c = beta != 0.0;
  if (use_c) {
    TESSERA_CHECK(c.defined(), "addmm: c is undefined but beta is ", beta);
    TESSERA_CHECK(c.dtype() == a.dtype(), "addmm: c is ", dtype_name(c.dtype()),
                  " but the operands are ", dtype_name(a.dtype()));
    TESSERA_CHECK(c.dim() <= 2 && broadcast_shapes(c.shape(), out_shape, "addmm") == out_shape,
                  "addmm: c ", shape_str(c.shape()), " does not broadcast to the product's shape ",
                  shape_str(out_shape));
  }
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
  check_operands("matmul_accumulate_", a, b);
  TESSERA_CHECK(a.dim() == 2 && b.dim() == 2, "matmul_accumulate_: needs 2-D operands, got a ",
                shape_str(a.shape()), " and b ", shape_str(b.shape()));
  ProductDims d = product_dims("matmul_accumulate_", a, b, trans_a, trans_b);
  TESSERA_CHECK(c.defined() && c.is_contiguous() && c.shape() == Shape({d.m, d.n}) &&
                    c.dtype() == a.dtype() && !is_half(a.dtype()),
                "matmul_accumulate_: c ", c.defined() ? c.str() : std::string("(undefined)"),
                " must be a contiguous ", dtype_name(a.dtype()), " [", d.m, ", ", d.n,
                "] (float32 or float64)");
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
  int64_t in = w.size(1), out_features = w.size(0);
  int64_t rows =
      in == 0 ? shape_numel(Shape(x.shape().begin(), x.shape().end() - 1)) : x.numel() / in;
  Tensor x2 = reshape(x, {rows, in});
  Tensor y =
      bias.defined() ? addmm(bias, x2, w, 1.0, 1.0, false, true) : matmul(x2, w, false, true);
  Shape out_shape = x.shape();
  out_shape.back() = out_features;
  return view(y, out_shape);
}

}  // namespace tessera::kernels::cpu
