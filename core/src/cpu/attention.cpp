// Scaled dot-product attention on the CPU, one (batch, head) at a time with Eigen GEMMs. The
// forward keeps only the row log-sum-exp; the backward recomputes the probabilities from it, so
// no [T, S] matrix outlives a call.
// GCC 12 reports false maybe-uninitialized warnings inside its own AVX-512 intrinsics once
// Eigen's GEMM packing is inlined here (GCC bug 105593); the location is the intrinsic header, so
// the pragma must precede every include.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/nn.h"

namespace tessera::kernels::cpu {

namespace {

template <class C>
using RowMat = Eigen::Matrix<C, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class C>
using MatMap = Eigen::Map<RowMat<C>>;
template <class C>
using ConstMatMap = Eigen::Map<const RowMat<C>>;

struct Dims {
  int64_t batch, heads, t, s, d, dv;
  // Queries see keys j <= i + (s - t): the causal diagonal is aligned at the end, so a query
  // block that continues a cached prefix of keys sees the whole prefix.
  int64_t visible(int64_t i, bool causal) const {
    if (!causal) return s;
    return std::clamp<int64_t>(i + (s - t) + 1, 0, s);
  }
};

Dims check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  TESSERA_CHECK(q.defined() && k.defined() && v.defined(), op, ": q, k and v must be defined");
  TESSERA_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), op, ": q ",
                q.str(), ", k ", k.str(), ", v ", v.str(), " must be cpu tensors in this build");
  TESSERA_CHECK(is_floating(q.dtype()) && k.dtype() == q.dtype() && v.dtype() == q.dtype(), op,
                ": q, k and v must share one floating dtype, got ", dtype_name(q.dtype()), ", ",
                dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  TESSERA_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
                ": expected q [B, H, T, D] and k/v [B, H, S, D], got q ", shape_str(q.shape()),
                ", k ", shape_str(k.shape()), ", v ", shape_str(v.shape()));
  TESSERA_CHECK(q.size(0) == k.size(0) && q.size(0) == v.size(0) && q.size(1) == k.size(1) &&
                    q.size(1) == v.size(1),
                op, ": batch and head dims differ between q ", shape_str(q.shape()), ", k ",
                shape_str(k.shape()), " and v ", shape_str(v.shape()));
  TESSERA_CHECK(q.size(3) == k.size(3), op, ": head dim mismatch between q ", shape_str(q.shape()),
                " (D=", q.size(3), ") and k ", shape_str(k.shape()), " (D=", k.size(3), ")");
  TESSERA_CHECK(k.size(2) == v.size(2), op, ": k ", shape_str(k.shape()), " and v ",
                shape_str(v.shape()), " must have the same number of keys S");
  TESSERA_CHECK(std::isfinite(scale) && scale > 0, op, ": scale must be finite and > 0, got ",
                scale, " (the autograd op turns scale <= 0 into 1/sqrt(D); the kernel does not)");
  return {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
}

Tensor in_compute(const Tensor& t, DType cdt) {
  return t.to(cdt).contiguous();
}

template <class C>
void forward_rows(const Dims& n, const C* q, const C* k, const C* v, C* out, C* lse, bool causal,
                  C scale) {
  RowMat<C> p(n.t, n.s);
  const C neg_inf = -std::numeric_limits<C>::infinity();
  for (int64_t bh = 0; bh < n.batch * n.heads; ++bh) {
    ConstMatMap<C> qm(q + bh * n.t * n.d, n.t, n.d), km(k + bh * n.s * n.d, n.s, n.d),
        vm(v + bh * n.s * n.dv, n.s, n.dv);
    MatMap<C> om(out + bh * n.t * n.dv, n.t, n.dv);
    C* lse_row = lse + bh * n.t;
    p.noalias() = scale * (qm * km.transpose());
    for (int64_t i = 0; i < n.t; ++i) {
      const int64_t vis = n.visible(i, causal);
      auto row = p.row(i);
      row.tail(n.s - vis).setZero();
      if (vis == 0) {
        // A query with no key to attend outputs zeros and lse = -inf, which is also the neutral
        // element when partial attentions over key blocks are merged by their lse.
        lse_row[i] = neg_inf;
        continue;
      }
      auto live = row.head(vis).array();
      const C m = live.maxCoeff();
      live = (live - m).exp();
      const C sum = live.sum();
      live /= sum;
      lse_row[i] = m + std::log(sum);
    }
    om.noalias() = p * vm;
  }
}

