#pragma once
// Small helpers the parameter group's files share (internal to fsdp/): windows of its flat
// buffers and timed waits for its collectives.
#include <chrono>

#include "tessera/comm/process_group.h"
#include "tessera/core/kernels/views.h"

namespace tessera::detail {

// The flat window [start, start + length) of a contiguous tensor, as a view.
inline Tensor flat_window(const Tensor& t, int64_t start, int64_t length) {
  return kernels::narrow(kernels::view(t, Shape{t.numel()}), 0, start, length);
}

// Waits for `work`; the seconds this thread spent waiting.
inline double wait_seconds(const WorkPtr& work) {
  const auto start = std::chrono::steady_clock::now();
  work->wait();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace tessera::detail
