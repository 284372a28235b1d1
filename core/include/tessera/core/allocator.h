#pragma once
// Every tensor byte goes through an Allocator, so the per-device counters are the truth about
// memory: FSDP's memory targets are measured with them.
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "tessera/core/device.h"

namespace tessera {

struct MemoryStats {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t total_allocated_bytes = 0;
  int64_t num_allocations = 0;
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* ptr, size_t nbytes) = 0;
  virtual Device device() const = 0;
};

// The allocator used for new storage on `device`.
Allocator& allocator_for(Device device);
// Replaces the allocator for a device type (nullptr restores the default); for tests and
// integrations with an external caching allocator. Returns the previous one.
Allocator* set_allocator(DeviceType type, Allocator* allocator);

// How bytes move when either side is not the CPU (cudaMemcpy in a CUDA build). Replacing it
// (nullptr restores the default) together with the CUDA allocator lets host memory stand in for
// a device: how tests run device code paths on a machine without one. Returns the previous one.
using DeviceCopyFn = void (*)(void* dst, Device dst_device, const void* src, Device src_device,
                              size_t nbytes);
DeviceCopyFn set_device_copy(DeviceCopyFn copy);

// Page-locked ("pinned") host memory, which a GPU copies to and from at full speed: what
// PyTorch's pin_memory gives. A CUDA build's is a caching allocator over cudaHostAlloc, there
// when the process sees a GPU; nullptr where nothing can pin (no CUDA, no GPU). Its bytes count
// in memory_stats(Device::cpu()).
Allocator* pinned_allocator();
// Replaces it (nullptr restores the default): how tests stand a pinned pool in where there is no
// GPU. Returns the previous one.
Allocator* set_pinned_allocator(Allocator* allocator);

MemoryStats memory_stats(Device device = Device::cpu());
// Sets the peak to the current value, so a later peak measures one phase.
void reset_peak_memory(Device device = Device::cpu());

namespace detail {
// Called by allocators (and only by them) to keep the counters.
void record_alloc(Device device, size_t nbytes);
void record_free(Device device, size_t nbytes);
}  // namespace detail

}  // namespace tessera
