#pragma once
// Turning caller tensors into MPI buffers: MPI wants one contiguous buffer (or one base pointer
// with per-rank displacements). Tensors that already are (chunks of one contiguous tensor, the
// common case) are used in place; anything else is staged through a copy.
#include <cstdint>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::mpi {

// Bytes [lo, hi) spanned by a tensor's elements; empty for an empty tensor.
struct ByteRange {
  uintptr_t lo = 0;
  uintptr_t hi = 0;
  bool empty() const { return lo == hi; }
};
ByteRange byte_range(const Tensor& t);
bool overlaps(const ByteRange& a, const ByteRange& b);
// True when some range of `a` overlaps some range of `b`.
bool any_overlap(std::vector<ByteRange> a, std::vector<ByteRange> b);

// An element count as MPI's int, or an error naming `op`: MPI-3 counts are 32-bit.
int to_count(int64_t n, const char* op);

// A list of tensors as one MPI buffer: base pointer plus per-piece element counts and
// displacements. `staging` is defined when the pieces had to be copied.
struct FlatList {
  void* base = nullptr;
  std::vector<int> counts;
  std::vector<int> displs;
  Tensor staging;
  std::vector<ByteRange> ranges;  // memory MPI will touch, for overlap checks
};
// Send side. `consecutive` demands rank-ordered pieces without gaps (reduce_scatter's input).
FlatList flat_send(const std::vector<Tensor>& pieces, DType dtype, bool consecutive,
                   const char* op);

// True when two of the (non-empty) ranges overlap.
bool pieces_overlap(const std::vector<ByteRange>& ranges);
// True when every element of `t` has memory of its own (no zero or negative strides, no dims
// that interleave), so MPI may receive into it where it lies.
bool writable_in_place(const Tensor& t);
// Whether some element of `a` and some element of `b` share memory. Exact for views of one
// storage with the same strides (the column blocks of a matrix interleave in memory but share
// nothing); otherwise true whenever their byte ranges overlap.
bool share_memory(const Tensor& a, const Tensor& b);
// Whether `a` and `b` are the same contiguous elements (shapes may differ).
bool same_elements(const Tensor& a, const Tensor& b);

}  // namespace tessera::mpi
