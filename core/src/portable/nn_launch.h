#pragma once
// Private to core: what the nn kernels on devices (softmax.h, norm.h, cross_entropy.h, rope.h,
// dropout.h, index_ops.h) share: launching on executor Exec, and tensors on an operand's device.
#include <cstdint>
#include <vector>

#include "launch.h"
#include "tessera/core/factory.h"
#include "tessera/core/tensor.h"

namespace tessera::kernels::portable {

template <class Exec>
struct NnLaunch {
  template <class F>
  static void run(const char* op, Device device, int64_t n, const F& f) {
    launch<Exec>(op, device, n, f);
  }
  template <class F>
  static void run_rows(const char* op, Device device, int64_t rows, const F& f) {
    launch_rows<Exec>(op, device, rows, f);
  }

  static Tensor on(const Tensor& like, const Shape& shape, DType dt) {
    return empty(shape, TensorOptions(dt, like.device()));
  }
  // A host vector of int64 as a tensor on `like`'s device.
  static Tensor to_device(const std::vector<int64_t>& v, const Tensor& like) {
    return from_vector<int64_t>(v, {int64_t(v.size())}).to(like.device());
  }
};

}  // namespace tessera::kernels::portable
