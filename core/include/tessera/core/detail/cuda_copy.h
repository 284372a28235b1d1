#pragma once
#include <cstddef>

#include "tessera/core/device.h"

namespace tessera::detail {

// Copies nbytes between any two devices (host<->CUDA, CUDA<->CUDA, host<->host).
void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes);

}  // namespace tessera::detail
