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

typedef uint64_t U64x8 __attribute__((vector_size(64)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

// Adds sum(w_j) and sum(w_j * (2 (first + j) + 1)) over n whole words at p. The second is
// (2 first + 1) sum(w_j) + 2 sum(j w_j); sum(j w_j) comes from running sums in 8 interleaved
// lanes (lane l holds words 8t + l): with P a lane's running sum and Q the sum of its running
// sums over T rounds, sum_t t x_t = T P - Q. Only additions in the loop, on 8-lane vectors.
void add_words(const unsigned char* p, int64_t n, uint64_t first, uint64_t* out) {
  constexpr int L = 8;
  U64x8 P = {}, Q = {};
  const int64_t T = n / L;
  for (int64_t t = 0; t < T; ++t) {
    U32x8 x;
    std::memcpy(&x, p + size_t(t) * L * 4, sizeof x);
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

// The `len` bytes at p that lie at byte `pos` of the dataset, within one tile.
void add_run(const unsigned char* p, int64_t len, uint64_t pos, uint64_t* out) {
  if (pos % 4 != 0) {
    const int k = int(pos % 4), n = int(std::min<int64_t>(4 - k, len));
    add_partial_word(p, k, n, pos / 4, out);
    p += n;
    pos += uint64_t(n);
    len -= n;
  }
  const int64_t words = len / 4;
  add_words(p, words, pos / 4, out);
  p += words * 4;
  pos += uint64_t(words) * 4;
  len -= words * 4;
  if (len > 0) add_partial_word(p, 0, int(len), pos / 4, out);
}

}  // namespace

void add_block_checksums(const void* data, size_t element_size, const Shape& global,
                         const Shape& offset, const Shape& shape, int64_t tile_bytes,
                         uint64_t* sums) {
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  const auto* bytes = static_cast<const unsigned char*>(data);
  const int64_t nd = int64_t(global.size());
  const int64_t es = int64_t(element_size);
  // Rows of the innermost dim are contiguous both in `data` and in the dataset.
  const int64_t row = nd == 0 ? 1 : shape.back();
  const int64_t rows = n / row;
  Shape gstride(size_t(nd), 1);
  for (int64_t d = nd - 2; d >= 0; --d)
    gstride[size_t(d)] = gstride[size_t(d + 1)] * global[size_t(d + 1)];
  std::vector<int64_t> idx(size_t(std::max<int64_t>(nd - 1, 0)), 0);  // row index in the block
  for (int64_t r = 0; r < rows; ++r) {
    int64_t start = 0;
    for (int64_t d = 0; d < nd; ++d) {
      const int64_t i = d < nd - 1 ? idx[size_t(d)] : 0;
      start += (offset[size_t(d)] + i) * gstride[size_t(d)];
    }
    const unsigned char* p = bytes + size_t(r * row) * element_size;
    // A row may cross tile boundaries: split it there.
    uint64_t pos = uint64_t(start * es);
    for (int64_t left = row * es; left > 0;) {
      const int64_t t = int64_t(pos) / tile_bytes;
      const int64_t take = std::min<int64_t>(left, (t + 1) * tile_bytes - int64_t(pos));
      add_run(p, take, pos, sums + kWordsPerTile * t);
      p += take;
      pos += uint64_t(take);
      left -= take;
    }
    for (int64_t d = nd - 2; d >= 0; --d) {
      if (++idx[size_t(d)] < shape[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
}

uint64_t table_checksum(const std::vector<uint64_t>& table) {
  uint64_t s = 0;
  for (size_t i = 0; i < table.size(); ++i)
    s += mix(table[i] + 0x9E3779B97F4A7C15ull * (i + 1));
  return s ^ uint64_t(table.size());
}

}  // namespace tessera::ckpt
