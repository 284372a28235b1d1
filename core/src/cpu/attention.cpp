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

#include "../portable/nn_checks.h"
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

Tensor in_compute(const Tensor& t, DType cdt) {
  return t.to(cdt).contiguous();
}

template <class C>
void forward_rows(const portable::AttentionDims& n, const C* q, const C* k, const C* v, C* out,
                  C* lse, bool causal, C scale) {
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
void backward_rows(const portable::AttentionDims& n, const C* go, const C* q, const C* k,
                   const C* v, const C* out, const C* lse, C* dq, C* dk, C* dv, bool causal,
                   C scale) {
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
  const portable::AttentionDims n =
      portable::check_attention_inputs("scaled_dot_product_attention", q, k, v, scale);
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
  const portable::AttentionDims n = portable::check_attention_inputs(op, q, k, v, scale);
  portable::check_attention_backward(op, n, grad_out, out, lse);
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
