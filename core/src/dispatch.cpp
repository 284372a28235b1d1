// The dispatch table: one Kernel per line of kernel_list.h, and the public entry points that
// call them. A device backend registers its implementations with Kernel::set.
#include "tessera/core/kernels/dispatch.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "cpu/kernels.h"
#include "kernel.h"
#include "kernel_table.h"
#include "tessera/core/detail/cuda_copy.h"
#include "tessera/core/factory.h"

namespace tessera::kernels {

namespace registry {

namespace {
std::array<std::atomic<HostFallback>, kNumDeviceTypes> g_fallback{};
std::atomic<int64_t> g_fallback_calls{0};

// Elements from the tensor's first to its last addressed element, inclusive (strides are never
// negative here).
int64_t span_elements(const Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d)
    last += (t.sizes()[size_t(d)] - 1) * t.strides()[size_t(d)];
  return last + 1;
}
}  // namespace

HostFallback fallback_mode(DeviceType type) {
  return g_fallback[size_t(type)].load();
}

void count_host_fallback_call() {
  g_fallback_calls.fetch_add(1, std::memory_order_relaxed);
}

void warn_host_fallback(const char* op, Device device) {
  std::string line;
  if (error_rank() >= 0) line.append("[rank ").append(std::to_string(error_rank())).append("] ");
  line.append("tessera: kernel '").append(op).append("' has no ").append(device.str());
  line.append(" implementation in this build; it runs on host copies (HostFallback::Missing), ");
  line.append("which is slow\n");
  std::fputs(line.c_str(), stderr);
}

Tensor host_mirror(const Tensor& t) {
  const int64_t span = span_elements(t);
  Tensor flat = empty({span}, TensorOptions(t.dtype(), Device::cpu()));
  if (span > 0) {
    tessera::detail::device_copy(flat.raw_data(), Device::cpu(), t.raw_data(), t.device(),
                                 size_t(span) * element_size(t.dtype()));
  }
  return flat.as_strided(t.shape(), t.strides(), 0);
}

void write_back(const Tensor& host, Tensor& device_tensor) {
  const int64_t span = span_elements(device_tensor);
  if (span == 0) return;
  tessera::detail::device_copy(device_tensor.raw_data(), device_tensor.device(), host.raw_data(),
                               Device::cpu(), size_t(span) * element_size(device_tensor.dtype()));
}

}  // namespace registry

void set_host_fallback(DeviceType type, HostFallback mode) {
  registry::g_fallback[size_t(type)].store(mode);
}

HostFallback host_fallback(DeviceType type) {
  return registry::fallback_mode(type);
}

int64_t host_fallback_calls() {
  return registry::g_fallback_calls.load();
}

namespace {
#define TESSERA_KERNEL_ROW(name, result, params, args) \
  registry::Kernel<result params> name##_kernel{#name, &cpu::name};
TESSERA_KERNELS(TESSERA_KERNEL_ROW)
#undef TESSERA_KERNEL_ROW
}  // namespace

namespace registry {

KernelTable kernel_table(DeviceType type) {
  KernelTable table;
#define TESSERA_KERNEL_GET(name, result, params, args) table.name = name##_kernel.get(type);
  TESSERA_KERNELS(TESSERA_KERNEL_GET)
#undef TESSERA_KERNEL_GET
  return table;
}

void set_kernel_table(DeviceType type, const KernelTable& table) {
  TESSERA_CHECK(type != DeviceType::CPU, "set_kernel_table: the cpu kernels are fixed");
#define TESSERA_KERNEL_SET(name, result, params, args) name##_kernel.set(type, table.name);
  TESSERA_KERNELS(TESSERA_KERNEL_SET)
#undef TESSERA_KERNEL_SET
}

std::vector<std::string> empty_slots(const KernelTable& table) {
  std::vector<std::string> names;
#define TESSERA_KERNEL_EMPTY(kname, result, params, args) \
  if (!table.kname) names.push_back(#kname);
  TESSERA_KERNELS(TESSERA_KERNEL_EMPTY)
#undef TESSERA_KERNEL_EMPTY
  return names;
}

void clear_slot(KernelTable& table, std::string_view name) {
#define TESSERA_KERNEL_CLEAR(kname, result, params, args) \
  if (name == #kname) {                                   \
    table.kname = nullptr;                                \
    return;                                               \
  }
  TESSERA_KERNELS(TESSERA_KERNEL_CLEAR)
#undef TESSERA_KERNEL_CLEAR
  TESSERA_FAIL("no kernel is called '", name, "' (see kernel_list.h)");
}

}  // namespace registry

#if defined(TESSERA_WITH_CUDA)
namespace cuda {
registry::KernelTable kernels();  // cuda/kernels.cu
}
namespace {
// After the rows above, in this file, so they exist when the CUDA column is installed.
const bool g_cuda_kernels_installed =
    (registry::set_kernel_table(DeviceType::CUDA, cuda::kernels()), true);
}  // namespace
#endif

}  // namespace tessera::kernels

// Defined by qualified name, so a line of the list that does not match its declaration in the
// public header fails to compile instead of adding an overload.
#define TESSERA_KERNEL_ENTRY(name, result, params, args) \
  auto tessera::kernels::name params->result {           \
    return name##_kernel args;                           \
  }
TESSERA_KERNELS(TESSERA_KERNEL_ENTRY)
#undef TESSERA_KERNEL_ENTRY
