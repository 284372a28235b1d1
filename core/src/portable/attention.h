#pragma once
// Private to core: scaled dot-product attention on devices, the CPU's algorithm with its products
// as batched gemms (linalg.h) and its row work as element functors. Forward: S = q k^T, then per
// row P = softmax(scale * S) over the visible keys and lse = its log-sum-exp, then out = P v.
// Backward recomputes P from S and lse, then dv = P^T go, dP = go v^T, delta = rowsum(go * out),
// dS = scale * P * (dP - delta), dq = dS k, dk = dS^T q. Memory is O(T * S) per head, as on the
// CPU.
#include <cmath>
#include <limits>

#include "../kernel_table.h"
#include "element_ops.h"
#include "launch.h"
#include "linalg.h"
#include "nn_checks.h"
#include "tessera/core/factory.h"

namespace tessera::kernels::portable {

// The keys query row i sees.
TESSERA_HOST_DEVICE inline int64_t visible_keys(int64_t i, int64_t t, int64_t s, bool causal) {
  if (!causal) return s;
  const int64_t v = i + (s - t) + 1;
  return v < 0 ? 0 : (v > s ? s : v);
}

// In place on one row of S [rows = B*H*T, s]: P = softmax(scale * S) over the visible keys, 0
// beyond them; lse per row (-inf when no key is visible).
template <class C>
struct AttentionSoftmaxFn {
  C* p;
  C* lse;
  int64_t t, s;
  bool causal;
  C scale;
  TESSERA_HOST_DEVICE void operator()(int64_t r) const {
    C* row = p + r * s;
    const int64_t vis = visible_keys(r % t, t, s, causal);
    for (int64_t j = vis; j < s; ++j)
      row[j] = C(0);
    if (vis == 0) {
      lse[r] = -infinity<C>();
      return;
    }
    C m = -infinity<C>();
    for (int64_t j = 0; j < vis; ++j) {
      row[j] = scale * row[j];
      m = row[j] > m ? row[j] : m;
    }
    C sum = 0;
    for (int64_t j = 0; j < vis; ++j) {
      row[j] = std::exp(row[j] - m);
      sum += row[j];
    }
    for (int64_t j = 0; j < vis; ++j)
      row[j] /= sum;
    lse[r] = m + std::log(sum);
  }
};

// In place on S: P = exp(scale * S - lse) over the visible keys, 0 beyond them.
template <class C>
struct AttentionProbsFn {
  C* p;
  const C* lse;
  int64_t t, s;
  bool causal;
  C scale;
  TESSERA_HOST_DEVICE void operator()(int64_t e) const {
    const int64_t r = e / s, j = e - r * s;
    const int64_t vis = visible_keys(r % t, t, s, causal);
    p[e] = j < vis ? std::exp(scale * p[e] - lse[r]) : C(0);
  }
};

// delta[r] = sum_j go[r, j] * out[r, j].
template <class C>
struct RowDotFn {
  const C* go;
  const C* out;
  C* delta;
  int64_t dv;
  TESSERA_HOST_DEVICE void operator()(int64_t r) const {
    C acc = 0;
    for (int64_t j = 0; j < dv; ++j)
      acc += go[r * dv + j] * out[r * dv + j];
    delta[r] = acc;
  }
};

// In place on dP: dS = scale * P * (dP - delta).
template <class C>
struct AttentionScoreGradFn {
  C* dp;
  const C* p;
  const C* delta;
  int64_t s;
  C scale;
  TESSERA_HOST_DEVICE void operator()(int64_t e) const {
    dp[e] = scale * (p[e] * (dp[e] - delta[e / s]));
  }
};

template <class Exec>
struct Attention {
  template <class F>
  static void run(const char* op, Device device, int64_t n, const F& f) {
    launch<Exec>(op, device, n, f);
  }

  static AttentionResult forward(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                 double scale) {
    const char* op = "scaled_dot_product_attention";
    const AttentionDims n = check_attention_inputs(op, q, k, v, scale);
    const DType cdt = compute_dtype(q.dtype());
    const Tensor qc = in_compute(q, cdt), kc = in_compute(k, cdt), vc = in_compute(v, cdt);
    Tensor p = Linalg<Exec>::matmul(qc, kc, false, true);  // [B, H, T, S]
    Tensor lse = empty({n.batch, n.heads, n.t}, TensorOptions(cdt, q.device()));
    on_compute(cdt, [&]<class C>() {
      run(op, q.device(), n.batch * n.heads * n.t,
          AttentionSoftmaxFn<C>{data_of<C>(p), data_of<C>(lse), n.t, n.s, causal, C(scale)});
    });
    const Tensor out = Linalg<Exec>::matmul(p, vc, false, false);
    return {out.to(q.dtype()), lse};
  }

  static AttentionGrads backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const Tensor& out, const Tensor& lse, bool causal,
                                 double scale) {
    const char* op = "scaled_dot_product_attention_backward";
    const AttentionDims n = check_attention_inputs(op, q, k, v, scale);
    check_attention_backward(op, n, grad_out, out, lse);
    const DType cdt = compute_dtype(q.dtype());
    const Tensor qc = in_compute(q, cdt), kc = in_compute(k, cdt), vc = in_compute(v, cdt),
                 gc = in_compute(grad_out, cdt), oc = in_compute(out, cdt),
                 lc = in_compute(lse, cdt);
    Tensor p = Linalg<Exec>::matmul(qc, kc, false, true);
    const int64_t rows = n.batch * n.heads * n.t;
    Tensor delta = empty({rows}, TensorOptions(cdt, q.device()));
    Tensor dp = Linalg<Exec>::matmul(gc, vc, false, true);  // [B, H, T, S]
    on_compute(cdt, [&]<class C>() {
      run(op, q.device(), rows * n.s,
          AttentionProbsFn<C>{data_of<C>(p), data_of<C>(lc), n.t, n.s, causal, C(scale)});
      run(op, q.device(), rows,
          RowDotFn<C>{data_of<C>(gc), data_of<C>(oc), data_of<C>(delta), n.dv});
      run(op, q.device(), rows * n.s,
          AttentionScoreGradFn<C>{data_of<C>(dp), data_of<C>(p), data_of<C>(delta), n.s, C(scale)});
    });
    const Tensor dv = Linalg<Exec>::matmul(p, gc, true, false);
    const Tensor dq = Linalg<Exec>::matmul(dp, kc, false, false);
    const Tensor dk = Linalg<Exec>::matmul(dp, qc, true, false);
    return {dq.to(q.dtype()), dk.to(k.dtype()), dv.to(v.dtype())};
  }

  static void fill_table(registry::KernelTable& table) {
    table.scaled_dot_product_attention = &forward;
    table.scaled_dot_product_attention_backward = &backward;
  }
};

}  // namespace tessera::kernels::portable
