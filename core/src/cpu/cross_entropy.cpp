// Cross-entropy on logits [N, C] with int64 class targets [N], fused with its log-softmax so
// the probabilities are never materialised in the forward pass.
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

// Validated targets; -1 marks an ignored row.
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

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                     Reduction reduction) {
  const char* op = "cross_entropy";
  portable::check_cross_entropy_args(op, logits, target);
  const int64_t n = logits.size(0), c = logits.size(1);
  int64_t kept = 0;
  std::vector<int64_t> t = portable::class_indices(op, target, c, ignore_index, kept);
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
        C loss = 0;
        if (t[size_t(i)] >= 0) {
          const T* row = px + i * c;
          loss = logsumexp(row, c) - C(row[t[size_t(i)]]);
        }
        if (reduction == Reduction::None)
          po[i] = T(loss);
        else
          total += double(loss);
      }
      // Mean over zero kept rows is 0/0, as in PyTorch.
      if (reduction == Reduction::Sum) po[0] = T(C(total));
      if (reduction == Reduction::Mean)
        po[0] = T(C(kept ? total / double(kept) : std::numeric_limits<double>::quiet_NaN()));
    }
  });
  return out;
}

Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                              int64_t ignore_index, Reduction reduction) {
  const char* op = "cross_entropy_backward";
  portable::check_cross_entropy_args(op, logits, target);
  const int64_t n = logits.size(0), c = logits.size(1);
  portable::check_cross_entropy_grad(op, grad_loss, n, reduction);
  int64_t kept = 0;
  std::vector<int64_t> t = portable::class_indices(op, target, c, ignore_index, kept);
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
        const int64_t ti = t[size_t(i)];
        if (ti < 0) {
          std::fill(grow, grow + c, T(C(0)));
          continue;
        }
        double w = reduction == Reduction::None  ? gl[size_t(i)]
                   : reduction == Reduction::Sum ? gl[0]
                                                 : gl[0] / double(kept);
        const T* row = px + i * c;
        C lse = logsumexp(row, c);
        C scale = C(w);
        for (int64_t j = 0; j < c; ++j) {
          C p = std::exp(C(row[j]) - lse) - (j == ti ? C(1) : C(0));
          grow[j] = T(p * scale);
        }
      }
    }
  });
  return gx;
}

}  // namespace tessera::kernels::cpu
