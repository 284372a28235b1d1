#pragma once
// Parameters a LoRA wrapper keeps beside its base parameter (adapter matrices, trainable token
// rows): made zero and laid out for the base, cut to each rank's window once the base is
// distributed, and checked finite before a merge. LoraLayer and TokenEmbedding share these.
#include <cmath>

#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/dtensor/dtensor.h"
#include "tessera/nn/parameter.h"

namespace tessera::lora_detail {

// Zeros of `shape` and `dtype` on the base's device: plain beside a plain base, else a DTensor
// on the base's mesh with `placements`.
inline Parameter zero_beside(const Shape& shape, DType dtype, const Parameter& base,
                             const Placements& placements) {
  const TensorOptions opts(dtype, base.stored().device());
  if (!base.is_dtensor()) return Parameter(zeros(shape, opts));
  const DTensor& w = base.stored_dtensor();
  auto spec = std::make_shared<const DTensorSpec>(w.mesh(), placements, shape, dtype);
  return Parameter(DTensor(spec, zeros(spec->local_layout().local_shape, opts)));
}

// A plain parameter that holds the same values on every rank becomes a DTensor with
// `placements`: each rank cuts its window of its own copy, no data moving.
inline void cut_to_window(Parameter& p, const DeviceMesh& mesh, const Placements& placements,
                          const std::string& kind) {
  TESSERA_CHECK(!p.is_dtensor(), kind, ": ", p.str(), " is distributed already");
  p = Parameter(distribute_tensor(p.full(), mesh, placements, kEveryRank), p.requires_grad());
}

// Whether every value of `t` is finite (no NaN, no infinity).
inline bool all_finite(const Tensor& t) {
  // 0 * x is 0 for every finite x and NaN for an infinite or NaN one.
  const Tensor zeros_or_nan = kernels::binary_scalar(
      kernels::BinaryOp::Mul, t.to(promote_types(t.dtype(), DType::Float32)), 0.0);
  return !std::isnan(kernels::sum(zeros_or_nan).to(DType::Float64).item<double>());
}

}  // namespace tessera::lora_detail
