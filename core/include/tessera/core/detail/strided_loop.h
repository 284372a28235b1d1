#pragma once
// The one N-d loop every CPU kernel over arbitrary strides uses: it collapses dims that are
// contiguous for all operands and hands the kernel 1-D runs, so contiguous data becomes one long
// run the compiler can vectorise.
#include <array>
#include <cstdint>
#include <vector>

#include "tessera/core/shape.h"

namespace tessera::detail {

template <size_t N>
struct Run {
  std::array<int64_t, N> offset;  // element offset of the run's first element, per operand
  std::array<int64_t, N> stride;  // element stride inside the run, per operand
  int64_t length;
};

// Calls body(const Run<N>&) for each inner run covering `shape` in row-major order.
template <size_t N, class Body>
void for_each_run(const Shape& shape, const std::array<const Shape*, N>& strides, Body&& body) {
  // Drop size-1 dims and merge neighbours that are contiguous for every operand.
  std::vector<int64_t> sz;
  std::array<std::vector<int64_t>, N> st;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) return;
    if (shape[d] == 1) continue;
    bool merge = !sz.empty();
    for (size_t k = 0; k < N && merge; ++k)
      merge = st[k].back() == (*strides[k])[d] * shape[d];
    if (merge) {
      sz.back() *= shape[d];
      for (size_t k = 0; k < N; ++k)
        st[k].back() = (*strides[k])[d];
    } else {
      sz.push_back(shape[d]);
      for (size_t k = 0; k < N; ++k)
        st[k].push_back((*strides[k])[d]);
    }
  }
  Run<N> run{};
  if (sz.empty()) {
    run.length = 1;
    body(run);
    return;
  }
  const size_t nd = sz.size();
  run.length = sz[nd - 1];
  for (size_t k = 0; k < N; ++k)
    run.stride[k] = st[k][nd - 1];
  std::vector<int64_t> idx(nd, 0);
  while (true) {
    body(run);
    // Advance the outer multi-index (all dims but the last).
    int64_t d = int64_t(nd) - 2;
    for (; d >= 0; --d) {
      ++idx[d];
      for (size_t k = 0; k < N; ++k)
        run.offset[k] += st[k][d];
      if (idx[d] < sz[d]) break;
      for (size_t k = 0; k < N; ++k)
        run.offset[k] -= st[k][d] * sz[d];
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

}  // namespace tessera::detail
