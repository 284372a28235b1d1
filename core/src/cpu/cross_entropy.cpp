// Cross-entropy on logits [N, C] with class targets [N], fused with its log-softmax so the
// probabilities are never materialised in the forward pass, nor the log-softmax of label
// smoothing in either pass.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../portable/nn_checks.h"
#include "kernels.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/nn.h"

namespace tessera::kernels::cpu {

namespace {

// log(sum(exp(row))) computed stably.
template <class T>
compute_t<T> logsumexp(const T* row, int64_t c) {
  using C = compute_t<T>;
  C m = -std::numeric_limits<C>::infinity();
  for (int64_t j = 0; j < c; ++j)
    m = std::max(m, C(row[j]));
  // Every logit -inf: -inf (the loss is then NaN, as torch's). A +inf one goes through the sum
  // below to NaN, as in log_softmax.
  if (std::isinf(m) && m < 0) return m;
  C s = 0;
  for (int64_t j = 0; j < c; ++j)
    s += std::exp(C(row[j]) - m);
  return m + std::log(s);
}

// The options of one call, for every row.
struct RowOptions {
  int64_t c;
  double label_smoothing;
  const double* weight;  // nullptr: every class weighs 1
  double weight_total;
};

// A kept row's loss: (1 - eps) * w[t] * (lse - x[t]) + (eps / C) * sum_j w[j] * (lse - x[j]),
// the second sum taken as W * lse - sum_j w[j] * x[j] from one pass over the row. Without
// smoothing the first term alone, so that a -inf logit elsewhere in the row does not turn
// 0 * inf into NaN.
template <class T>
compute_t<T> row_loss(const T* row, int64_t target, const RowOptions& o) {
  using C = compute_t<T>;
  const C lse = logsumexp(row, o.c);
  const C nll = (o.weight ? C(o.weight[target]) : C(1)) * (lse - C(row[target]));
  if (o.label_smoothing == 0.0) return nll;
  C sum = 0;
  for (int64_t j = 0; j < o.c; ++j)
    sum += o.weight ? C(o.weight[j]) * C(row[j]) : C(row[j]);
  const C smooth = o.weight ? (C(o.weight_total) * lse - sum) / C(o.c) : lse - sum / C(o.c);
  return C(1.0 - o.label_smoothing) * nll + C(o.label_smoothing) * smooth;
}

// d(row loss)/dx * scale: softmax * ((1 - eps) * w[t] + eps * W / C) - (1 - eps) * w[t] * onehot
// - (eps / C) * w; without weights softmax - (1 - eps) * onehot - eps / C.
template <class T>
void row_grad(const T* row, int64_t target, const RowOptions& o, double scale, T* grow) {
  using C = compute_t<T>;
  const double eps = o.label_smoothing, wt = o.weight ? o.weight[target] : 1.0;
  const C lse = logsumexp(row, o.c);
  const C mass = o.weight ? C((1.0 - eps) * wt + eps * o.weight_total / double(o.c)) : C(1);
  const C hit = C((1.0 - eps) * wt), uniform = C(eps / double(o.c));
  const C s = C(scale);
  // The unweighted loop apart: it is the common one, and needs no multiply more than before.
  if (!o.weight) {
    for (int64_t j = 0; j < o.c; ++j)
      grow[j] = T((std::exp(C(row[j]) - lse) - (j == target ? hit : C(0)) - uniform) * s);
    return;
  }
  for (int64_t j = 0; j < o.c; ++j) {
    const C p =
        std::exp(C(row[j]) - lse) * mass - (j == target ? hit : C(0)) - uniform * C(o.weight[j]);
    grow[j] = T(p * s);
  }
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                     Reduction reduction, double label_smoothing, const Tensor& weight) {
  const char* op = "cross_entropy";
  portable::check_cross_entropy_args(op, logits, target, label_smoothing, weight);
  const int64_t n = logits.size(0), c = logits.size(1);
  const portable::CrossEntropyTargets t =
      portable::cross_entropy_targets(op, target, c, ignore_index, weight);
  const RowOptions o{c, label_smoothing, t.weight.empty() ? nullptr : t.weight.data(),
                     t.weight_total};
  Tensor x = logits.contiguous();
  Tensor out =
      reduction == Reduction::None ? empty({n}, logits.dtype()) : empty({}, logits.dtype());
  dispatch_dtype(logits.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      using C = compute_t<T>;
      const T* px = x.data<T>();
      T* po = out.data<T>();
      double total = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t ti = t.classes[size_t(i)];
        const C loss = ti < 0 ? C(0) : row_loss(px + i * c, ti, o);
        if (reduction == Reduction::None)
          po[i] = T(loss);
        else
          total += double(loss);
      }
      // A mean over zero kept rows (or weights) is 0/0, NaN as in PyTorch.
      if (reduction == Reduction::Sum) po[0] = T(C(total));
      if (reduction == Reduction::Mean) po[0] = T(C(total / t.mean_divisor));
    }
  });
  return out;
}

Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                              int64_t ignore_index, Reduction reduction, double label_smoothing,
                              const Tensor& weight) {
  const char* op = "cross_entropy_backward";
  portable::check_cross_entropy_args(op, logits, target, label_smoothing, weight);
  const int64_t n = logits.size(0), c = logits.size(1);
  portable::check_cross_entropy_grad(op, grad_loss, n, reduction);
  const portable::CrossEntropyTargets t =
      portable::cross_entropy_targets(op, target, c, ignore_index, weight);
  const RowOptions o{c, label_smoothing, t.weight.empty() ? nullptr : t.weight.data(),
                     t.weight_total};
  std::vector<double> gl = grad_loss.to_vector<double>();
  Tensor x = logits.contiguous();
  Tensor gx = empty(logits.shape(), logits.dtype());
  dispatch_dtype(logits.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      using C = compute_t<T>;
      const T* px = x.data<T>();
      T* pg = gx.data<T>();
      for (int64_t i = 0; i < n; ++i) {
        T* grow = pg + i * c;
        const int64_t ti = t.classes[size_t(i)];
        if (ti < 0) {
          std::fill(grow, grow + c, T(C(0)));
          continue;
        }
        const double scale = reduction == Reduction::None  ? gl[size_t(i)]
                             : reduction == Reduction::Sum ? gl[0]
                                                           : gl[0] / t.mean_divisor;
        row_grad(px + i * c, ti, o, scale, grow);
      }
    }
  });
  return gx;
}

}  // namespace tessera::kernels::cpu
