// Differentiable reductions. Backward reshapes the output gradient to the keepdim shape and
// broadcasts it over the reduced dims.
#include <algorithm>

#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/core/kernels/views.h"

namespace tessera {

namespace {

using kernels::BinaryOp;
using kernels::CompareOp;

// Result shapes of reducing `shape` over `dims` (all when empty): with keepdim (reduced dims
// set to 1) and without (reduced dims dropped).
struct ReducedShapes {
  Shape keep, squeezed;
};
ReducedShapes reduced_shapes(const Shape& shape, const std::vector<int64_t>& dims, const char* op) {
  std::vector<bool> reduced(shape.size(), dims.empty());
  for (int64_t d : dims) {
    const int64_t w = wrap_dim(d, int64_t(shape.size()), op);
    if (!shape.empty()) reduced[size_t(w)] = true;
  }
  ReducedShapes r;
  for (size_t i = 0; i < shape.size(); ++i) {
    r.keep.push_back(reduced[i] ? 1 : shape[i]);
    if (!reduced[i]) r.squeezed.push_back(shape[i]);
  }
  return r;
}

// The output gradient laid over the input's shape (materialised, so that nobody downstream
// receives a stride-0 view it might write into).
Tensor spread(const Tensor& g, const Shape& keep, const Shape& in_shape) {
  return kernels::expand(kernels::reshape(g, keep), in_shape).contiguous();
}

class SumFn final : public autograd::Function {
 public:
  SumFn(std::vector<int64_t> dims, bool keepdim, bool mean)
      : dims_(std::move(dims)), keepdim_(keepdim), mean_(mean) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    Tensor out = mean_ ? kernels::mean(x, dims_, keepdim_) : kernels::sum(x, dims_, keepdim_);
    in_shape_ = x.shape();
    keep_ = reduced_shapes(in_shape_, dims_, mean_ ? "mean" : "sum").keep;
    count_ = shape_numel(in_shape_) / std::max<int64_t>(shape_numel(keep_), 1);
    return {out};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    Tensor g = grads[0];
    if (mean_) g = kernels::binary_scalar(BinaryOp::Div, g, double(count_));
    return {spread(g, keep_, in_shape_)};
  }

 private:
  std::vector<int64_t> dims_;
  bool keepdim_, mean_;
  Shape in_shape_, keep_;
  int64_t count_ = 1;
};

class AmaxFn final : public autograd::Function {
 public:
  AmaxFn(std::vector<int64_t> dims, bool keepdim) : dims_(std::move(dims)), keepdim_(keepdim) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    Tensor out = kernels::amax(x, dims_, /*keepdim=*/true);
    const ReducedShapes shapes = reduced_shapes(x.shape(), dims_, "amax");
    keep_ = shapes.keep;
    save_for_backward({x, out});
    return {keepdim_ ? out : kernels::reshape(out, shapes.squeezed)};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& x = saved_tensors()[0];
    const Tensor& out = saved_tensors()[1];
    const Tensor g = kernels::reshape(grads[0], keep_);
    // Ties share the gradient evenly: each maximal element gets g / (number of maxima), as
    // torch's (g / mask.sum(dims)) * mask. A slice whose maximum is NaN has no element equal to
    // it, so all of its gradient is g / 0 * 0 = NaN there, as in torch (not a silent 0).
    Tensor mask = kernels::compare(CompareOp::Eq, x, out).to(g.dtype());
    Tensor count = kernels::sum(mask, dims_, /*keepdim=*/true);
    return {kernels::binary(BinaryOp::Mul, kernels::binary(BinaryOp::Div, g, count), mask)};
  }

 private:
  std::vector<int64_t> dims_;
  bool keepdim_;
  Shape keep_;
};

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return autograd::Function::apply<SumFn>({x}, dims, keepdim, false)[0];
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return autograd::Function::apply<SumFn>({x}, dims, keepdim, true)[0];
}

Tensor amax(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return autograd::Function::apply<AmaxFn>({x}, dims, keepdim)[0];
}

}  // namespace tessera
