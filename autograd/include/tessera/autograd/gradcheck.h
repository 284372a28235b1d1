#pragma once
#include <functional>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera {

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-3;
  uint64_t seed = 1234;  // for the random output weighting
};

struct GradcheckResult {
  bool ok = true;
  double max_abs_error = 0;
  std::string message;  // names the input and element that failed
};

// Compares the analytical gradient of sum(w * f(inputs)) (w random, fixed by seed) with central
// finite differences, for every floating input that requires grad. Use float64 inputs.
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& opts = {});

}  // namespace tessera
