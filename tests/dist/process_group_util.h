#pragma once
// Shared by the process group tests: the world, every dtype and reduce op, tensors whose element
// i is f(i), and the reductions' expected values computed from the rank numbers alone.
#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "tessera/comm/comm.h"
#include "tessera/core/core.h"

namespace tessera::process_group_test {

inline ProcessGroupPtr world() {
  return world_group();
}

inline const std::vector<DType> kDTypes = {DType::Float32, DType::Float64, DType::BFloat16,
                                           DType::Float16, DType::Int64,   DType::Int32,
                                           DType::Bool};
inline const std::vector<ReduceOp> kOps = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max,
                                           ReduceOp::Min, ReduceOp::Product};

// A tensor of `shape` and dtype `dt` whose row-major element i is f(i).
inline Tensor make(DType dt, const Shape& shape, const std::function<double(int64_t)>& f) {
  std::vector<double> v(size_t(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = f(int64_t(i));
  return from_vector<double>(v, shape).to(dt);
}
inline std::vector<double> values(const Tensor& t) {
  return t.to_vector<double>();
}

// Rank r's contribution to element i. Small integers, so every dtype (16-bit floats included)
// holds every partial sum, max, min and product exactly, whatever order MPI combines them in.
inline double contribution(ReduceOp op, DType dt, int r, int64_t i) {
  if (dt == DType::Bool) return (r + i) % 3 == 0 ? 1 : 0;
  if (op == ReduceOp::Product) return double(1 + (r + i) % 2);  // at most 2^8 on 8 ranks
  return double((r * 7 + i * 3) % 5 + 1);
}

// Avg is the sum divided by the rank count in the dtype's own arithmetic: float32 for the 16-bit
// floats (then rounded), truncating division for integers.
inline double average(DType dt, double sum, int n) {
  switch (dt) {
    case DType::Float64:
      return sum / n;
    case DType::Float32:
      return double(float(sum) / float(n));
    case DType::BFloat16:
      return double(float(BFloat16(float(sum) / float(n))));
    case DType::Float16:
      return double(float(Float16(float(sum) / float(n))));
    default:
      return double(int64_t(sum) / n);
  }
}

inline double expected_reduction(ReduceOp op, DType dt, int n,
                                 const std::function<double(int)>& v) {
  if (dt == DType::Bool) {
    bool any = false;
    bool all = true;
    for (int r = 0; r < n; ++r) {
      any = any || v(r) != 0;
      all = all && v(r) != 0;
    }
    return (op == ReduceOp::Sum || op == ReduceOp::Max) ? any : all;
  }
  double acc = v(0);
  for (int r = 1; r < n; ++r) {
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        acc += v(r);
        break;
      case ReduceOp::Max:
        acc = std::max(acc, v(r));
        break;
      case ReduceOp::Min:
        acc = std::min(acc, v(r));
        break;
      case ReduceOp::Product:
        acc *= v(r);
        break;
    }
  }
  return op == ReduceOp::Avg ? average(dt, acc, n) : acc;
}

inline std::string label(DType dt, ReduceOp op) {
  return std::string(dtype_name(dt)) + " " + reduce_op_name(op);
}

}  // namespace tessera::process_group_test
