#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& sizes);
// Wraps a possibly negative dim into [0, ndim); `op` names the caller in the error.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
// The shape two operands broadcast to (numpy rules), or an error naming both shapes.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

}  // namespace tessera
