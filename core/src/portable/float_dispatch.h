#pragma once
// Private to the kernels that compute only in float32 or float64 (the optimizer updates, the
// vocabulary-parallel cross-entropy), on any device: runs f<float> or f<double> for t's dtype, and
// names `op`, `what` and t otherwise.
#include "tessera/core/error.h"
#include "tessera/core/tensor.h"

namespace tessera::kernels::portable {

template <class F>
void dispatch_float32_or_64(const char* op, const char* what, const Tensor& t, F&& f) {
  if (t.dtype() == DType::Float64)
    f.template operator()<double>();
  else if (t.dtype() == DType::Float32)
    f.template operator()<float>();
  else
    TESSERA_FAIL(op, ": ", what, " ", t.str(), " must be float32 or float64");
}

}  // namespace tessera::kernels::portable
