#pragma once
// Every kernel runs the implementation registered for its tensors' device type. All tensor
// arguments of one call must be on one device; a call that mixes devices is an error naming the
// kernel, both tensors and their argument positions, as PyTorch refuses "expected all tensors to
// be on the same device". A device type without an implementation of a kernel is an error
// naming both, unless host fallback is on for that device type.
#include <cstdint>

#include "tessera/core/device.h"

namespace tessera::kernels {

enum class HostFallback : uint8_t {
  // A kernel with no implementation for the device type is an error (the default).
  Off,
  // Such a kernel runs on the host instead: its tensor arguments are copied to host memory, the
  // CPU kernel runs, and results and in-place arguments are copied back (PyTorch's MPS
  // fallback). Correct, and as slow as the copies make it.
  Missing,
  // Every kernel runs on the host that way, even where the device has its own: for a stand-in
  // device whose memory is host memory (testing::StandInDevice), so that a machine without the
  // device runs every device code path except the device's kernels.
  All,
};

// Not thread-safe against concurrent kernel calls: set it before work starts.
void set_host_fallback(DeviceType type, HostFallback mode);
HostFallback host_fallback(DeviceType type);

// Number of kernel calls that ran through host fallback since the process started (a test that
// needs device kernels checks that it stayed 0).
int64_t host_fallback_calls();

}  // namespace tessera::kernels
