#pragma once
// Private to core: cross-entropy on logits [N, C] with int64 class targets (label smoothing fused
// in) and its backward on devices (see kernels.h for executors), a team of lanes per row
// (launch.h: launch_rows). A reduction adds the rows' float64 losses in order (reduce.h), so it
// does not depend on timing.
// Formulas, precision and checks (nn_checks.h) are the CPU's.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "../kernel_table.h"
#include "element_ops.h"
#include "launch.h"
#include "nn_checks.h"
#include "nn_launch.h"
#include "reduce.h"
#include "strided_index.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/core/kernels/views.h"

namespace tessera::kernels::portable {

// Every lane of the row's team returns the same value.
template <class C, class T, class Team>
TESSERA_HOST_DEVICE inline C row_logsumexp(const T* row, int64_t c, Team& team) {
  C m = -infinity<C>();
  for (int64_t j = team.lane(); j < c; j += team.size())
    m = C(row[j]) > m ? C(row[j]) : m;
  m = team.max(m);
  if (std::isinf(m) && m < 0) return m;  // as the CPU: all -inf; +inf gives NaN below
  C s = 0;
  for (int64_t j = team.lane(); j < c; j += team.size())
    s += std::exp(C(row[j]) - m);
  return m + std::log(team.sum(s));
}

// The options of one call, for every row; weight is on the device (nullptr: every class 1).
struct CrossEntropyRowOptions {
  int64_t c;
  double label_smoothing;
  const double* weight;
  double weight_total;
};

// Every lane of the row's team returns sum_j w[j] * x[j].
template <class C, class T, class Team>
TESSERA_HOST_DEVICE inline C row_weighted_sum(const T* row, const CrossEntropyRowOptions& o,
                                              Team& team) {
  C s = 0;
  for (int64_t j = team.lane(); j < o.c; j += team.size())
    s += o.weight ? C(o.weight[j]) * C(row[j]) : C(row[j]);
  return team.sum(s);
}

// Per row: the loss (0 for ignored rows, target -1) as T, or as float64 for a reduction: the
// CPU's (1 - eps) * w[t] * (lse - x[t]) + (eps / C) * (W * lse - sum_j w[j] * x[j]).
template <class T>
struct CrossEntropyRowFn {
  const T* x;
  const int64_t* target;
  T* loss;          // reduction none
  double* partial;  // reductions sum and mean
  CrossEntropyRowOptions o;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t i, Team& team) const {
    using C = compute_t<T>;
    C l = 0;
    const int64_t ti = target[i];
    if (ti >= 0) {
      const T* row = x + i * o.c;
      const C lse = row_logsumexp<C>(row, o.c, team);
      l = (o.weight ? C(o.weight[ti]) : C(1)) * (lse - C(row[ti]));
      if (o.label_smoothing != 0.0) {
        const C sum = row_weighted_sum<C>(row, o, team);
        const C smooth = o.weight ? (C(o.weight_total) * lse - sum) / C(o.c) : lse - sum / C(o.c);
        l = C(1.0 - o.label_smoothing) * l + C(o.label_smoothing) * smooth;
      }
    }
    if (team.lane() != 0) return;
    if (loss) {
      loss[i] = T(l);
    } else {
      partial[i] = double(l);
    }
  }
};

template <class T>
struct DivideTotalFn {
  const double* total;
  T* out;
  double divisor;  // 1 for a sum, the mean's divisor (0/0 = NaN when nothing is kept)
  TESSERA_HOST_DEVICE void operator()(int64_t) const {
    out[0] = T(compute_t<T>(total[0] / divisor));
  }
};

// The CPU's gradient: softmax * ((1 - eps) * w[t] + eps * W / C) - (1 - eps) * w[t] * onehot
// - (eps / C) * w, times the row's scale.
template <class T>
struct CrossEntropyBackwardFn {
  const T* x;
  const int64_t* target;
  const double* grad_loss;  // per row (reduction none) or one value
  T* gx;
  bool per_row;
  double divisor;  // 1, or the mean's divisor
  CrossEntropyRowOptions o;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t i, Team& team) const {
    using C = compute_t<T>;
    const int64_t c = o.c;
    T* grow = gx + i * c;
    const int64_t ti = target[i];
    if (ti < 0) {
      for (int64_t j = team.lane(); j < c; j += team.size())
        grow[j] = T(C(0));
      return;
    }
    const double eps = o.label_smoothing, wt = o.weight ? o.weight[ti] : 1.0;
    const T* row = x + i * c;
    const C lse = row_logsumexp<C>(row, c, team);
    const C scale = C(per_row ? grad_loss[i] : grad_loss[0] / divisor);
    const C mass = o.weight ? C((1.0 - eps) * wt + eps * o.weight_total / double(c)) : C(1);
    const C hit = C((1.0 - eps) * wt), uniform = C(eps / double(c));
    for (int64_t j = team.lane(); j < c; j += team.size()) {
      const C w = o.weight ? C(o.weight[j]) : C(1);
      const C p = std::exp(C(row[j]) - lse) * mass - (j == ti ? hit : C(0)) - uniform * w;
      grow[j] = T(p * scale);
    }
  }
};

