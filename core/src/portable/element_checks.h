#pragma once
// Private to core: the names and argument checks of the elementwise kernels, shared by the CPU
// implementation and the device one (portable/kernels.h), so both refuse the same inputs with
// the same words.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../overlap.h"
#include "tessera/core/error.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/tensor.h"

namespace tessera::kernels::portable {

inline const char* unary_name(UnaryOp op) {
  switch (op) {
    case UnaryOp::Neg:
      return "neg";
    case UnaryOp::Exp:
      return "exp";
    case UnaryOp::Log:
      return "log";
    case UnaryOp::Sqrt:
      return "sqrt";
    case UnaryOp::Rsqrt:
      return "rsqrt";
    case UnaryOp::Tanh:
      return "tanh";
    case UnaryOp::Sigmoid:
      return "sigmoid";
    case UnaryOp::Relu:
      return "relu";
    case UnaryOp::Gelu:
      return "gelu";
    case UnaryOp::GeluTanh:
      return "gelu(tanh)";
    case UnaryOp::Silu:
      return "silu";
    case UnaryOp::Abs:
      return "abs";
    case UnaryOp::Sin:
      return "sin";
    case UnaryOp::Cos:
      return "cos";
    case UnaryOp::Square:
      return "square";
    case UnaryOp::Reciprocal:
      return "reciprocal";
  }
  return "unary";
}

// Ops that are exact on integers; everything else needs a floating dtype.
inline bool integer_ok(UnaryOp op) {
  return op == UnaryOp::Neg || op == UnaryOp::Abs || op == UnaryOp::Square || op == UnaryOp::Relu;
}

inline const char* binary_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::Add:
      return "add";
    case BinaryOp::Sub:
      return "sub";
    case BinaryOp::Mul:
      return "mul";
    case BinaryOp::Div:
      return "div";
    case BinaryOp::Pow:
      return "pow";
    case BinaryOp::Maximum:
      return "maximum";
    case BinaryOp::Minimum:
      return "minimum";
  }
  return "binary";
}

inline const char* compare_name(CompareOp op) {
  switch (op) {
    case CompareOp::Eq:
      return "eq";
    case CompareOp::Ne:
      return "ne";
    case CompareOp::Lt:
      return "lt";
    case CompareOp::Le:
      return "le";
    case CompareOp::Gt:
      return "gt";
    case CompareOp::Ge:
      return "ge";
  }
  return "compare";
}

inline bool is_int(DType dt) {
  return dt == DType::Int64 || dt == DType::Int32;
}
inline bool int_op(BinaryOp op) {
  return op != BinaryOp::Div && op != BinaryOp::Pow;
}

inline void check_binary_dtype(const char* name, BinaryOp op, DType dt, const Tensor& a,
                               const Tensor& b) {
  TESSERA_CHECK(is_floating(dt) || (is_int(dt) && int_op(op)), name, ": unsupported dtypes ",
                dtype_name(a.dtype()), " ", shape_str(a.shape()), " and ", dtype_name(b.dtype()),
                " ", shape_str(b.shape()), " (expected floating dtypes",
                int_op(op) ? " or int32/int64" : "", ")");
}

// Whether the double `s` is an integer the signed integer type C holds. The upper bound is
// compared as -lowest (2^63 for int64, exact in a double), not as max: 2^63 - 1 rounds up to
// 2^63 as a double, which `s <= max` let through to an undefined conversion (INT64_MIN on x86).
template <class C>
bool holds_integer(double s) {
  static_assert(std::is_integral_v<C> && std::is_signed_v<C>);
  return s == std::trunc(s) && s >= double(std::numeric_limits<C>::lowest()) &&
         s < -double(std::numeric_limits<C>::lowest());
}

// A fill (fill_, full, masked_fill) of a floating dtype refuses a finite value beyond the dtype's
// largest, as PyTorch's checked conversion does ("value cannot be converted to type at::Half
// without overflow"): the conversion made it inf silently. Infinities and NaN are kept.
inline void check_float_fill(const char* op, DType dt, double value) {
  double max = 0;
  switch (dt) {
    case DType::Float16:
      max = 65504.0;
      break;
    case DType::BFloat16:
      max = 3.3895313892515355e38;  // (2 - 2^-7) * 2^127
      break;
    case DType::Float32:
      max = double(std::numeric_limits<float>::max());
      break;
    default:
      return;
  }
  TESSERA_CHECK(!std::isfinite(value) || std::fabs(value) <= max, op, ": value ", value,
                " cannot be converted to ", dtype_name(dt), " without overflow (its largest is ",
                max, ")");
}

// The scalar in the tensor's compute type. Integer tensors keep their dtype, so the scalar must
// be an integer they can hold; anything else is an error rather than a silent truncation.
template <class C>
C scalar_as(const char* name, DType dt, double s) {
  if constexpr (std::is_integral_v<C>) {
    TESSERA_CHECK(std::isfinite(s) && holds_integer<C>(s), name, ": scalar ", s,
                  " cannot be applied to a ", dtype_name(dt),
                  " tensor (needs an integer in range; cast the tensor to a floating dtype)");
  } else {
    (void)name;
    (void)dt;
  }
  return C(s);
}

