// CUDA memory: the default allocator for CUDA devices and copies across devices. Compiled only
// when CUDA is enabled; nothing here runs on a machine without a GPU.
#include <cuda_runtime.h>

#include <memory>
#include <mutex>

#include "tessera/core/allocator.h"
#include "tessera/core/error.h"

namespace tessera {

namespace {

void check_cuda(cudaError_t err, const char* what) {
  TESSERA_CHECK(err == cudaSuccess, "CUDA ", what, " failed: ", cudaGetErrorString(err));
}

class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int index) : index_(index) {}
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    check_cuda(cudaSetDevice(index_), "cudaSetDevice");
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, nbytes), "cudaMalloc");
    detail::record_alloc(device(), nbytes);
    return p;
  }
  void deallocate(void* ptr, size_t nbytes) override {
    if (!ptr) return;
    cudaFree(ptr);
    detail::record_free(device(), nbytes);
  }
  Device device() const override { return Device::cuda(index_); }

 private:
  int index_;
};

}  // namespace

Allocator* cuda_default_allocator(int index) {
  static std::mutex mu;
  static std::unique_ptr<CudaAllocator> allocators[16];
  TESSERA_CHECK(index >= 0 && index < 16, "CUDA device index ", index, " out of range");
  std::lock_guard<std::mutex> lock(mu);
  if (!allocators[index]) allocators[index] = std::make_unique<CudaAllocator>(index);
  return allocators[index].get();
}

namespace detail {
void cuda_memcpy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes) {
  cudaMemcpyKind kind = dst_device.is_cpu()   ? cudaMemcpyDeviceToHost
                        : src_device.is_cpu() ? cudaMemcpyHostToDevice
                                              : cudaMemcpyDeviceToDevice;
  check_cuda(cudaMemcpy(dst, src, nbytes, kind), "cudaMemcpy");
}
}  // namespace detail

}  // namespace tessera
