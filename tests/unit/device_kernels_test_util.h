#pragma once
// Shared by the device kernel tests: moving a tensor to the device, the rounding a device may
// differ from the CPU by, comparing a device result with the CPU's, and dtype lists.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing/checks.h"

namespace tessera::device_kernels_test {

using tessera::testing::Tolerance;

inline Tensor cuda(const Tensor& t) {
  return t.to(Device::cuda(0));
}

// Rounding a transcendental may differ between a device and the CPU: a few float32 ulps, which
// a 16-bit result can turn into one ulp of its own.
inline Tolerance rounding_of(DType dt) {
  switch (dt) {
    case DType::Float64:
      return {1e-12, 1e-14};
    case DType::BFloat16:
      return {1e-2, 1e-3};
    case DType::Float16:
      return {2e-3, 1e-4};
    default:
      return {1e-5, 1e-6};
  }
}

inline void expect_matches(const Tensor& device_result, const Tensor& cpu_result, Tolerance tol,
                           const std::string& what) {
  ASSERT_TRUE(device_result.device().is_cuda()) << what << ": " << device_result.str();
  EXPECT_EQ(device_result.dtype(), cpu_result.dtype()) << what;
  const std::string problem = tessera::testing::tensor_mismatch(
      device_result.to(Device::cpu()).to(DType::Float64), cpu_result.to(DType::Float64), tol);
  EXPECT_EQ(problem, "") << what;
}

inline const std::vector<DType> kFloatDtypes = {DType::Float32, DType::Float64, DType::BFloat16,
                                                DType::Float16};

inline bool is_integer(DType dt) {
  return dt == DType::Int64 || dt == DType::Int32;
}

}  // namespace tessera::device_kernels_test