template <class Exec>
struct CrossEntropy {
  using L = NnLaunch<Exec>;

  // The targets (and weights) on the logits' device, and the rows' options.
  struct Prepared {
    CrossEntropyTargets host;
    Tensor classes;
    Tensor weight;
    CrossEntropyRowOptions options;
  };
  static Prepared prepare(const char* op, const Tensor& logits, const Tensor& target,
                          int64_t ignore_index, double label_smoothing, const Tensor& weight) {
    Prepared p;
    const int64_t c = logits.size(1);
    p.host = cross_entropy_targets(op, target, c, ignore_index, weight);
    p.classes = L::to_device(p.host.classes, logits);
    if (!p.host.weight.empty()) p.weight = from_vector<double>(p.host.weight).to(logits.device());
    p.options = {c, label_smoothing, p.weight.defined() ? data_of<double>(p.weight) : nullptr,
                 p.host.weight_total};
    return p;
  }

  static Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                              Reduction reduction, double label_smoothing, const Tensor& weight) {
    const char* op = "cross_entropy";
    check_cross_entropy_args(op, logits, target, label_smoothing, weight);
    const int64_t n = logits.size(0);
    const Prepared p = prepare(op, logits, target, ignore_index, label_smoothing, weight);
    const Tensor x = logits.contiguous();
    const bool none = reduction == Reduction::None;
    Tensor out = L::on(logits, none ? Shape{n} : Shape{}, logits.dtype());
    dispatch_dtype(logits.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>) {
        if (none) {
          L::run_rows(op, x.device(), n,
                      CrossEntropyRowFn<T>{data_of<T>(x), data_of<int64_t>(p.classes),
                                           data_of<T>(out), nullptr, p.options});
          return;
        }
        const Tensor losses = L::on(logits, {n}, DType::Float64);
        L::run_rows(op, x.device(), n,
                    CrossEntropyRowFn<T>{data_of<T>(x), data_of<int64_t>(p.classes), nullptr,
                                         data_of<double>(losses), p.options});
        const Tensor total = Reduce<Exec>::sum(losses, {}, false);
        const double divisor = reduction == Reduction::Sum ? 1.0 : p.host.mean_divisor;
        L::run(op, x.device(), 1,
               DivideTotalFn<T>{data_of<double>(total), data_of<T>(out), divisor});
      }
    });
    return out;
  }

  static Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits,
                                       const Tensor& target, int64_t ignore_index,
                                       Reduction reduction, double label_smoothing,
                                       const Tensor& weight) {
    const char* op = "cross_entropy_backward";
    check_cross_entropy_args(op, logits, target, label_smoothing, weight);
    const int64_t n = logits.size(0);
    check_cross_entropy_grad(op, grad_loss, n, reduction);
    const Prepared p = prepare(op, logits, target, ignore_index, label_smoothing, weight);
    const Tensor gl = grad_loss.to(DType::Float64).contiguous();
    const Tensor x = logits.contiguous();
    Tensor gx = L::on(logits, logits.shape(), logits.dtype());
    const double divisor = reduction == Reduction::Mean ? p.host.mean_divisor : 1.0;
    dispatch_dtype(logits.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>)
        L::run_rows(op, x.device(), n,
                    CrossEntropyBackwardFn<T>{data_of<T>(x), data_of<int64_t>(p.classes),
                                              data_of<double>(gl), data_of<T>(gx),
                                              reduction == Reduction::None, divisor, p.options});
    });
    return gx;
  }

  static void fill_table(registry::KernelTable& table) {
    table.cross_entropy = &cross_entropy;
    table.cross_entropy_backward = &cross_entropy_backward;
  }
};

}  // namespace tessera::kernels::portable
