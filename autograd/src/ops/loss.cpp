// Cross-entropy over logits of any rank: the class dim is last (not dim 1 as in PyTorch), every
// other dim is a row.
#include <string>

#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/core/kernels/views.h"

namespace tessera {

namespace {

// Class indices: the fused kernel both ways, label smoothing and class weights included. The
// weights are a constant of the loss: they receive no gradient.
class CrossEntropyFn final : public autograd::Function {
 public:
  CrossEntropyFn(int64_t ignore_index, kernels::Reduction reduction, double label_smoothing,
                 Tensor weight)
      : ignore_index_(ignore_index),
        reduction_(reduction),
        label_smoothing_(label_smoothing),
        weight_(std::move(weight)) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    save_for_backward({in[0], in[1]});
    return {
        kernels::cross_entropy(in[0], in[1], ignore_index_, reduction_, label_smoothing_, weight_)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& logits = saved_tensors()[0];
    const Tensor& target = saved_tensors()[1];
    return {kernels::cross_entropy_backward(grads[0], logits, target, ignore_index_, reduction_,
                                            label_smoothing_, weight_),
            Tensor()};
  }

 private:
  int64_t ignore_index_;
  kernels::Reduction reduction_;
  double label_smoothing_;
  Tensor weight_;
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
// With weight, each class's term is scaled by weight[c], as PyTorch's.
Tensor cross_entropy_probabilities(const Tensor& logits, const Tensor& target,
                                   kernels::Reduction reduction, double label_smoothing,
                                   const Tensor& weight) {
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
  const Tensor terms = mul(log_softmax(logits, -1), smoothed);
  Tensor per_row = neg(sum(weight.defined() ? mul(terms, weight) : terms, {-1}));
  // A mean over the rows, not the probabilities' total, as PyTorch's.
  return reduce_rows(per_row, reduction, double(per_row.numel()));
}

}  // namespace

// PyTorch's backward refuses a weight that requires grad; refusing it before the forward says so
// where it is passed.
std::string cross_entropy_weight_problem(const Tensor& weight, const Shape& logits_shape,
                                         DType logits_dtype, const Device& logits_device,
                                         std::string_view logits_name, std::string_view classes) {
  std::string problem = kernels::class_weight_problem(weight, logits_shape, logits_dtype,
                                                      logits_device, logits_name, classes);
  if (problem.empty() && weight.defined() && weight.requires_grad())
    problem = "weight " + weight.str() +
              " requires grad, but class weights receive no gradient (detach it)";
  return problem;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                     kernels::Reduction reduction, double label_smoothing, const Tensor& weight) {
  TESSERA_CHECK(logits.defined() && target.defined(), "cross_entropy: undefined logits or target");
  TESSERA_CHECK(logits.dim() >= 1, "cross_entropy: logits must have a class dim, got ",
                logits.str());
  TESSERA_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0,
                "cross_entropy: label_smoothing must be in [0, 1], got ", label_smoothing);
  // Checked against the logits as passed (any number of dims), before they become [N, C].
  const std::string weight_problem =
      cross_entropy_weight_problem(weight, logits.shape(), logits.dtype(), logits.device());
  TESSERA_CHECK(weight_problem.empty(), "cross_entropy: ", weight_problem);
  if (is_floating(target.dtype()))
    return cross_entropy_probabilities(logits, target, reduction, label_smoothing, weight);
  Shape rows(logits.shape().begin(), logits.shape().end() - 1);
  TESSERA_CHECK(target.shape() == rows, "cross_entropy: target shape ", shape_str(target.shape()),
                " does not match logits shape ", shape_str(logits.shape()),
                " (expected target shape ", shape_str(rows), ")");
  const int64_t n = shape_numel(rows), c = logits.size(-1);
  Tensor l2 = logits.dim() == 2 ? logits : reshape(logits, {n, c});
  Tensor t1 = target.dim() == 1 ? target : kernels::reshape(target, {n});
  Tensor loss = autograd::Function::apply<CrossEntropyFn>({l2, t1}, ignore_index, reduction,
                                                          label_smoothing, weight)[0];
  if (reduction == kernels::Reduction::None && target.dim() != 1) loss = reshape(loss, rows);
  return loss;
}

}  // namespace tessera
