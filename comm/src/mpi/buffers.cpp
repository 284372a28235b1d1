#include "buffers.h"

#include <algorithm>
#include <climits>
#include <utility>

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
    // MPI takes the sum of the counts as the buffer's length, in an int: a larger total goes to
    // the staged path, which refuses it with a message.
    int64_t total = 0;
    for (int c : flat.counts)
      total += c;
    if (total > INT_MAX) return false;
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
  int64_t total = 0;
  for (const Tensor& p : pieces)
    total += p.numel();
  // Checked before anything is allocated: every count and displacement then fits an int too.
  TESSERA_CHECK(total <= INT_MAX, op, ": the ", n, " pieces total ", total,
                " elements, more than MPI's count limit of ", INT_MAX,
                " for one buffer; split the tensors");
  flat.counts.resize(n);
  flat.displs.resize(n);
  int64_t at = 0;
  for (size_t r = 0; r < n; ++r) {
    flat.counts[r] = int(pieces[r].numel());
    flat.displs[r] = int(at);
    at += pieces[r].numel();
  }
  flat.staging = empty({total}, dtype);
  flat.base = flat.staging.raw_data();
  flat.ranges.push_back(byte_range(flat.staging));
  return flat;
}

Tensor staged_piece(const FlatList& flat, size_t r, const Shape& shape) {
  return flat.staging.as_strided(shape, contiguous_strides(shape), flat.displs[r]);
}

}  // namespace

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

bool writable_in_place(const Tensor& t) {
  // Sufficient, not necessary: ordered by stride, each dim must step over everything the
  // smaller-strided dims span. Layouts that fail (broadcasts, exotic as_strided views) are
  // received into a fresh tensor instead.
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 0) return true;
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;
  for (const auto& [stride, size] : dims) {
    if (stride < span) return false;
    span = stride * size;
  }
  return true;
}

namespace {

struct Dim {
  int64_t stride, size_a, size_b;
};

// Whether a + i * s + x == b + j * s + y for in-range i, j and x, y in the lower dims, with
// delta = b - a: only the few k = i - j that leave the remainder within the lower dims' reach
// are tried, and each recurses on the lower dims.
bool lattices_meet(const std::vector<Dim>& dims, size_t level, int64_t delta) {
  if (level == dims.size()) return delta == 0;
  const Dim& d = dims[level];
  int64_t reach_a = 0, reach_b = 0;  // furthest element of the lower dims
  for (size_t e = level + 1; e < dims.size(); ++e) {
    reach_a += (dims[e].size_a - 1) * dims[e].stride;
    reach_b += (dims[e].size_b - 1) * dims[e].stride;
  }
  // delta - k * stride must lie in [-reach_b, reach_a] (an element x of a minus one y of b).
  auto floor_div = [](int64_t x, int64_t y) { return x / y - (x % y != 0 && (x < 0) != (y < 0)); };
  const int64_t lo = std::max(-(d.size_b - 1), -floor_div(-(delta - reach_a), d.stride));
  const int64_t hi = std::min(d.size_a - 1, floor_div(delta + reach_b, d.stride));
  if (hi - lo > 2) return true;  // not nested dims: give up, conservatively
  for (int64_t k = lo; k <= hi; ++k) {
    if (lattices_meet(dims, level + 1, delta - k * d.stride)) return true;
  }
  return false;
}

}  // namespace

bool share_memory(const Tensor& a, const Tensor& b) {
  if (!overlaps(byte_range(a), byte_range(b))) return false;
  if (!a.storage().is_same(b.storage()) || a.dtype() != b.dtype() || a.dim() != b.dim() ||
      a.strides() != b.strides()) {
    return true;
  }
  std::vector<Dim> dims;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.stride(d) <= 0) return true;
    if (a.size(d) > 1 || b.size(d) > 1) dims.push_back({a.stride(d), a.size(d), b.size(d)});
  }
  std::sort(dims.begin(), dims.end(),
            [](const Dim& x, const Dim& y) { return x.stride > y.stride; });
  return lattices_meet(dims, 0, b.storage_offset() - a.storage_offset());
}

bool same_elements(const Tensor& a, const Tensor& b) {
  return a.is_contiguous() && b.is_contiguous() && a.numel() == b.numel() &&
         (a.numel() == 0 || a.raw_data() == b.raw_data());
}

FlatList flat_send(const std::vector<Tensor>& pieces, DType dtype, bool consecutive,
                   const char* op) {
  FlatList flat;
  if (flat_in_place(pieces, consecutive, flat)) return flat;
  flat = staged(pieces, dtype, op);
  for (size_t r = 0; r < pieces.size(); ++r) {
    if (pieces[r].numel() > 0) staged_piece(flat, r, pieces[r].shape()).copy_(pieces[r]);
  }
  return flat;
}

}  // namespace tessera::mpi
