#include "tessera/autograd/grad_mode.h"

#include "tessera/core/tensor.h"

namespace tessera {

bool grad_enabled() {
  return detail::t_grad_enabled;
}
void set_grad_enabled(bool enabled) {
  detail::t_grad_enabled = enabled;
}

}  // namespace tessera
