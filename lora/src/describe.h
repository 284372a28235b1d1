#pragma once
// How a wrapper's extra parameters are described to parallelize_module's agreement
// (Module::tensor_parallel_inputs): after_tensor_parallel cuts each from this rank's own copy
// (kEveryRank), whose values must be every rank's, so a rank holding other values is refused
// before the first target changes rather than in one layer's distribution, after earlier targets
// had. Device tensors are not read back, as distribute_tensor does not.
#include <cstdio>
#include <string>
#include <utility>

#include "tessera/core/digest.h"
#include "tessera/nn/parameter.h"

namespace tessera::lora_detail {

inline std::pair<std::string, std::string> describe_parameter(const std::string& name,
                                                              const Parameter& p) {
  const Tensor& t = p.stored();
  std::string values = "on a device";
  if (t.device().is_cpu()) {
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)values_digest(t));
    values = std::string("digest ") + hex;
  }
  return {name,
          detail::concat(dtype_name(t.dtype()), " ", shape_str(p.global_shape()), " ", values)};
}

}  // namespace tessera::lora_detail
