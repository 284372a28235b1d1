#pragma once
// A caching allocator for devices whose raw allocation is slow and synchronizing (cudaMalloc,
// cudaFree), with PyTorch's CUDA caching semantics: freed blocks stay reserved and are reused by
// later requests on the same stream; a block used on another stream (record_stream) is reused
// only once the work queued there at its free has finished; empty_cache() hands whole free
// segments back. The device side is a DeviceMemory, so the policy runs (and is tested) without a
// GPU.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "tessera/core/allocator.h"

namespace tessera {

// An opaque stream handle (a cudaStream_t for CUDA); 0 is the device's default stream.
using StreamId = uintptr_t;

// What the caching allocator needs from a device. Methods are called with the allocator's lock
// held, from whichever thread allocates or frees.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual Device device() const = 0;
  // nbytes of device memory, or nullptr when the device has none left (not an exception: the
  // allocator then frees its cache and tries once more).
  virtual void* raw_allocate(size_t nbytes) = 0;
  virtual void raw_free(void* ptr) = 0;
  // The stream new allocations are ordered on (the calling thread's current stream).
  virtual StreamId current_stream() const = 0;
  // An event marking the work queued on `stream` so far, and whether it has completed. Each
  // event is queried until done, then released.
  virtual void* record_event(StreamId stream) = 0;
  virtual bool event_done(void* event) = 0;
  virtual void release_event(void* event) = 0;
  // Waits for all work on the device (before memory is handed back while events are pending).
  virtual void synchronize() = 0;
};

// The allocator's own figures; tensor bytes are in memory_stats(device) as for the CPU.
struct CachingStats {
  int64_t reserved_bytes = 0;  // held from the device: in use, cached or split off
  int64_t peak_reserved_bytes = 0;
  int64_t allocated_bytes = 0;  // handed out, in rounded block sizes
  int64_t segments = 0;         // raw allocations held
  int64_t raw_allocations = 0;  // raw_allocate calls that succeeded, ever
  int64_t cache_flushes = 0;    // times a raw allocation failed and the cache was freed
};

class CachingAllocator final : public Allocator {
 public:
  // Requests up to kSmallRequest bytes are carved from kSmallSegment-byte segments, requests up
  // to kMediumRequest from kLargeSegment-byte ones; larger requests get a segment of their own
  // rounded to kSegmentRound. Block sizes are multiples of kBlockRound.
  static constexpr size_t kBlockRound = 512;
  static constexpr size_t kSmallRequest = size_t(1) << 20;
  static constexpr size_t kSmallSegment = size_t(2) << 20;
  static constexpr size_t kMediumRequest = size_t(10) << 20;
  static constexpr size_t kLargeSegment = size_t(20) << 20;
  static constexpr size_t kSegmentRound = size_t(2) << 20;

  explicit CachingAllocator(std::unique_ptr<DeviceMemory> memory);
  ~CachingAllocator() override;  // hands every segment back; live blocks are the owner's bug

  void* allocate(size_t nbytes) override;  // on memory.current_stream()
  void deallocate(void* ptr, size_t nbytes) override;
  Device device() const override;

  void* allocate(size_t nbytes, StreamId stream);
  // The block holding `ptr` is also used by work on `stream`: when freed it is reused only after
  // that work completes (torch.Tensor.record_stream).
  void record_stream(void* ptr, StreamId stream);
  // Returns every segment with no block in use to the device (waiting for pending frees first).
  void empty_cache();
  CachingStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera
