// The CPU kernels of vocabulary-parallel embedding and cross-entropy, one pass per row.
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "../portable/vocab.h"
#include "kernels.h"
#include "tessera/core/factory.h"

namespace tessera::kernels::cpu {

using portable::check_vocab_rows;
using portable::vocab_float_rows;

VocabShardIds vocab_shard_ids(const Tensor& ids_in, int64_t start, int64_t rows, int64_t vocab) {
  const Tensor ids = ids_in.to(DType::Int64).contiguous();
  Tensor shifted = empty(ids.shape(), DType::Int64);
  Shape mask_shape = ids.shape();
  mask_shape.push_back(1);
  Tensor foreign = empty(mask_shape, DType::Bool);
  const int64_t* id = ids.data<int64_t>();
  int64_t* sh = shifted.data<int64_t>();
  bool* fo = foreign.data<bool>();
  portable::checked_vocab_ids(ids, vocab);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    const bool mine = id[i] >= start && id[i] < start + rows;
    sh[i] = mine ? id[i] - start : 0;
    fo[i] = !mine;
  }
  return {shifted, foreign};
}

Tensor vocab_ce_stats(const Tensor& x, const Tensor& row_max, const Tensor& target, int64_t start) {
  Tensor stats;
  vocab_float_rows("vocab_ce_stats", x, [&]<class C>() {
    const int64_t rows = x.size(0), n = x.size(1);
    check_vocab_rows("vocab_ce_stats", row_max, "row_max", rows, x.dtype());
    check_vocab_rows("vocab_ce_stats", target, "target", rows, DType::Int64);
    stats = empty({rows, 2}, x.dtype());
    // The device kernel's row body (portable/vocab.h), run row by row by a team of one.
    const portable::VocabStatsFn<C> row{
        x.data<C>(), row_max.data<C>(), target.data<int64_t>(), stats.data<C>(), n, start};
    portable::SerialTeam team;
    for (int64_t i = 0; i < rows; ++i)
      row(i, team);
  });
  return stats;
}

VocabCrossEntropy vocab_ce_loss(const Tensor& stats, const Tensor& row_max, const Tensor& target,
                                int64_t kept) {
  VocabCrossEntropy out;
  vocab_float_rows("vocab_ce_loss", stats, [&]<class C>() {
    const int64_t rows = stats.size(0);
    check_vocab_rows("vocab_ce_loss", row_max, "row_max", rows, stats.dtype());
    check_vocab_rows("vocab_ce_loss", target, "target", rows, DType::Int64);
    out.lse = empty({rows}, stats.dtype());
    std::vector<double> partial(static_cast<size_t>(rows));
    const portable::VocabLossRowFn<C> row{stats.data<C>(), row_max.data<C>(),
                                          target.data<int64_t>(), out.lse.data<C>(),
                                          partial.data()};
    double total = 0;
    for (int64_t i = 0; i < rows; ++i) {
      row(i);
      total += partial[size_t(i)];
    }
    const double mean = kept ? total / double(kept) : std::numeric_limits<double>::quiet_NaN();
    out.loss = scalar_tensor(double(C(mean)), stats.dtype());
  });
  return out;
}

Tensor vocab_ce_backward(const Tensor& x, const Tensor& lse, const Tensor& target, int64_t start,
                         double scale) {
  Tensor out;
  vocab_float_rows("vocab_ce_backward", x, [&]<class C>() {
    const int64_t rows = x.size(0), n = x.size(1);
    check_vocab_rows("vocab_ce_backward", lse, "lse", rows, x.dtype());
    check_vocab_rows("vocab_ce_backward", target, "target", rows, DType::Int64);
    out = empty({rows, n}, x.dtype());
    const portable::VocabBackwardFn<C> element{
        x.data<C>(), lse.data<C>(), target.data<int64_t>(), out.data<C>(), n, start, C(scale)};
    for (int64_t t = 0; t < rows * n; ++t)
      element(t);
  });
  return out;
}

}  // namespace tessera::kernels::cpu
