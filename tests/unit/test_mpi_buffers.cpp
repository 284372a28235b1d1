// White-box: how the MPI group describes a list of tensors as one MPI buffer
// (comm/src/mpi/buffers.h). Element counts beyond an int are tested on storage that is reserved
// address space only: describing it touches no memory, and a machine without 8 GiB to spare runs
// it all the same.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <climits>
#include <cstdint>
#include <vector>

#include "mpi/buffers.h"
#include "tessera/core/allocator.h"
#include "tessera/core/storage.h"
#include "tessera/core/tensor.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;

namespace {

// Host address space with no access and nothing behind it until touched (never, here).
class ReservedAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    void* p = mmap(nullptr, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  void deallocate(void* ptr, size_t nbytes) override {
    if (ptr != nullptr) munmap(ptr, nbytes);
  }
  Device device() const override { return Device::cpu(); }
};

// Consecutive one-byte pieces of the given lengths over one reserved storage.
std::vector<Tensor> consecutive_pieces(ReservedAllocator& reserved,
                                       const std::vector<int64_t>& lengths) {
  int64_t total = 0;
  for (int64_t n : lengths)
    total += n;
  Storage storage(size_t(total), Device::cpu(), &reserved);
  std::vector<Tensor> pieces;
  int64_t at = 0;
  for (int64_t n : lengths) {
    pieces.push_back(Tensor::make(storage, {n}, {1}, at, DType::Bool));
    at += n;
  }
  return pieces;
}

}  // namespace

// reduce_scatter's input: every piece and offset fits an int, but MPI_Ireduce_scatter would be
// handed counts whose sum does not (the sum is the send buffer's length to MPI).
TEST(MpiBuffers, ConsecutivePiecesTotallingMoreThanAnIntAreRefused) {
  ReservedAllocator reserved;
  const int64_t half = (int64_t(1) << 30) + 1;
  const std::vector<Tensor> pieces = consecutive_pieces(reserved, {half, half});
  tessera::testing::expect_error(
      [&] {
        mpi::flat_send(pieces, DType::Bool, true, "reduce_scatter on group 'g' (rank 0 of 2)");
      },
      {"reduce_scatter on group 'g' (rank 0 of 2): the 2 pieces total 2147483650 elements",
       "more than MPI's count limit of 2147483647"});
}

// The largest total MPI can take is used where it lies, without a copy.
TEST(MpiBuffers, ConsecutivePiecesTotallingAnIntAreUsedInPlace) {
  ReservedAllocator reserved;
  const int64_t half = int64_t(1) << 30;
  const std::vector<Tensor> pieces = consecutive_pieces(reserved, {half, half - 1});
  const mpi::FlatList flat = mpi::flat_send(pieces, DType::Bool, true, "reduce_scatter");
  EXPECT_FALSE(flat.staging.defined());
  EXPECT_EQ(flat.base, pieces[0].raw_data());
  EXPECT_EQ(flat.counts, (std::vector<int>{int(half), INT_MAX - int(half)}));
  EXPECT_EQ(flat.displs, (std::vector<int>{0, int(half)}));
}
