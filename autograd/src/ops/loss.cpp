// Cross-entropy over logits of any rank: the class dim is last (not dim 1 as in PyTorch), every
// other dim is a row.
#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
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

// A per-row loss reduced as `reduction` asks; a mean divides the sum by `rows`.
Tensor reduce_rows(const Tensor& per_row, kernels::Reduction reduction, double rows) {
  switch (reduction) {
    case kernels::Reduction::None:
      return per_row;
    case kernels::Reduction::Sum:
      return sum(per_row);
    case kernels::Reduction::Mean:
      break;
  }
  return div(sum(per_row), rows);
}

// Class probabilities, a floating target of the logits' shape, as PyTorch's: each row's loss is
// -sum(target * log_softmax(logits)). Built of differentiable ops so that a target which requires
// grad receives its gradient too (-log_softmax(logits) times the reduction's scale), as in
// PyTorch; ignore_index applies to class indices only.
Tensor cross_entropy_probabilities(const Tensor& logits, const Tensor& target,
                                   kernels::Reduction reduction, double label_smoothing) {
  TESSERA_CHECK(target.shape() == logits.shape(),
                "cross_entropy: a floating target holds class "
                "probabilities and must have the logits' shape ",
                shape_str(logits.shape()), ", got ", shape_str(target.shape()),
                " (class indices are int64 of shape ",
                shape_str(Shape(logits.shape().begin(), logits.shape().end() - 1)), ")");
  TESSERA_CHECK(target.dtype() == logits.dtype(), "cross_entropy: class probabilities ",
                target.str(), " must have the logits' dtype ", dtype_name(logits.dtype()));
  // PyTorch mixes the uniform distribution into the given one.
  const Tensor smoothed = label_smoothing == 0.0 ? target
                                                 : add(mul(target, 1.0 - label_smoothing),
                                                       label_smoothing / double(logits.size(-1)));
  Tensor per_row = neg(sum(mul(log_softmax(logits, -1), smoothed), {-1}));
  // A mean over the rows, not the probabilities' total, as PyTorch's.
  return reduce_rows(per_row, reduction, double(per_row.numel()));
}

// The smoothing term of class-index targets, as PyTorch's: each kept row's -(1/C) * sum over
// the classes of log_softmax, reduced as the loss is (a mean divides by the kept rows, as the
// nll's mean does: PyTorch without class weights).
Tensor smoothing_term(const Tensor& l2, const Tensor& t1, int64_t ignore_index,
                      kernels::Reduction reduction) {
  const std::vector<int64_t> t = t1.to_vector<int64_t>();
  std::vector<bool> ignored(t.size());
  int64_t kept = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    ignored[i] = t[i] == ignore_index;
    kept += ignored[i] ? 0 : 1;
  }
  const Tensor mask = from_vector<bool>(ignored, {int64_t(t.size())}).to(l2.device());
  const Tensor per_row =
      masked_fill(div(neg(sum(log_softmax(l2, -1), {-1})), double(l2.size(-1))), mask, 0.0);
  // No kept row: a mean of 0/0, NaN as the nll's.
  return reduce_rows(per_row, reduction, double(kept));
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                     kernels::Reduction reduction, double label_smoothing) {
  TESSERA_CHECK(logits.defined() && target.defined(), "cross_entropy: undefined logits or target");
  TESSERA_CHECK(logits.dim() >= 1, "cross_entropy: logits must have a class dim, got ",
                logits.str());
  TESSERA_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0,
                "cross_entropy: label_smoothing must be in [0, 1], got ", label_smoothing);
  if (is_floating(target.dtype()))
    return cross_entropy_probabilities(logits, target, reduction, label_smoothing);
  Shape rows(logits.shape().begin(), logits.shape().end() - 1);
  TESSERA_CHECK(target.shape() == rows, "cross_entropy: target shape ", shape_str(target.shape()),
                " does not match logits shape ", shape_str(logits.shape()),
                " (expected target shape ", shape_str(rows), ")");
  const int64_t n = shape_numel(rows), c = logits.size(-1);
  Tensor l2 = logits.dim() == 2 ? logits : reshape(logits, {n, c});
  Tensor t1 = target.dim() == 1 ? target : kernels::reshape(target, {n});
  Tensor loss = autograd::Function::apply<CrossEntropyFn>({l2, t1}, ignore_index, reduction)[0];
  if (label_smoothing != 0.0) {
    // (1 - eps) * nll + eps * smoothing, each reduced alike: the fused kernel keeps the nll.
    loss = add(mul(loss, 1.0 - label_smoothing),
               mul(smoothing_term(l2, t1, ignore_index, reduction), label_smoothing));
  }
  if (reduction == kernels::Reduction::None && target.dim() != 1) loss = reshape(loss, rows);
  return loss;
}

}  // namespace tessera
