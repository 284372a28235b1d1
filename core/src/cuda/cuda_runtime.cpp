// CUDA memory: the caching allocator's device side for CUDA devices and copies across devices.
// Compiled only when CUDA is enabled; nothing here runs on a machine without a GPU.
#include <cuda_runtime.h>

#include <memory>
#include <mutex>

#include "tessera/core/allocator.h"
#include "tessera/core/caching_allocator.h"
#include "tessera/core/device.h"
#include "tessera/core/error.h"

namespace tessera {

namespace {

void check_cuda(cudaError_t err, const char* what, int index) {
  TESSERA_CHECK(err == cudaSuccess, "CUDA ", what, " on cuda:", index,
                " failed: ", cudaGetErrorString(err));
}

// cudaMalloc/cudaFree and events on one device, for the caching allocator. Tessera queues no
// work on streams of its own yet, so allocations are ordered on the default stream.
class CudaDeviceMemory final : public DeviceMemory {
 public:
  explicit CudaDeviceMemory(int index) : index_(index) {}
  Device device() const override { return Device::cuda(index_); }
  void* raw_allocate(size_t nbytes) override {
    check_cuda(cudaSetDevice(index_), "cudaSetDevice", index_);
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, nbytes);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear it: the allocator frees its cache and tries again
      return nullptr;
    }
    check_cuda(err, "cudaMalloc", index_);
    return p;
  }
  void raw_free(void* ptr) override {
    check_cuda(cudaSetDevice(index_), "cudaSetDevice", index_);
    check_cuda(cudaFree(ptr), "cudaFree", index_);
  }
  StreamId current_stream() const override { return 0; }
  void* record_event(StreamId stream) override {
    check_cuda(cudaSetDevice(index_), "cudaSetDevice", index_);
    cudaEvent_t event = nullptr;
    check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate", index_);
    check_cuda(cudaEventRecord(event, reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord",
               index_);
    return event;
  }
  bool event_done(void* event) override {
    cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    check_cuda(err, "cudaEventQuery", index_);
    return true;
  }
  void release_event(void* event) override {
    check_cuda(cudaEventDestroy(static_cast<cudaEvent_t>(event)), "cudaEventDestroy", index_);
  }
  void synchronize() override {
    check_cuda(cudaSetDevice(index_), "cudaSetDevice", index_);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", index_);
  }

 private:
  int index_;
};

// Page-locked host memory for the caching allocator: cudaHostAlloc is slow (it maps the pages
// for the device), so freed blocks are kept for reuse as device blocks are. Portable: usable
// with every device of the process.
class PinnedHostMemory final : public DeviceMemory {
 public:
  Device device() const override { return Device::cpu(); }
  void* raw_allocate(size_t nbytes) override {
    // On the process's own device: cudaHostAlloc makes the current device's context, and device
    // 0's by default would put one from every rank of a node on GPU 0.
    const int index = current_device(DeviceType::CUDA).index;
    check_cuda(cudaSetDevice(index), "cudaSetDevice", index);
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, nbytes, cudaHostAllocPortable);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    check_cuda(err, "cudaHostAlloc", 0);
    return p;
  }
  void raw_free(void* ptr) override { check_cuda(cudaFreeHost(ptr), "cudaFreeHost", 0); }
  // Copies to and from pinned blocks are synchronous (cudaMemcpy), so nothing on a stream can
  // still use a block that is freed: no events are needed.
  StreamId current_stream() const override { return 0; }
  void* record_event(StreamId) override { return nullptr; }
  bool event_done(void*) override { return true; }
  void release_event(void*) override {}
  void synchronize() override {}
};

}  // namespace

// nullptr without a GPU: cudaHostAlloc needs a device.
Allocator* cuda_pinned_allocator() {
  static CachingAllocator* pinned = cuda_device_count() > 0
                                        ? new CachingAllocator(std::make_unique<PinnedHostMemory>())
                                        : nullptr;
  return pinned;
}

void synchronize(Device device) {
  if (device.is_cpu()) return;
  check_cuda(cudaSetDevice(device.index), "cudaSetDevice", device.index);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", device.index);
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: none to use
    return 0;
  }
  return n;
}

// One caching allocator per device, never destroyed: tensors may outlive static destructors,
// and freeing CUDA memory after the runtime has shut down fails.
Allocator* cuda_default_allocator(int index) {
  static std::mutex mu;
  static CachingAllocator* allocators[16] = {};
  TESSERA_CHECK(index >= 0 && index < 16, "CUDA device index ", index, " out of range");
  std::lock_guard<std::mutex> lock(mu);
  if (!allocators[index])
    allocators[index] = new CachingAllocator(std::make_unique<CudaDeviceMemory>(index));
  return allocators[index];
}

namespace detail {
void cuda_memcpy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes) {
  cudaMemcpyKind kind = dst_device.is_cpu()   ? cudaMemcpyDeviceToHost
                        : src_device.is_cpu() ? cudaMemcpyHostToDevice
                                              : cudaMemcpyDeviceToDevice;
  const int index = dst_device.is_cpu() ? src_device.index : dst_device.index;
  // cudaMemcpy runs on the current device's legacy stream: the tensor's device, so that the copy
  // follows the kernels that wrote it.
  check_cuda(cudaSetDevice(index), "cudaSetDevice", index);
  check_cuda(cudaMemcpy(dst, src, nbytes, kind), "cudaMemcpy", index);
}
}  // namespace detail

}  // namespace tessera
