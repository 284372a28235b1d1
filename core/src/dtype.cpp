#include "tessera/core/dtype.h"

#include <atomic>

#include "tessera/core/device.h"
#include "tessera/core/error.h"
#include "tessera/core/tensor.h"

namespace tessera {

size_t element_size(DType dt) {
  switch (dt) {
    case DType::Float32:
    case DType::Int32:
      return 4;
    case DType::Float64:
    case DType::Int64:
      return 8;
    case DType::BFloat16:
    case DType::Float16:
      return 2;
    case DType::Bool:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::Float32:
      return "float32";
    case DType::Float64:
      return "float64";
    case DType::BFloat16:
      return "bfloat16";
    case DType::Float16:
      return "float16";
    case DType::Int64:
      return "int64";
    case DType::Int32:
      return "int32";
    case DType::Bool:
      return "bool";
  }
  return "?";
}

namespace {
int rank_of(DType dt) {
  switch (dt) {
    case DType::Bool:
      return 0;
    case DType::Int32:
      return 1;
    case DType::Int64:
      return 2;
    case DType::Float16:
    case DType::BFloat16:
      return 3;
    case DType::Float32:
      return 4;
    case DType::Float64:
      return 5;
  }
  return 0;
}
}  // namespace

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  // Mixing the two 16-bit formats has no exact common 16-bit type: use float32 like PyTorch.
  if (is_half(a) && is_half(b)) return DType::Float32;
  return rank_of(a) >= rank_of(b) ? a : b;
}

namespace {
// PyTorch's categories for the 0-dim rule: bool < integer < floating.
int category_of(DType dt) {
  return dt == DType::Bool ? 0 : is_floating(dt) ? 2 : 1;
}
}  // namespace

DType result_type(const Tensor& a, const Tensor& b) {
  const bool a_scalar = a.dim() == 0, b_scalar = b.dim() == 0;
  if (a_scalar == b_scalar) return promote_types(a.dtype(), b.dtype());
  const DType dims = a_scalar ? b.dtype() : a.dtype();
  const DType scalar = a_scalar ? a.dtype() : b.dtype();
  return category_of(scalar) > category_of(dims) ? promote_types(dims, scalar) : dims;
}

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

namespace {
std::atomic<int> g_current_cuda{0};
}  // namespace

void set_current_device(Device device) {
  TESSERA_CHECK(device.index >= 0, "set_current_device(", device.str(), "): negative index");
  if (device.is_cuda()) g_current_cuda = device.index;
}

Device current_device(DeviceType type) {
  return type == DeviceType::CPU ? Device::cpu() : Device{type, g_current_cuda.load()};
}

bool cuda_compiled() {
#ifdef TESSERA_WITH_CUDA
  return true;
#else
  return false;
#endif
}

#ifndef TESSERA_WITH_CUDA
int cuda_device_count() {
  return 0;
}
void synchronize(Device device) {
  TESSERA_CHECK(device.is_cpu(), "synchronize(", device.str(), "): this build has no CUDA support");
}
#endif

}  // namespace tessera
