#include "tessera/nn/dropout.h"

#include "tessera/autograd/ops.h"
#include "tessera/dtensor/random.h"

namespace tessera {

Dropout::Dropout(double p) : Module("Dropout"), p_(p) {
  TESSERA_CHECK(p >= 0 && p <= 1, "Dropout: probability p must be in [0, 1], got ", p);
}

Tensor Dropout::forward(const Tensor& x) {
  return dropout(x, p_, is_training(), default_generator());
}

DTensor Dropout::forward_dtensor(const DTensor& x) {
  return dropout(x, p_, is_training(), default_generator());
}

}  // namespace tessera
