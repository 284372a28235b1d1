#pragma once
// Private to core: the vocabulary-parallel kernels (kernels/vocab_parallel.h) on devices (a
// team per row for the sums, a thread per element for the gradient), with the checks and
// formulas the CPU's (cpu/vocab_parallel.cpp) shares from here.
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "../kernel_table.h"
#include "element_ops.h"
#include "float_dispatch.h"
#include "launch.h"
#include "reduce.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/vocab_parallel.h"

namespace tessera::kernels::portable {

// x of the cross-entropy stages: a contiguous float32/float64 [N, n]; runs f<C> for its dtype.
template <class F>
void vocab_float_rows(const char* op, const Tensor& x, F&& f) {
  TESSERA_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x ", x.str(),
                " must be a contiguous [N, n] tensor");
  dispatch_float32_or_64(op, "x", x, std::forward<F>(f));
}

inline void check_vocab_rows(const char* op, const Tensor& t, const char* what, int64_t rows,
                             DType dtype) {
  TESSERA_CHECK(t.numel() == rows && t.dtype() == dtype && t.is_contiguous(), op, ": ", what, " ",
                t.str(), " must be a contiguous ", dtype_name(dtype), " tensor of ", rows,
                " elements");
}

// A row's shift: its global max, or 0 when that is not finite (an all -inf row).
template <class C>
TESSERA_HOST_DEVICE inline C vocab_shift(C row_max) {
  return std::isfinite(row_max) ? row_max : C(0);
}

// ids read to the host and each checked against the vocabulary, as the CPU does.
inline std::vector<int64_t> checked_vocab_ids(const Tensor& ids, int64_t vocab) {
  std::vector<int64_t> v = ids.to_vector<int64_t>();
  for (size_t i = 0; i < v.size(); ++i)
    TESSERA_CHECK(v[i] >= 0 && v[i] < vocab, "embedding: id ", v[i], " at position ", i, " of ids ",
                  shape_str(ids.shape()), " is out of range for a vocabulary of ", vocab);
  return v;
}

struct ShardIdsFn {
  const int64_t* id;
  int64_t* local;
  bool* foreign;
  int64_t start, rows;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    const bool mine = id[i] >= start && id[i] < start + rows;
    local[i] = mine ? id[i] - start : 0;
    foreign[i] = !mine;
  }
};

template <class C>
struct VocabStatsFn {
  const C* x;
  const C* row_max;
  const int64_t* target;
  C* stats;
  int64_t n, start;
  template <class Team>
  TESSERA_HOST_DEVICE void operator()(int64_t i, Team& team) const {
    const C shift = vocab_shift(row_max[i]);
    C acc = 0;
    for (int64_t j = team.lane(); j < n; j += team.size())
      acc += std::exp(x[i * n + j] - shift);
    acc = team.sum(acc);
    if (team.lane() != 0) return;
    stats[2 * i] = acc;
    const int64_t lt = target[i] >= start && target[i] < start + n ? target[i] - start : -1;
    stats[2 * i + 1] = lt >= 0 ? x[i * n + lt] : C(0);
  }
};

template <class C>
struct VocabLossRowFn {
  const C* stats;
  const C* row_max;
  const int64_t* target;
  C* lse;
  double* partial;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    lse[i] = std::log(stats[2 * i]) + vocab_shift(row_max[i]);
    partial[i] = target[i] >= 0 ? double(lse[i] - stats[2 * i + 1]) : 0.0;
  }
};

template <class C>
struct VocabMeanFn {
  const double* total;
  C* out;
  double divisor;  // kept rows; NaN when none
  TESSERA_HOST_DEVICE void operator()(int64_t) const { out[0] = C(total[0] / divisor); }
};

// One element t = i * n + j of the gradient.
template <class C>
struct VocabBackwardFn {
  const C* x;
  const C* lse;
  const int64_t* target;
  C* out;
  int64_t n, start;
  C scale;
  TESSERA_HOST_DEVICE void operator()(int64_t t) const {
    const int64_t i = t / n, j = t - i * n;
    const int64_t lt = target[i] >= start && target[i] < start + n ? target[i] - start : -1;
    const C p = target[i] < 0 ? C(0) : std::exp(x[t] - lse[i]) - (j == lt ? C(1) : C(0));
    out[t] = target[i] < 0 ? C(0) : C(p * scale);
  }
};

