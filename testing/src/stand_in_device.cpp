#include "tessera/testing/stand_in_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>

#include "tessera/comm/backend.h"
#include "tessera/core/error.h"

namespace tessera::testing {

namespace {

// Device blocks are whole pages mapped PROT_NONE; a copy opens the pages of the one block it
// touches for the length of the memcpy. The mutex makes open-copy-close atomic, since the
// host-staged group copies from its progress thread.
class ProtectedBlocks {
 public:
  void* allocate(size_t nbytes) {
    const size_t len = round_up(nbytes);
    void* p = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TESSERA_CHECK(p != MAP_FAILED, "stand-in cuda:0: mmap of ", nbytes, " bytes failed");
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_[reinterpret_cast<uintptr_t>(p)] = len;
    return p;
  }
  void deallocate(void* p) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(reinterpret_cast<uintptr_t>(p));
    TESSERA_CHECK(it != blocks_.end(), "stand-in cuda:0: freeing ", p, ", which it never gave out");
    munmap(p, it->second);
    blocks_.erase(it);
  }
  // memcpy with the device side(s) readable and writable for the copy.
  void copy(void* dst, bool dst_device, const void* src, bool src_device, size_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (dst_device) set_access(dst, nbytes, PROT_READ | PROT_WRITE);
    if (src_device) set_access(src, nbytes, PROT_READ | PROT_WRITE);
    std::memcpy(dst, src, nbytes);
    if (dst_device) set_access(dst, nbytes, PROT_NONE);
    if (src_device) set_access(src, nbytes, PROT_NONE);
  }
  int64_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return int64_t(blocks_.size());
  }
  // Every block readable and writable until close_all, as device memory is to a kernel; the
  // lock is held in between so the staged group's copies wait for the kernel.
  void open_all() {
    mutex_.lock();
    for (const auto& [start, len] : blocks_)
      mprotect(reinterpret_cast<void*>(start), len, PROT_READ | PROT_WRITE);
  }
  void close_all() {
    for (const auto& [start, len] : blocks_)
      mprotect(reinterpret_cast<void*>(start), len, PROT_NONE);
    mutex_.unlock();
  }

 private:
  static size_t page() {
    static const size_t p = size_t(sysconf(_SC_PAGESIZE));
    return p;
  }
  static size_t round_up(size_t n) {
    return (std::max<size_t>(n, 1) + page() - 1) / page() * page();
  }

  // Opens or closes the whole block holding [p, p + n): a copy inside a block never leaves it.
  void set_access(const void* p, size_t n, int prot) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = blocks_.upper_bound(a);
    TESSERA_CHECK(it != blocks_.begin(), "stand-in cuda:0: copy at ", p,
                  ", which is not device memory");
    --it;
    TESSERA_CHECK(a + n <= it->first + it->second, "stand-in cuda:0: a copy of ", n, " bytes at ",
                  p, " runs past its block");
    mprotect(reinterpret_cast<void*>(it->first), it->second, prot);
  }

  mutable std::mutex mutex_;
  std::map<uintptr_t, size_t> blocks_;
};

ProtectedBlocks g_blocks;

bool nccl_asked() {
  const char* v = std::getenv("TESSERA_TEST_CUDA_BACKEND");
  return v != nullptr && std::string(v) == "nccl";
}

class StandInMemory final : public tessera::detail::EmulatedMemory {
 public:
  void open() override { g_blocks.open_all(); }
  void close() override { g_blocks.close_all(); }
};
StandInMemory g_memory;
std::atomic<int64_t> g_to_device{0};
std::atomic<int64_t> g_to_host{0};
std::atomic<bool> g_alive{false};

class StandInAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    void* p = g_blocks.allocate(nbytes);
    tessera::detail::record_alloc(Device::cuda(0), nbytes);
    return p;
  }
  void deallocate(void* ptr, size_t nbytes) override {
    if (!ptr) return;
    g_blocks.deallocate(ptr);
    tessera::detail::record_free(Device::cuda(0), nbytes);
  }
  Device device() const override { return Device::cuda(0); }
};
StandInAllocator g_allocator;

