#pragma once
// Private to core: cross-entropy on logits [N, C] with int64 class targets and its backward on
// devices (see kernels.h for executors), a team of lanes per row (launch.h: launch_rows). A
// reduction adds the rows' float64 losses in order (reduce.h), so it does not depend on timing.
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

// Per row: the loss (0 for ignored rows, target -1) as T, or as float64 for a reduction.
template <class T>
struct CrossEntropyRowFn {
  const T* x;
  const int64_t* target;
  T* loss;          // reduction none
  double* partial;  // reductions sum and mean
  int64_t c;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t i, Team& team) const {
    using C = compute_t<T>;
    C l = 0;
    if (target[i] >= 0) l = row_logsumexp<C>(x + i * c, c, team) - C(x[i * c + target[i]]);
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
  double divisor;  // 1 for a sum, the kept rows for a mean (0/0 = NaN when none is kept)
  TESSERA_HOST_DEVICE void operator()(int64_t) const {
    out[0] = T(compute_t<T>(total[0] / divisor));
  }
};

template <class T>
struct CrossEntropyBackwardFn {
  const T* x;
  const int64_t* target;
  const double* grad_loss;  // per row (reduction none) or one value
  T* gx;
  int64_t c;
  bool per_row;
  double divisor;  // 1, or the kept rows for a mean
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t i, Team& team) const {
    using C = compute_t<T>;
    T* grow = gx + i * c;
    const int64_t ti = target[i];
    if (ti < 0) {
      for (int64_t j = team.lane(); j < c; j += team.size())
        grow[j] = T(C(0));
      return;
    }
    const double w = per_row ? grad_loss[i] : grad_loss[0] / divisor;
    const T* row = x + i * c;
    const C lse = row_logsumexp<C>(row, c, team);
    const C scale = C(w);
    for (int64_t j = team.lane(); j < c; j += team.size()) {
      const C p = std::exp(C(row[j]) - lse) - (j == ti ? C(1) : C(0));
      grow[j] = T(p * scale);
    }
  }
};

template <class Exec>
struct CrossEntropy {
  using L = NnLaunch<Exec>;

  static Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                              Reduction reduction) {
    const char* op = "cross_entropy";
    check_cross_entropy_args(op, logits, target);
    const int64_t n = logits.size(0), c = logits.size(1);
    int64_t kept = 0;
    const Tensor t = L::to_device(class_indices(op, target, c, ignore_index, kept), logits);
    const Tensor x = logits.contiguous();
    const bool none = reduction == Reduction::None;
    Tensor out = L::on(logits, none ? Shape{n} : Shape{}, logits.dtype());
    dispatch_dtype(logits.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>) {
        if (none) {
          L::run_rows(op, x.device(), n,
                      CrossEntropyRowFn<T>{data_of<T>(x), data_of<int64_t>(t), data_of<T>(out),
                                           nullptr, c});
          return;
        }
        const Tensor losses = L::on(logits, {n}, DType::Float64);
        L::run_rows(op, x.device(), n,
                    CrossEntropyRowFn<T>{data_of<T>(x), data_of<int64_t>(t), nullptr,
                                         data_of<double>(losses), c});
        const Tensor total = Reduce<Exec>::sum(losses, {}, false);
        const double divisor = reduction == Reduction::Sum ? 1.0 : double(kept);
        L::run(op, x.device(), 1,
               DivideTotalFn<T>{data_of<double>(total), data_of<T>(out), divisor});
      }
    });
    return out;
  }

  static Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits,
                                       const Tensor& target, int64_t ignore_index,
                                       Reduction reduction) {
    const char* op = "cross_entropy_backward";
    check_cross_entropy_args(op, logits, target);
    const int64_t n = logits.size(0), c = logits.size(1);
    check_cross_entropy_grad(op, grad_loss, n, reduction);
    int64_t kept = 0;
    const Tensor t = L::to_device(class_indices(op, target, c, ignore_index, kept), logits);
    const Tensor gl = grad_loss.to(DType::Float64).contiguous();
    const Tensor x = logits.contiguous();
    Tensor gx = L::on(logits, logits.shape(), logits.dtype());
    const double divisor = reduction == Reduction::Mean ? double(kept) : 1.0;
    dispatch_dtype(logits.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>)
        L::run_rows(
            op, x.device(), n,
            CrossEntropyBackwardFn<T>{data_of<T>(x), data_of<int64_t>(t), data_of<double>(gl),
                                      data_of<T>(gx), c, reduction == Reduction::None, divisor});
    });
    return gx;
  }

  static void fill_table(registry::KernelTable& table) {
    table.cross_entropy = &cross_entropy;
    table.cross_entropy_backward = &cross_entropy_backward;
  }
};

}  // namespace tessera::kernels::portable
