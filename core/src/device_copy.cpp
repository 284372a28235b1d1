#include <atomic>
#include <cstring>

#include "tessera/core/allocator.h"
#include "tessera/core/detail/cuda_copy.h"
#include "tessera/core/error.h"

namespace tessera {

namespace {
std::atomic<DeviceCopyFn> g_copy_override{nullptr};
}  // namespace

DeviceCopyFn set_device_copy(DeviceCopyFn copy) {
  return g_copy_override.exchange(copy);
}

namespace detail {

#ifdef TESSERA_WITH_CUDA
void cuda_memcpy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes);
#endif

void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes) {
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  if (DeviceCopyFn copy = g_copy_override.load()) {
    copy(dst, dst_device, src, src_device, nbytes);
    return;
  }
#ifdef TESSERA_WITH_CUDA
  cuda_memcpy(dst, dst_device, src, src_device, nbytes);
#else
  TESSERA_FAIL("copy from ", src_device.str(), " to ", dst_device.str(),
               ": this build has no CUDA support");
#endif
}

}  // namespace detail

}  // namespace tessera
