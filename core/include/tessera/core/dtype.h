#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "tessera/core/half.h"

namespace tessera {

enum class DType : uint8_t { Float32, Float64, BFloat16, Float16, Int64, Int32, Bool };

size_t element_size(DType dt);
const char* dtype_name(DType dt);
inline bool is_floating(DType dt) {
  return dt == DType::Float32 || dt == DType::Float64 || dt == DType::BFloat16 ||
         dt == DType::Float16;
}
inline bool is_half(DType dt) {
  return dt == DType::BFloat16 || dt == DType::Float16;
}
// The type arithmetic on `dt` is carried out in: 16-bit floats compute in float32.
inline DType compute_dtype(DType dt) {
  return is_half(dt) ? DType::Float32 : dt;
}
// The common type of a binary op's operands (float64 > float32 > half > int64 > int32 > bool).
DType promote_types(DType a, DType b);

template <class T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::Float32;
};
template <>
struct DTypeOf<double> {
  static constexpr DType value = DType::Float64;
};
template <>
struct DTypeOf<BFloat16> {
  static constexpr DType value = DType::BFloat16;
};
template <>
struct DTypeOf<Float16> {
  static constexpr DType value = DType::Float16;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::Int64;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::Int32;
};
template <>
struct DTypeOf<bool> {
  static constexpr DType value = DType::Bool;
};

// The C++ type arithmetic on T is carried out in.
template <class T>
struct ComputeType {
  using type = T;
};
template <>
struct ComputeType<BFloat16> {
  using type = float;
};
template <>
struct ComputeType<Float16> {
  using type = float;
};
template <class T>
using compute_t = typename ComputeType<T>::type;
template <class T>
compute_t<T> to_compute(T v) {
  return compute_t<T>(v);
}

// Calls f.template operator()<T>() with the C++ type of dt.
template <class F>
decltype(auto) dispatch_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::Float32:
      return f.template operator()<float>();
    case DType::Float64:
      return f.template operator()<double>();
    case DType::BFloat16:
      return f.template operator()<BFloat16>();
    case DType::Float16:
      return f.template operator()<Float16>();
    case DType::Int64:
      return f.template operator()<int64_t>();
    case DType::Int32:
      return f.template operator()<int32_t>();
    case DType::Bool:
      return f.template operator()<bool>();
  }
  return f.template operator()<float>();
}

}  // namespace tessera