void stand_in_copy(void* dst, Device dst_device, const void* src, Device src_device,
                   size_t nbytes) {
  TESSERA_CHECK(dst_device.index == 0 && src_device.index == 0, "stand-in device: a copy from ",
                src_device.str(), " to ", dst_device.str(), "; only cuda:0 stands in");
  g_blocks.copy(dst, dst_device.is_cuda(), src, src_device.is_cuda(), nbytes);
  if (dst_device.is_cuda() && src_device.is_cpu()) g_to_device += int64_t(nbytes);
  if (dst_device.is_cpu() && src_device.is_cuda()) g_to_host += int64_t(nbytes);
}

}  // namespace

StandInDevice::StandInDevice(KernelsOn kernels, const std::vector<std::string>& without) {
  TESSERA_CHECK(!g_alive.exchange(true), "StandInDevice: one is alive already");
  if (kernels == KernelsOn::Device) {
    // First, as it may refuse `without`; nothing else has changed then.
    try {
      emulated_ = std::make_unique<tessera::detail::EmulatedDeviceKernels>(DeviceType::CUDA,
                                                                           &g_memory, without);
    } catch (...) {
      g_alive = false;
      throw;
    }
  }
  g_to_device = 0;
  g_to_host = 0;
  old_allocator_ = set_allocator(DeviceType::CUDA, &g_allocator);
  old_copy_ = set_device_copy(&stand_in_copy);
  old_fallback_ = kernels::host_fallback(DeviceType::CUDA);
  if (kernels == KernelsOn::Device) {
    kernels::set_host_fallback(DeviceType::CUDA, kernels::HostFallback::Missing);
  } else {
    kernels::set_host_fallback(DeviceType::CUDA, kernels::HostFallback::All);
  }
  if (nccl_asked()) {
    use_emulated_nccl();
  } else if (backend_name(DeviceType::CUDA).empty()) {
    register_backend(DeviceType::CUDA, "mpi", host_staged_backend());
  }
}

tessera::detail::EmulatedNccl& use_emulated_nccl() {
  // Kept for the process: the world group made over it lives until finalize().
  static tessera::detail::EmulatedNccl* emulated = [] {
    const std::string had = backend_name(DeviceType::CUDA);
    TESSERA_CHECK(had.empty(), "use_emulated_nccl: the CUDA backend '", had,
                  "' is registered already");
    auto* e = new tessera::detail::EmulatedNccl(&g_memory);
    register_backend(DeviceType::CUDA, "nccl", nccl_backend());
    return e;
  }();
  return *emulated;
}

StandInDevice::~StandInDevice() {
  emulated_.reset();
  kernels::set_host_fallback(DeviceType::CUDA, old_fallback_);
  set_device_copy(old_copy_);
  set_allocator(DeviceType::CUDA, old_allocator_);
  g_alive = false;
}

int64_t StandInDevice::bytes_to_device() const {
  return g_to_device.load();
}
int64_t StandInDevice::bytes_to_host() const {
  return g_to_host.load();
}
int64_t StandInDevice::live_blocks() const {
  return g_blocks.size();
}

namespace {
bool stand_in_asked() {
  const char* v = std::getenv("TESSERA_TEST_DEVICE");
  return v != nullptr && std::string(v) == "stand-in";
}
}  // namespace

TestDevice::TestDevice(KernelsOn kernels) : kernels_(kernels) {
  if (cuda_device_count() == 0 || stand_in_asked()) {
    stand_in_ = std::make_unique<StandInDevice>(kernels);
    return;
  }
  old_fallback_ = kernels::host_fallback(DeviceType::CUDA);
  kernels::set_host_fallback(DeviceType::CUDA, kernels == KernelsOn::Device
                                                   ? kernels::HostFallback::Missing
                                                   : kernels::HostFallback::All);
  if (backend_name(DeviceType::CUDA).empty()) {
    if (nccl_asked()) {
      register_backend(DeviceType::CUDA, "nccl", nccl_backend());
    } else {
      register_backend(DeviceType::CUDA, "mpi", host_staged_backend());
    }
  }
}

TestDevice::~TestDevice() {
  if (!stand_in_) kernels::set_host_fallback(DeviceType::CUDA, old_fallback_);
}

std::string TestDevice::str() const {
  std::string s = stand_in_ ? "cuda:0 (stand-in" : "cuda:0 (GPU";
  return s.append(kernels_ == KernelsOn::Device ? ", device kernels)"
                                                : ", kernels on host copies)");
}

}  // namespace tessera::testing