template <class Exec>
struct Vocab {
  template <class F>
  static void run(const char* op, Device device, int64_t n, const F& f) {
    launch<Exec>(op, device, n, f);
  }

  static VocabShardIds shard_ids(const Tensor& ids_in, int64_t start, int64_t rows, int64_t vocab) {
    const Tensor ids = ids_in.to(DType::Int64).contiguous();
    checked_vocab_ids(ids, vocab);
    Tensor local = empty(ids.shape(), TensorOptions(DType::Int64, ids.device()));
    Shape mask_shape = ids.shape();
    mask_shape.push_back(1);
    Tensor foreign = empty(mask_shape, TensorOptions(DType::Bool, ids.device()));
    run("vocab_shard_ids", ids.device(), ids.numel(),
        ShardIdsFn{data_of<int64_t>(ids), data_of<int64_t>(local), data_of<bool>(foreign), start,
                   rows});
    return {local, foreign};
  }

  static Tensor stats(const Tensor& x, const Tensor& row_max, const Tensor& target, int64_t start) {
    Tensor out;
    vocab_float_rows("vocab_ce_stats", x, [&]<class C>() {
      const int64_t rows = x.size(0), n = x.size(1);
      check_vocab_rows("vocab_ce_stats", row_max, "row_max", rows, x.dtype());
      check_vocab_rows("vocab_ce_stats", target, "target", rows, DType::Int64);
      out = empty({rows, 2}, TensorOptions(x.dtype(), x.device()));
      launch_rows<Exec>("vocab_ce_stats", x.device(), rows,
                        VocabStatsFn<C>{data_of<C>(x), data_of<C>(row_max),
                                        data_of<int64_t>(target), data_of<C>(out), n, start});
    });
    return out;
  }

  static VocabCrossEntropy loss(const Tensor& stats, const Tensor& row_max, const Tensor& target,
                                int64_t kept) {
    VocabCrossEntropy out;
    vocab_float_rows("vocab_ce_loss", stats, [&]<class C>() {
      const int64_t rows = stats.size(0);
      check_vocab_rows("vocab_ce_loss", row_max, "row_max", rows, stats.dtype());
      check_vocab_rows("vocab_ce_loss", target, "target", rows, DType::Int64);
      out.lse = empty({rows}, TensorOptions(stats.dtype(), stats.device()));
      const Tensor partial = empty({rows}, TensorOptions(DType::Float64, stats.device()));
      run("vocab_ce_loss", stats.device(), rows,
          VocabLossRowFn<C>{data_of<C>(stats), data_of<C>(row_max), data_of<int64_t>(target),
                            data_of<C>(out.lse), data_of<double>(partial)});
      const Tensor total = Reduce<Exec>::sum(partial, {}, false);
      out.loss = empty({}, TensorOptions(stats.dtype(), stats.device()));
      const double divisor = kept ? double(kept) : std::numeric_limits<double>::quiet_NaN();
      run("vocab_ce_loss", stats.device(), 1,
          VocabMeanFn<C>{data_of<double>(total), data_of<C>(out.loss), divisor});
    });
    return out;
  }

  static Tensor backward(const Tensor& x, const Tensor& lse, const Tensor& target, int64_t start,
                         double scale) {
    Tensor out;
    vocab_float_rows("vocab_ce_backward", x, [&]<class C>() {
      const int64_t rows = x.size(0), n = x.size(1);
      check_vocab_rows("vocab_ce_backward", lse, "lse", rows, x.dtype());
      check_vocab_rows("vocab_ce_backward", target, "target", rows, DType::Int64);
      out = empty({rows, n}, TensorOptions(x.dtype(), x.device()));
      run("vocab_ce_backward", x.device(), rows * n,
          VocabBackwardFn<C>{data_of<C>(x), data_of<C>(lse), data_of<int64_t>(target),
                             data_of<C>(out), n, start, C(scale)});
    });
    return out;
  }

  static void fill_table(registry::KernelTable& table) {
    table.vocab_shard_ids = &shard_ids;
    table.vocab_ce_stats = &stats;
    table.vocab_ce_loss = &loss;
    table.vocab_ce_backward = &backward;
  }
};

}  // namespace tessera::kernels::portable
