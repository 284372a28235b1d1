#include "checksum.h"

#include <cstring>

#include "tessera/core/error.h"

namespace tessera::ckpt {

namespace {

// Bijective in `bits` for each index: an added constant, xor-shifts and an odd multiplier are
// each invertible.
inline uint64_t term(uint64_t bits, uint64_t index) {
  uint64_t x = bits + (index + 1) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  return x;
}

template <class Bits>
uint64_t run_sum(const unsigned char* p, int64_t n, uint64_t first_index) {
  uint64_t s = 0;
  for (int64_t j = 0; j < n; ++j) {
    Bits b;
    std::memcpy(&b, p + size_t(j) * sizeof(Bits), sizeof(Bits));
    s += term(uint64_t(b), first_index + uint64_t(j));
  }
  return s;
}

uint64_t sum_of(const unsigned char* p, size_t element_size, int64_t n, uint64_t first_index) {
  switch (element_size) {
    case 1:
      return run_sum<uint8_t>(p, n, first_index);
    case 2:
      return run_sum<uint16_t>(p, n, first_index);
    case 4:
      return run_sum<uint32_t>(p, n, first_index);
    case 8:
      return run_sum<uint64_t>(p, n, first_index);
  }
  TESSERA_FAIL("checkpoint checksum: unsupported element size ", element_size);
}

}  // namespace

void add_block_checksums(const void* data, size_t element_size, const Shape& global,
                         const Shape& offset, const Shape& shape, int64_t tile, uint64_t* sums) {
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  const auto* bytes = static_cast<const unsigned char*>(data);
  const int64_t nd = int64_t(global.size());
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
    for (int64_t done = 0; done < row;) {
      const int64_t flat = start + done;
      const int64_t t = flat / tile;
      const int64_t take = std::min(row - done, (t + 1) * tile - flat);
      sums[t] += sum_of(p + size_t(done) * element_size, element_size, take, uint64_t(flat));
      done += take;
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
    s += term(table[i], i);
  return s ^ uint64_t(table.size());
}

}  // namespace tessera::ckpt
