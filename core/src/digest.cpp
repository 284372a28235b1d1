#include "tessera/core/digest.h"

#include <functional>
#include <string_view>

#include "tessera/core/error.h"

namespace tessera {

uint64_t values_digest(const Tensor& t) {
  TESSERA_CHECK(t.defined(), "values_digest: an undefined tensor");
  TESSERA_CHECK(t.device().is_cpu(), "values_digest: ", t.str(),
                " is not on the host (copy it there first)");
  const Tensor c = t.contiguous();
  const std::string_view bytes(static_cast<const char*>(c.raw_data()),
                               size_t(c.numel()) * element_size(c.dtype()));
  return uint64_t(std::hash<std::string_view>()(bytes));
}

}  // namespace tessera
