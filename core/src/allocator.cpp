#include "tessera/core/allocator.h"

#include <malloc.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>

#include "tessera/core/error.h"
#include "tessera/core/storage.h"

namespace tessera {

namespace {

constexpr int kMaxDevices = 16;

struct Counters {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> total{0};
  std::atomic<int64_t> count{0};
};

Counters& counters(Device d) {
  static Counters cpu;
  static Counters cuda[kMaxDevices];
  if (d.is_cpu()) return cpu;
  TESSERA_CHECK(d.index >= 0 && d.index < kMaxDevices, "device index ", d.index, " out of range");
  return cuda[d.index];
}

// 64-byte aligned host memory: Eigen and AVX-512 loads want it.
class CpuAllocator final : public Allocator {
  static constexpr size_t kAlign = 64;

 public:
  CpuAllocator() {
    // glibc serves blocks over 32 MiB with a fresh mmap every time, and the page faults of
    // touching new pages cost more than the kernels using them. Training allocates the same
    // large sizes every step, so keep them in the heap to be reused.
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
  // malloc plus alignment by hand: glibc's aligned_alloc hands back freshly faulted pages for
  // large blocks far more often than malloc does, which costs a few percent on big GEMMs. The
  // block's own address sits just before the aligned pointer.
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    void* raw = std::malloc(nbytes + kAlign + sizeof(void*));
    TESSERA_CHECK(raw != nullptr, "out of host memory allocating ", nbytes, " bytes");
    uintptr_t aligned =
        (reinterpret_cast<uintptr_t>(raw) + sizeof(void*) + kAlign - 1) & ~uintptr_t(kAlign - 1);
    reinterpret_cast<void**>(aligned)[-1] = raw;
    detail::record_alloc(Device::cpu(), nbytes);
    return reinterpret_cast<void*>(aligned);
  }
  void deallocate(void* ptr, size_t nbytes) override {
    if (!ptr) return;
    std::free(static_cast<void**>(ptr)[-1]);
    detail::record_free(Device::cpu(), nbytes);
  }
  Device device() const override { return Device::cpu(); }
};

CpuAllocator g_cpu_allocator;
std::atomic<Allocator*> g_cpu_override{nullptr};
std::atomic<Allocator*> g_cuda_override{nullptr};
std::atomic<Allocator*> g_pinned_override{nullptr};

}  // namespace

Allocator* cuda_default_allocator(int index);  // cuda/cuda_runtime.cpp, or the error below

Allocator& allocator_for(Device device) {
  if (device.is_cpu()) {
    Allocator* a = g_cpu_override.load();
    return a ? *a : g_cpu_allocator;
  }
  Allocator* a = g_cuda_override.load();
  if (a) return *a;
#ifdef TESSERA_WITH_CUDA
  return *cuda_default_allocator(device.index);
#else
  TESSERA_FAIL("cannot allocate on ", device.str(), ": this build has no CUDA support");
#endif
}

Allocator* set_allocator(DeviceType type, Allocator* allocator) {
  return type == DeviceType::CPU ? g_cpu_override.exchange(allocator)
                                 : g_cuda_override.exchange(allocator);
}

#ifdef TESSERA_WITH_CUDA
Allocator* cuda_pinned_allocator();  // cuda/cuda_runtime.cpp: nullptr without a GPU
#endif

Allocator* pinned_allocator() {
  if (Allocator* a = g_pinned_override.load()) return a;
#ifdef TESSERA_WITH_CUDA
  return cuda_pinned_allocator();
#else
  return nullptr;
#endif
}

Allocator* set_pinned_allocator(Allocator* allocator) {
  return g_pinned_override.exchange(allocator);
}

MemoryStats memory_stats(Device device) {
  Counters& c = counters(device);
  return {c.current.load(), c.peak.load(), c.total.load(), c.count.load()};
}

void reset_peak_memory(Device device) {
  Counters& c = counters(device);
  c.peak.store(c.current.load());
}

namespace detail {
void record_alloc(Device device, size_t nbytes) {
  Counters& c = counters(device);
  int64_t now = c.current.fetch_add(int64_t(nbytes)) + int64_t(nbytes);
  int64_t peak = c.peak.load();
  while (now > peak && !c.peak.compare_exchange_weak(peak, now)) {
  }
  c.total.fetch_add(int64_t(nbytes));
  c.count.fetch_add(1);
}
void record_free(Device device, size_t nbytes) {
  counters(device).current.fetch_sub(int64_t(nbytes));
}
}  // namespace detail

StorageImpl::StorageImpl(size_t nbytes, Device device)
    : StorageImpl(nbytes, device, &allocator_for(device)) {}

namespace {
std::atomic<uint64_t> g_storage_serial{0};
}  // namespace

uint64_t StorageImpl::next_serial() {
  return g_storage_serial.load(std::memory_order_relaxed);
}

StorageImpl::StorageImpl(size_t nbytes, Device device, Allocator* allocator)
    : nbytes_(nbytes),
      device_(device),
      allocator_(allocator),
      serial_(g_storage_serial.fetch_add(1, std::memory_order_relaxed)) {
  TESSERA_CHECK(allocator_ != nullptr && allocator_->device().type == device.type,
                "Storage: no allocator for ", device.str());
  data_ = allocator_->allocate(nbytes);
}

StorageImpl::~StorageImpl() {
  allocator_->deallocate(data_, nbytes_);
}

void StorageImpl::release() {
  allocator_->deallocate(data_, nbytes_);
  data_ = nullptr;
}

void StorageImpl::reallocate() {
  if (data_ == nullptr && nbytes_ > 0) data_ = allocator_->allocate(nbytes_);
}

}  // namespace tessera
