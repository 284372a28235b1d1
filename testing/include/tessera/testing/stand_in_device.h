#pragma once
// cuda:0 played by host memory, so that a machine without a GPU runs every device code path of a
// program except the device's kernels: which device each tensor is made on, where it moves, which
// copies happen, which communication backend carries it. While a StandInDevice lives:
// - cuda:0 storage is host memory that the CPU may not touch (its pages are mapped with no access
//   rights), so code that reads or writes a device tensor's data directly, as it would crash on a
//   GPU, crashes here too (SIGSEGV);
// - bytes move to and from it only through the device copy (Tensor::to, copy_), which opens the
//   pages for the copy;
// - every kernel on cuda:0 tensors runs on host copies (kernels::HostFallback::All), so results
//   are the CPU's bit for bit;
// - DeviceType::CUDA communicates through host_staged_group over the CPU's world (registered on
//   first construction when no backend for CUDA is registered yet; a registration stays).
// One at a time; construct it before making device tensors and drop them before it dies.
#include <cstdint>
#include <memory>
#include <string>

#include "tessera/core/allocator.h"
#include "tessera/core/kernels/dispatch.h"

namespace tessera::testing {

class StandInDevice {
 public:
  StandInDevice();
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
};

// The cuda:0 a device test runs on, for its lifetime: the real one where this build has CUDA and
// the process sees a GPU, else a StandInDevice (TESSERA_TEST_DEVICE=stand-in asks for the
// stand-in even with a GPU). On a real GPU, kernels with no CUDA implementation run on host
// copies (kernels::HostFallback::Missing) and CUDA communicates through the host-staged backend
// when no other is registered, so the same test checks real device memory, copies and staging;
// results then equal the CPU's bit for bit only as long as the kernels run are the CPU's.
class TestDevice {
 public:
  TestDevice();
  ~TestDevice();
  TestDevice(const TestDevice&) = delete;
  TestDevice& operator=(const TestDevice&) = delete;

  bool is_stand_in() const { return stand_in_ != nullptr; }
  // "cuda:0 (stand-in)" or "cuda:0 (GPU)", for test output.
  std::string str() const;

 private:
  std::unique_ptr<StandInDevice> stand_in_;
  kernels::HostFallback old_fallback_ = kernels::HostFallback::Off;
};

}  // namespace tessera::testing
