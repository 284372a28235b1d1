#pragma once
// Device kernels run on the host, for a device played by host memory (testing::StandInDevice).
// Core's device kernels are written once (element functors plus host-side checks and setup);
// a CUDA build launches them on the GPU. While an EmulatedDeviceKernels lives, the kernels of
// `type` that have such an implementation run that same code on the host instead, one element
// after another, with the device's memory opened around each launch; every other kernel keeps
// what `type` had before (its own implementation, or host fallback). A machine without a GPU
// thereby tests the device kernels' checks, dtype handling, index arithmetic and element
// formulas: everything except the launch and the device's own math library.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/device.h"

namespace tessera::detail {

// Makes a stand-in device's memory readable and writable by the host for one emulated launch.
class EmulatedMemory {
 public:
  virtual ~EmulatedMemory() = default;
  virtual void open() = 0;
  virtual void close() = 0;
};

class EmulatedDeviceKernels {
 public:
  // `memory` must outlive this object. One at a time per process. The kernels named in
  // `leave_out` (as in kernels/*.h) get no implementation, as on a device that lacks them, so
  // that a test can see host fallback at work.
  EmulatedDeviceKernels(DeviceType type, EmulatedMemory* memory,
                        const std::vector<std::string>& leave_out = {});
  ~EmulatedDeviceKernels();
  EmulatedDeviceKernels(const EmulatedDeviceKernels&) = delete;
  EmulatedDeviceKernels& operator=(const EmulatedDeviceKernels&) = delete;

 private:
  struct Saved;
  DeviceType type_;
  std::unique_ptr<Saved> saved_;
};

// The kernels of the list (kernel_list.h) that have no device implementation: each would run on
// host copies (host fallback) on a device. Empty today; a test keeps it so.
std::vector<std::string> kernels_without_device_code();

// Emulated launches since the process started (a test checks that device kernels, not host
// fallback, ran).
int64_t emulated_launches();

}  // namespace tessera::detail
