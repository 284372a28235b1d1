#pragma once
// Host memory standing in for another pool (a GPU's pinned cudaHostAlloc, say), counting the
// blocks it hands out.
#include <cstdlib>

#include "tessera/core/allocator.h"

namespace tessera::testing {

class CountingHostAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    ++allocations;
    return nbytes ? std::malloc(nbytes) : nullptr;
  }
  void deallocate(void* ptr, size_t) override { std::free(ptr); }
  Device device() const override { return Device::cpu(); }
  int allocations = 0;
};

}  // namespace tessera::testing
