#include "checksum.h"

#include <algorithm>
#include <cstring>

#include "tessera/core/error.h"

namespace tessera::ckpt {

namespace {

// The bijective mixer of the table's own checksum (splitmix64's finalizer).
inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// copy_block prefetches runs of at most this many bytes, this many runs ahead.
constexpr int64_t kPrefetchRunBytes = 8 << 10;
constexpr int kPrefetchRuns = 2;

typedef uint64_t U64x8 __attribute__((vector_size(64)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

// Adds sum(w_j) and sum(w_j * (2 (first + j) + 1)) over n whole words at p, and copies them to
// `to` when it is given (Copy), in the same pass: the words are summed while in registers. The
// second sum is (2 first + 1) sum(w_j) + 2 sum(j w_j); sum(j w_j) comes from running sums in 8
// interleaved lanes (lane l holds words 8t + l): with P a lane's running sum and Q the sum of its
// running sums over T rounds, sum_t t x_t = T P - Q. Only additions in the loop, on 8-lane vectors.
template <bool Copy>
void add_words(const unsigned char* p, unsigned char* to, int64_t n, uint64_t first,
               uint64_t* out) {
  constexpr int L = 8;
  U64x8 P = {}, Q = {};
  const int64_t T = n / L;
  for (int64_t t = 0; t < T; ++t) {
    U32x8 x;
    std::memcpy(&x, p + size_t(t) * L * 4, sizeof x);
    if constexpr (Copy) std::memcpy(to + size_t(t) * L * 4, &x, sizeof x);
    P += __builtin_convertvector(x, U64x8);
    Q += P;
  }
  uint64_t a = 0, jx = 0;
  for (int l = 0; l < L; ++l) {
    a += P[l];
    jx += uint64_t(L) * (uint64_t(T) * P[l] - Q[l]) + uint64_t(l) * P[l];
  }
  for (int64_t j = T * L; j < n; ++j) {
    uint32_t w;
    std::memcpy(&w, p + size_t(j) * 4, 4);
    if constexpr (Copy) std::memcpy(to + size_t(j) * 4, &w, 4);
    a += w;
    jx += uint64_t(j) * w;
  }
  out[0] += a;
  out[1] += (2 * first + 1) * a + 2 * jx;
}

// One word of which only the bytes [k, k + n) are this piece's: the rest read as zeros.
void add_partial_word(const unsigned char* p, int k, int n, uint64_t index, uint64_t* out) {
  uint32_t w = 0;
  std::memcpy(reinterpret_cast<unsigned char*>(&w) + k, p, size_t(n));
  out[0] += w;
  out[1] += uint64_t(w) * (2 * index + 1);
}

// The `len` bytes at p that lie at byte `pos` of the dataset, within one tile (copied to `to`
// too, with Copy).
template <bool Copy>
void add_run(const unsigned char* p, unsigned char* to, int64_t len, uint64_t pos, uint64_t* out) {
  if (pos % 4 != 0) {
    const int k = int(pos % 4), n = int(std::min<int64_t>(4 - k, len));
    add_partial_word(p, k, n, pos / 4, out);
    if constexpr (Copy) std::memcpy(to, p, size_t(n));
    p += n;
    to += Copy ? n : 0;
    pos += uint64_t(n);
    len -= n;
  }
  const int64_t words = len / 4;
  add_words<Copy>(p, to, words, pos / 4, out);
  p += words * 4;
  to += Copy ? words * 4 : 0;
  pos += uint64_t(words) * 4;
  len -= words * 4;
  if (len > 0) {
    add_partial_word(p, 0, int(len), pos / 4, out);
    if constexpr (Copy) std::memcpy(to, p, size_t(len));
  }
}

// The block [offset, offset + shape) of a row-major dataset of shape `global` as runs: byte
// ranges contiguous in the dataset, in the block's row-major order. The dims after the last one
// the block cuts are whole, so a run spans them (a block of whole rows is one run).
class Runs {
 public:
  Runs(const Shape& global, const Shape& offset, const Shape& shape, size_t element_size)
      : global_(global), offset_(offset), shape_(shape) {
    const int64_t nd = int64_t(global.size());
    int64_t k = nd - 1;  // the last dim the block cuts (its run covers it partly)
    while (k > 0 && shape[size_t(k)] == global[size_t(k)])
      --k;
    run_ = int64_t(element_size);
    for (int64_t d = std::max<int64_t>(k, 0); d < nd; ++d)
      run_ *= d == k ? shape[size_t(d)] : global[size_t(d)];
    outer_ = std::max<int64_t>(k, 0);  // dims iterated run by run
    count_ = 1;
    for (int64_t d = 0; d < outer_; ++d)
      count_ *= shape[size_t(d)];
    stride_.assign(size_t(nd), int64_t(element_size));
    for (int64_t d = nd - 2; d >= 0; --d)
      stride_[size_t(d)] = stride_[size_t(d + 1)] * global[size_t(d + 1)];
  }
  int64_t count() const { return shape_numel(shape_) == 0 ? 0 : count_; }
  int64_t bytes() const { return run_; }
  // Bytes from the first run's start to the last one's (count() > 0).
  int64_t last_from_first() const {
    int64_t d_pos = 0;
    for (int64_t d = 0; d < outer_; ++d)
      d_pos += (shape_[size_t(d)] - 1) * stride_[size_t(d)];
    return d_pos;
  }

  // Walks the runs in order, keeping the position instead of recomputing it per run (a column
  // window has a run per row, a few KiB each).
  class Cursor {
   public:
    explicit Cursor(const Runs& runs) : runs_(runs), idx_(size_t(runs.outer_), 0) {
      for (size_t d = 0; d < runs.global_.size(); ++d)
        pos_ += runs.offset_[d] * runs.stride_[d];
    }
    int64_t pos() const { return pos_; }  // byte position in the dataset of the current run
    void next() {
      for (int64_t d = runs_.outer_ - 1; d >= 0; --d) {
        pos_ += runs_.stride_[size_t(d)];
        if (++idx_[size_t(d)] < runs_.shape_[size_t(d)]) return;
        pos_ -= idx_[size_t(d)] * runs_.stride_[size_t(d)];
        idx_[size_t(d)] = 0;
      }
    }

   private:
    const Runs& runs_;
    std::vector<int64_t> idx_;  // index in the block of each iterated dim
    int64_t pos_ = 0;
  };

 private:
  const Shape &global_, &offset_, &shape_;
  std::vector<int64_t> stride_;  // bytes per index of each dim, in the dataset
  int64_t run_ = 0, outer_ = 0, count_ = 0;
};

// Calls fn(length, dataset position, tile) for each part of the run of `len` bytes at dataset
// byte `pos`, split where tiles end.
template <typename Fn>
void split_at_tiles(int64_t pos, int64_t len, int64_t tile_bytes, Fn&& fn) {
  while (len > 0) {
    const int64_t t = pos / tile_bytes;
    const int64_t take = std::min<int64_t>(len, (t + 1) * tile_bytes - pos);
    fn(take, pos, t);
    pos += take;
    len -= take;
  }
}

}  // namespace

void add_block_checksums(const void* data, size_t element_size, const Shape& global,
                         const Shape& offset, const Shape& shape, int64_t tile_bytes,
                         uint64_t* sums) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  const Runs runs(global, offset, shape, element_size);
  Runs::Cursor at(runs);
  for (int64_t r = 0; r < runs.count(); ++r, at.next()) {
    const unsigned char* p = bytes + r * runs.bytes();
    split_at_tiles(at.pos(), runs.bytes(), tile_bytes, [&](int64_t len, int64_t pos, int64_t t) {
      add_run<false>(p, nullptr, len, uint64_t(pos), sums + kWordsPerTile * t);
      p += len;
    });
  }
}

ByteSpan block_span(size_t element_size, const Shape& global, const Shape& offset,
                    const Shape& shape) {
  const Runs runs(global, offset, shape, element_size);
  if (runs.count() == 0) return {};
  const int64_t first = Runs::Cursor(runs).pos();
  return {first, first + runs.last_from_first() + runs.bytes()};
}

void copy_block(const void* span, void* out, size_t element_size, const Shape& global,
                const Shape& offset, const Shape& shape, int64_t tile_bytes, uint64_t* sums) {
  const Runs runs(global, offset, shape, element_size);
  if (runs.count() == 0) return;
  Runs::Cursor at(runs), ahead(runs);
  // Dataset byte `pos` is at src + (pos - first).
  const auto* src = static_cast<const unsigned char*>(span);
  const int64_t first = at.pos();
  auto* dst = static_cast<unsigned char*>(out);
  // Short runs far apart (a column window) defeat the hardware prefetcher, which follows one
  // page at a time: ask for the run after next while copying this one.
  const bool prefetch = runs.bytes() <= kPrefetchRunBytes;
  if (prefetch)
    for (int i = 0; i < kPrefetchRuns && i < runs.count(); ++i)
      ahead.next();
  for (int64_t r = 0; r < runs.count(); ++r, at.next()) {
    if (prefetch && r + kPrefetchRuns < runs.count()) {
      const unsigned char* next = src + (ahead.pos() - first);
      for (int64_t b = 0; b < runs.bytes(); b += 64)
        __builtin_prefetch(next + b);
      ahead.next();
    }
    unsigned char* to = dst + r * runs.bytes();
    const unsigned char* from = src + (at.pos() - first);
    if (!sums) {
      std::memcpy(to, from, size_t(runs.bytes()));
      continue;
    }
    split_at_tiles(at.pos(), runs.bytes(), tile_bytes, [&](int64_t len, int64_t pos, int64_t t) {
      add_run<true>(from, to, len, uint64_t(pos), sums + kWordsPerTile * t);
      from += len;
      to += len;
    });
  }
}

uint64_t table_checksum(const std::vector<uint64_t>& table) {
  uint64_t s = 0;
  for (size_t i = 0; i < table.size(); ++i)
    s += mix(table[i] + 0x9E3779B97F4A7C15ull * (i + 1));
  return s ^ uint64_t(table.size());
}

}  // namespace tessera::ckpt
