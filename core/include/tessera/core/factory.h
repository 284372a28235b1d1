#pragma once
#include <initializer_list>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera {

struct TensorOptions {
  DType dtype = DType::Float32;
  Device device = Device::cpu();
  // Host memory from pinned_allocator() (PyTorch's pin_memory=True); CPU tensors only, and an
  // error where nothing can pin.
  bool pinned = false;
  TensorOptions() = default;
  TensorOptions(DType dt) : dtype(dt) {}  // NOLINT: lets `empty(shape, DType::Float64)` read well
  TensorOptions(DType dt, Device dev) : dtype(dt), device(dev) {}
  TensorOptions& pin_memory(bool pin = true) {
    pinned = pin;
    return *this;
  }
};

Tensor empty(const Shape& shape, TensorOptions opts = {});
Tensor zeros(const Shape& shape, TensorOptions opts = {});
Tensor ones(const Shape& shape, TensorOptions opts = {});
Tensor full(const Shape& shape, double value, TensorOptions opts = {});
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);
// [start, end) with `step`; int64 unless opts says otherwise.
Tensor arange(int64_t end, TensorOptions opts = DType::Int64);
Tensor arange(double start, double end, double step, TensorOptions opts = DType::Int64);
// A tensor holding `values` (row-major) with `shape` (default: 1-D).
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape = {});
// Scalar (0-d) tensor.
Tensor scalar_tensor(double value, TensorOptions opts = {});

}  // namespace tessera
