#pragma once
#include "tessera/nn/module.h"

namespace tessera {

// torch.nn.Dropout: inverted dropout while training, the identity in eval(). Draws from the
// process-wide default_generator(), as PyTorch does; under SequenceParallel the mask is the one a
// single process would draw for the whole activation, so seed the generator alike on the ranks of
// the tensor-parallel mesh (a mismatch is an error on every rank).
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  DTensor forward_dtensor(const DTensor& x) override;
  double p() const { return p_; }

 private:
  double p_;
};

}  // namespace tessera
