#pragma once
// cuda:0 played by host memory, so that a machine without a GPU runs every device code path of a
// program except the device's kernels: which device each tensor is made on, where it moves, which
// copies happen, which communication backend carries it. While a StandInDevice lives:
// - cuda:0 storage is host memory that the CPU may not touch (its pages are mapped with no access
//   rights), so code that reads or writes a device tensor's data directly, as it would crash on a
//   GPU, crashes here too (SIGSEGV);
// - bytes move to and from it only through the device copy (Tensor::to, copy_), which opens the
//   pages for the copy;
// - with KernelsOn::HostCopies (the default) every kernel on cuda:0 tensors runs on host
//   copies (kernels::HostFallback::All), so results are the CPU's bit for bit;
// - with KernelsOn::Device the kernels core implements for devices run that device code
//   on the host over the opened device memory (detail::EmulatedDeviceKernels): the code a CUDA
//   build launches on the GPU, minus the launch and the device's math library. The others run
//   on host copies (kernels::HostFallback::Missing, which says so once per kernel on stderr).
//   Results match the CPU's within rounding where the device formulas call std:: functions
//   the CPU computes in vectorised form;
// - DeviceType::CUDA communicates through host_staged_group over the CPU's world (registered on
//   first construction when no backend for CUDA is registered yet; a registration stays), or,
//   with TESSERA_TEST_CUDA_BACKEND=nccl, through the NCCL backend over emulated NCCL
//   (use_emulated_nccl).
// One at a time; construct it before making device tensors and drop them before it dies.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/comm/detail/emulated_nccl.h"
#include "tessera/core/allocator.h"
#include "tessera/core/detail/emulated_kernels.h"
#include "tessera/core/kernels/dispatch.h"

namespace tessera::testing {

// Where a device test's kernels run. HostCopies: every kernel is the CPU's, on host copies of the
// device tensors (results are the CPU's bit for bit; what is tested is the plumbing). Device: the
// device's own kernels where core has them (on the stand-in, that device code emulated on the
// host), the others on host copies.
enum class KernelsOn : uint8_t { HostCopies, Device };

class StandInDevice {
 public:
  // With KernelsOn::Device, the kernels named in `without` (as in kernels/*.h) have no device
  // implementation, as on a device that lacks them: they go through host fallback.
  explicit StandInDevice(KernelsOn kernels = KernelsOn::HostCopies,
                         const std::vector<std::string>& without = {});
  ~StandInDevice();
  StandInDevice(const StandInDevice&) = delete;
  StandInDevice& operator=(const StandInDevice&) = delete;

  // Bytes copied host -> device and device -> host since construction.
  int64_t bytes_to_device() const;
  int64_t bytes_to_host() const;
  // Device blocks currently allocated.
  int64_t live_blocks() const;

 private:
  Allocator* old_allocator_ = nullptr;
  DeviceCopyFn old_copy_ = nullptr;
  kernels::HostFallback old_fallback_ = kernels::HostFallback::Off;
  std::unique_ptr<tessera::detail::EmulatedDeviceKernels> emulated_;
};

// Registers the NCCL backend for DeviceType::CUDA over NCCL emulated by MPI on the stand-in's
// memory (detail::EmulatedNccl), for the rest of the process, and returns the emulation (to make
// a call fail, count aborts). The first call makes it, collectively over the world; later calls
// return it. An error when another backend for CUDA is registered already. StandInDevice and
// TestDevice on the stand-in call it when TESSERA_TEST_CUDA_BACKEND=nccl.
tessera::detail::EmulatedNccl& use_emulated_nccl();

// The cuda:0 a device test runs on, for its lifetime: the real one where this build has CUDA and
// the process sees a GPU, else a StandInDevice (TESSERA_TEST_DEVICE=stand-in asks for the
// stand-in even with a GPU). CUDA communicates through the host-staged backend when no other is
// registered (TESSERA_TEST_CUDA_BACKEND=nccl: the NCCL backend, libnccl's on a GPU, emulated on
// the stand-in). With KernelsOn::HostCopies (the default) every kernel is the CPU's on host copies
// (kernels::HostFallback::All), on a GPU too: the same test then checks real device memory,
// copies and staging, and results equal the CPU's bit for bit. With KernelsOn::Device a GPU runs
// its CUDA kernels (the rest on host copies, HostFallback::Missing) and the stand-in emulates
// them; results then match the CPU's within rounding.
class TestDevice {
 public:
  explicit TestDevice(KernelsOn kernels = KernelsOn::HostCopies);
  ~TestDevice();
  TestDevice(const TestDevice&) = delete;
  TestDevice& operator=(const TestDevice&) = delete;

  bool is_stand_in() const { return stand_in_ != nullptr; }
  // e.g. "cuda:0 (stand-in, device kernels)", for test output.
  std::string str() const;

 private:
  KernelsOn kernels_;
  std::unique_ptr<StandInDevice> stand_in_;
  kernels::HostFallback old_fallback_ = kernels::HostFallback::Off;
};

}  // namespace tessera::testing