template <class C>
void backward_rows(const Dims& n, const C* go, const C* q, const C* k, const C* v, const C* out,
                   const C* lse, C* dq, C* dk, C* dv, bool causal, C scale) {
  RowMat<C> p(n.t, n.s), dp(n.t, n.s);
  Eigen::Matrix<C, Eigen::Dynamic, 1> delta(n.t);
  for (int64_t bh = 0; bh < n.batch * n.heads; ++bh) {
    ConstMatMap<C> qm(q + bh * n.t * n.d, n.t, n.d), km(k + bh * n.s * n.d, n.s, n.d),
        vm(v + bh * n.s * n.dv, n.s, n.dv), gom(go + bh * n.t * n.dv, n.t, n.dv),
        om(out + bh * n.t * n.dv, n.t, n.dv);
    MatMap<C> dqm(dq + bh * n.t * n.d, n.t, n.d), dkm(dk + bh * n.s * n.d, n.s, n.d),
        dvm(dv + bh * n.s * n.dv, n.s, n.dv);
    const C* lse_row = lse + bh * n.t;
    p.noalias() = scale * (qm * km.transpose());
    for (int64_t i = 0; i < n.t; ++i) {
      const int64_t vis = n.visible(i, causal);
      auto row = p.row(i);
      row.tail(n.s - vis).setZero();
      if (vis > 0) row.head(vis).array() = (row.head(vis).array() - lse_row[i]).exp();
    }
    dvm.noalias() = p.transpose() * gom;
    dp.noalias() = gom * vm.transpose();
    // rowsum(dO * O) equals rowsum(p * dp): the softmax Jacobian's rank-one term, computed in
    // O(T * Dv) instead of O(T * S).
    delta = (gom.array() * om.array()).rowwise().sum();
    dp = (p.array() * (dp.array().colwise() - delta.array())).matrix();
    dqm.noalias() = scale * (dp * km);
    dkm.noalias() = scale * (dp.transpose() * qm);
  }
}

template <class F>
void dispatch_compute(DType cdt, F&& f) {
  if (cdt == DType::Float64) {
    f.template operator()<double>();
  } else {
    f.template operator()<float>();
  }
}

}  // namespace

AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             bool causal, double scale) {
  const Dims n = check_inputs("scaled_dot_product_attention", q, k, v, scale);
  const DType cdt = compute_dtype(q.dtype());
  Tensor qc = in_compute(q, cdt), kc = in_compute(k, cdt), vc = in_compute(v, cdt);
  Tensor out = empty({n.batch, n.heads, n.t, n.dv}, cdt);
  Tensor lse = empty({n.batch, n.heads, n.t}, cdt);
  dispatch_compute(cdt, [&]<class C>() {
    forward_rows<C>(n, qc.data<C>(), kc.data<C>(), vc.data<C>(), out.data<C>(), lse.data<C>(),
                    causal, C(scale));
  });
  return {out.to(q.dtype()), lse};
}

AttentionGrads scaled_dot_product_attention_backward(const Tensor& grad_out, const Tensor& q,
                                                     const Tensor& k, const Tensor& v,
                                                     const Tensor& out, const Tensor& lse,
                                                     bool causal, double scale) {
  const char* op = "scaled_dot_product_attention_backward";
  const Dims n = check_inputs(op, q, k, v, scale);
  const Shape out_shape{n.batch, n.heads, n.t, n.dv}, lse_shape{n.batch, n.heads, n.t};
  TESSERA_CHECK(grad_out.defined() && out.defined() && lse.defined(), op,
                ": grad_out, out and lse must be defined");
  TESSERA_CHECK(grad_out.shape() == out_shape && out.shape() == out_shape, op, ": grad_out ",
                shape_str(grad_out.shape()), " and out ", shape_str(out.shape()),
                " must be [B, H, T, Dv] = ", shape_str(out_shape));
  TESSERA_CHECK(lse.shape() == lse_shape, op, ": lse ", shape_str(lse.shape()), " must be ",
                shape_str(lse_shape));
  TESSERA_CHECK(grad_out.device().is_cpu() && out.device().is_cpu() && lse.device().is_cpu(), op,
                ": grad_out, out and lse must be cpu tensors in this build");
  const DType cdt = compute_dtype(q.dtype());
  Tensor qc = in_compute(q, cdt), kc = in_compute(k, cdt), vc = in_compute(v, cdt),
         gc = in_compute(grad_out, cdt), oc = in_compute(out, cdt), lc = in_compute(lse, cdt);
  Tensor dq = empty(q.shape(), cdt), dk = empty(k.shape(), cdt), dv = empty(v.shape(), cdt);
  dispatch_compute(cdt, [&]<class C>() {
    backward_rows<C>(n, gc.data<C>(), qc.data<C>(), kc.data<C>(), vc.data<C>(), oc.data<C>(),
                     lc.data<C>(), dq.data<C>(), dk.data<C>(), dv.data<C>(), causal, C(scale));
  });
  return {dq.to(q.dtype()), dk.to(k.dtype()), dv.to(v.dtype())};
}

}  // namespace tessera::kernels::cpu