// In-place ops write each element once, which a destination with two elements at one address
// (an expanded view: stride 0 along a dim of size > 1) cannot honour.
inline void check_writable(const char* op, const Tensor& dst) {
  TESSERA_CHECK(!detail::has_internal_overlap(dst), op, ": destination ", dst.str(),
                " with strides ", shape_str(dst.strides()),
                ": more than one element of the written-to tensor refers to a single memory "
                "location (an expanded view?); clone it first");
}

// add_'s source as its loops may read it: a copy when the destination's writes could reach it
// before it is read (x.add_(x.t()), x[1:].add_(x[:-1])); the source itself otherwise, and for
// x.add_(x), whose elements each read only what they write.
inline Tensor add_source(const Tensor& dst, const Tensor& src) {
  return detail::overlaps_partially(dst, src) ? src.clone() : src;
}

inline void check_unary_dtype(const char* name, UnaryOp op, const Tensor& x) {
  const DType dt = x.dtype();
  TESSERA_CHECK(is_floating(dt) || (is_int(dt) && integer_ok(op)), name, ": unsupported dtype ",
                dtype_name(dt), " for input of shape ", shape_str(x.shape()),
                " (expected a floating dtype", integer_ok(op) ? " or int32/int64" : "", ")");
}

inline void check_unary_backward(const char* name, const Tensor& grad, const Tensor& x) {
  TESSERA_CHECK(grad.shape() == x.shape(), name, " backward: gradient shape ",
                shape_str(grad.shape()), " does not match input shape ", shape_str(x.shape()));
  TESSERA_CHECK(is_floating(grad.dtype()) && is_floating(x.dtype()), name,
                " backward: needs floating tensors, got gradient ", dtype_name(grad.dtype()),
                " and input ", dtype_name(x.dtype()));
}

inline void check_scalar_dtype(const char* name, BinaryOp op, const Tensor& a) {
  const DType dt = a.dtype();
  TESSERA_CHECK(is_floating(dt) || (is_int(dt) && int_op(op)), name, ": unsupported dtype ",
                dtype_name(dt), " for tensor of shape ", shape_str(a.shape()),
                " with a scalar (expected a floating dtype", int_op(op) ? " or int32/int64" : "",
                ")");
}

// add_'s checks; returns nothing to do when dst is empty.
inline void check_add_(const Tensor& dst, const Tensor& src, const Shape& shape) {
  const DType dt = dst.dtype();
  TESSERA_CHECK(is_floating(dt) || is_int(dt), "add_: unsupported destination dtype ",
                dtype_name(dt), " (expected a floating dtype or int32/int64)");
  TESSERA_CHECK(is_floating(dt) || !is_floating(src.dtype()), "add_: cannot add a ",
                dtype_name(src.dtype()), " source into a ", dtype_name(dt),
                " destination without losing the fraction");
  TESSERA_CHECK(shape == dst.shape(), "add_: source shape ", shape_str(src.shape()),
                " does not broadcast to destination shape ", shape_str(dst.shape()));
  check_writable("add_", dst);
}

inline void check_mul_scalar_(const Tensor& dst) {
  const DType dt = dst.dtype();
  TESSERA_CHECK(is_floating(dt) || is_int(dt), "mul_scalar_: unsupported dtype ", dtype_name(dt),
                " for tensor of shape ", shape_str(dst.shape()),
                " (expected a floating dtype or int32/int64)");
  check_writable("mul_scalar_", dst);
}

inline void check_bool_mask(const char* op, const char* what, const Tensor& mask) {
  TESSERA_CHECK(mask.dtype() == DType::Bool, op, ": ", what, " must be bool, got ",
                dtype_name(mask.dtype()), " ", shape_str(mask.shape()));
}

// The dims sum_to_shape reduces (keeping them) to take a tensor of shape `xs` down to `shape`,
// the inverse of broadcasting `shape` to `xs`.
inline std::vector<int64_t> sum_to_shape_dims(const Shape& xs, const Shape& shape) {
  bool ok = shape.size() <= xs.size();
  const size_t lead = ok ? xs.size() - shape.size() : 0;
  std::vector<int64_t> dims;
  for (size_t i = 0; i < lead; ++i)
    dims.push_back(int64_t(i));
  for (size_t i = 0; ok && i < shape.size(); ++i) {
    if (shape[i] == xs[lead + i]) continue;
    ok = shape[i] == 1;
    dims.push_back(int64_t(lead + i));
  }
  TESSERA_CHECK(ok, "sum_to_shape: cannot sum a tensor of shape ", shape_str(xs), " down to ",
                shape_str(shape), " (", shape_str(shape), " does not broadcast to ", shape_str(xs),
                ")");
  return dims;
}

// An optimizer update's operand: contiguous, with the parameter's shape and dtype.
inline void check_update_operand(const char* op, const Tensor& param, const Tensor& t,
                                 const char* what) {
  TESSERA_CHECK(
      t.defined() && t.shape() == param.shape() && t.dtype() == param.dtype() && t.is_contiguous(),
      op, ": ", what, " ", t.defined() ? t.str() : std::string("(undefined)"),
      " must be contiguous with the parameter's shape and dtype ", param.str());
}

}  // namespace tessera::kernels::portable
