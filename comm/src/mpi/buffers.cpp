#include "buffers.h"

#include <algorithm>
#include <climits>

#include "tessera/core/error.h"
#include "tessera/core/factory.h"

namespace tessera::mpi {

ByteRange byte_range(const Tensor& t) {
  if (t.numel() == 0 || t.raw_data() == nullptr) return {};
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d)
    last += (t.size(d) - 1) * t.stride(d);
  auto lo = reinterpret_cast<uintptr_t>(t.raw_data());
  return {lo, lo + uintptr_t(last + 1) * t.element_size()};
}

bool overlaps(const ByteRange& a, const ByteRange& b) {
  return !a.empty() && !b.empty() && a.lo < b.hi && b.lo < a.hi;
}

bool any_overlap(std::vector<ByteRange> a, std::vector<ByteRange> b) {
  // Sweep by start: a range overlaps one of the other set iff that set's furthest end so far
  // (among ranges starting no later) reaches past its start.
  struct Tagged {
    ByteRange r;
    int set;
  };
  std::vector<Tagged> all;
  all.reserve(a.size() + b.size());
  for (const ByteRange& r : a)
    if (!r.empty()) all.push_back({r, 0});
  for (const ByteRange& r : b)
    if (!r.empty()) all.push_back({r, 1});
  std::sort(all.begin(), all.end(),
            [](const Tagged& x, const Tagged& y) { return x.r.lo < y.r.lo; });
  uintptr_t furthest[2] = {0, 0};
  for (const Tagged& t : all) {
    if (furthest[1 - t.set] > t.r.lo) return true;
    furthest[t.set] = std::max(furthest[t.set], t.r.hi);
  }
  return false;
}

int to_count(int64_t n, const char* op) {
  TESSERA_CHECK(n <= INT_MAX, op, ": ", n, " elements exceed MPI's count limit of ", INT_MAX,
                "; split the tensor");
  return int(n);
}

namespace {

// The pieces' memory as one buffer, if they are contiguous views of one storage at element
// offsets an int can hold; `consecutive` additionally demands piece r to start where r-1 ends.
bool flat_in_place(const std::vector<Tensor>& pieces, bool consecutive, FlatList& flat) {
  const Tensor* first = nullptr;
  for (const Tensor& p : pieces) {
    if (p.numel() == 0) continue;
    if (!p.is_contiguous()) return false;
    if (first == nullptr) first = &p;
    if (!p.storage().is_same(first->storage())) return false;
  }
  const size_t n = pieces.size();
  flat.counts.assign(n, 0);
  flat.displs.assign(n, 0);
  flat.ranges.assign(n, ByteRange{});
  if (first == nullptr) return true;  // all empty: nothing to send or receive
  int64_t base = INT64_MAX;
  for (const Tensor& p : pieces)
    if (p.numel() > 0) base = std::min(base, p.storage_offset());
  int64_t expected = -1;
  for (size_t r = 0; r < n; ++r) {
    const Tensor& p = pieces[r];
    if (p.numel() == 0) continue;
    if (consecutive && expected >= 0 && p.storage_offset() != expected) return false;
    expected = p.storage_offset() + p.numel();
    const int64_t displ = p.storage_offset() - base;
    if (displ > INT_MAX || p.numel() > INT_MAX) return false;
    flat.counts[r] = int(p.numel());
    flat.displs[r] = int(displ);
    flat.ranges[r] = byte_range(p);
  }
  if (consecutive) {
    // Empty leading pieces let offsets start anywhere; rebase so displacements are prefix sums.
    int acc = 0;
    for (size_t r = 0; r < n; ++r) {
      flat.displs[r] = acc;
      acc += flat.counts[r];
    }
  }
  flat.base = static_cast<char*>(first->storage().data()) + base * int64_t(first->element_size());
  return true;
}

FlatList staged(const std::vector<Tensor>& pieces, DType dtype, const char* op) {
  FlatList flat;
  const size_t n = pieces.size();
  flat.counts.resize(n);
  flat.displs.resize(n);
  int64_t total = 0;
  for (size_t r = 0; r < n; ++r) {
    flat.counts[r] = to_count(pieces[r].numel(), op);
    flat.displs[r] = to_count(total, op);
    total += pieces[r].numel();
  }
  to_count(total, op);
  flat.staging = empty({total}, dtype);
  flat.base = flat.staging.raw_data();
  flat.ranges.push_back(byte_range(flat.staging));
  return flat;
}

Tensor staged_piece(const FlatList& flat, size_t r, const Shape& shape) {
  return flat.staging.as_strided(shape, contiguous_strides(shape), flat.displs[r]);
}

bool pieces_overlap(const std::vector<ByteRange>& ranges) {
  std::vector<ByteRange> sorted;
  for (const ByteRange& r : ranges)
    if (!r.empty()) sorted.push_back(r);
  std::sort(sorted.begin(), sorted.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.lo < b.lo; });
  for (size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i].lo < sorted[i - 1].hi) return true;
  return false;
}

}  // namespace

FlatList flat_copy(const std::vector<Tensor>& pieces, DType dtype, const char* op) {
  FlatList flat = staged(pieces, dtype, op);
  for (size_t r = 0; r < pieces.size(); ++r) {
    if (pieces[r].numel() > 0) staged_piece(flat, r, pieces[r].shape()).copy_(pieces[r]);
  }
  return flat;
}

FlatList flat_send(const std::vector<Tensor>& pieces, DType dtype, bool consecutive,
                   const char* op) {
  FlatList flat;
  if (flat_in_place(pieces, consecutive, flat)) return flat;
  return flat_copy(pieces, dtype, op);
}

FlatList flat_recv(const std::vector<Tensor>& pieces, DType dtype, const char* op) {
  FlatList flat;
  if (flat_in_place(pieces, false, flat) && !pieces_overlap(flat.ranges)) return flat;
  return staged(pieces, dtype, op);
}

void unpack(const FlatList& flat, const std::vector<Tensor>& pieces) {
  if (!flat.staging.defined()) return;
  for (size_t r = 0; r < pieces.size(); ++r) {
    if (pieces[r].numel() == 0) continue;
    Tensor dst = pieces[r];
    dst.copy_(staged_piece(flat, r, pieces[r].shape()));
  }
}

}  // namespace tessera::mpi
