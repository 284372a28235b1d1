// Cross-entropy over logits of any rank: the class dim is last, every other dim is a row.
#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/core/kernels/views.h"

namespace tessera {

namespace {

class CrossEntropyFn final : public autograd::Function {
 public:
  CrossEntropyFn(int64_t ignore_index, kernels::Reduction reduction)
      : ignore_index_(ignore_index), reduction_(reduction) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    save_for_backward({in[0], in[1]});
    return {kernels::cross_entropy(in[0], in[1], ignore_index_, reduction_)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& logits = saved_tensors()[0];
    const Tensor& target = saved_tensors()[1];
    return {kernels::cross_entropy_backward(grads[0], logits, target, ignore_index_, reduction_),
            Tensor()};
  }

 private:
  int64_t ignore_index_;
  kernels::Reduction reduction_;
};

// Class probabilities, a floating target of the logits' shape, as PyTorch's: each row's loss is
// -sum(target * log_softmax(logits)). Built of differentiable ops so that a target which requires
// grad receives its gradient too (-log_softmax(logits) times the reduction's scale), as in
// PyTorch; ignore_index applies to class indices only.
Tensor cross_entropy_probabilities(const Tensor& logits, const Tensor& target,
                                   kernels::Reduction reduction) {
  TESSERA_CHECK(target.shape() == logits.shape(),
                "cross_entropy: a floating target holds class "
                "probabilities and must have the logits' shape ",
                shape_str(logits.shape()), ", got ", shape_str(target.shape()),
                " (class indices are int64 of shape ",
                shape_str(Shape(logits.shape().begin(), logits.shape().end() - 1)), ")");
  TESSERA_CHECK(target.dtype() == logits.dtype(), "cross_entropy: class probabilities ",
                target.str(), " must have the logits' dtype ", dtype_name(logits.dtype()));
  Tensor per_row = neg(sum(mul(log_softmax(logits, -1), target), {-1}));
  switch (reduction) {
    case kernels::Reduction::None:
      return per_row;
    case kernels::Reduction::Sum:
      return sum(per_row);
    case kernels::Reduction::Mean:
      break;
  }
  return mean(per_row);  // over the rows, not the probabilities' total, as PyTorch's
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                     kernels::Reduction reduction) {
  TESSERA_CHECK(logits.defined() && target.defined(), "cross_entropy: undefined logits or target");
  TESSERA_CHECK(logits.dim() >= 1, "cross_entropy: logits must have a class dim, got ",
                logits.str());
  if (is_floating(target.dtype())) return cross_entropy_probabilities(logits, target, reduction);
  Shape rows(logits.shape().begin(), logits.shape().end() - 1);
  TESSERA_CHECK(target.shape() == rows, "cross_entropy: target shape ", shape_str(target.shape()),
                " does not match logits shape ", shape_str(logits.shape()),
                " (expected target shape ", shape_str(rows), ")");
  const int64_t n = shape_numel(rows), c = logits.size(-1);
  Tensor l2 = logits.dim() == 2 ? logits : reshape(logits, {n, c});
  Tensor t1 = target.dim() == 1 ? target : kernels::reshape(target, {n});
  Tensor loss = autograd::Function::apply<CrossEntropyFn>({l2, t1}, ignore_index, reduction)[0];
  if (reduction == kernels::Reduction::None && target.dim() != 1) loss = reshape(loss, rows);
  return loss;
}

}  // namespace tessera
