// cat, stack and index_select. Their gradients are windows of the output gradient (cat, stack),
// returned as views, or an index_add (index_select). cat and stack may promote mixed dtypes, so
// each input's gradient is cast back to that input's dtype.
#include "tessera/core/kernels/shape_ops.h"

#include <algorithm>

#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"

namespace tessera {

namespace {

Tensor as_dtype(const Tensor& g, DType dt) {
  return g.dtype() == dt ? g : g.to(dt);
}

class CatFn final : public autograd::Function {
 public:
  explicit CatFn(int64_t dim) : dim_(dim) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    Tensor out = kernels::cat(in, dim_);
    // A legacy empty input [0] took no part in the output (kernels::cat skips it); when all
    // are such, dim was never checked, as in PyTorch.
    for (const Tensor& t : in) {
      skipped_.push_back(t.dim() == 1 && t.size(0) == 0);
      dtypes_.push_back(t.dtype());
    }
    const bool all_skipped = std::find(skipped_.begin(), skipped_.end(), false) == skipped_.end();
    if (!all_skipped) dim_ = wrap_dim(dim_, out.dim(), "cat");
    for (size_t i = 0; i < in.size(); ++i)
      sizes_.push_back(skipped_[i] ? 0 : in[i].size(dim_));
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    std::vector<Tensor> out(sizes_.size());
    int64_t offset = 0;
    for (size_t i = 0; i < sizes_.size(); ++i) {
      if (needs_input_grad(i)) {
        // As PyTorch's cat backward: a skipped input gets an empty gradient of its own shape.
        out[i] = skipped_[i]
                     ? zeros({0}, TensorOptions(dtypes_[i], grads[0].device()))
                     : as_dtype(kernels::narrow(grads[0], dim_, offset, sizes_[i]), dtypes_[i]);
      }
      offset += sizes_[i];
    }
    return out;
  }

 private:
  int64_t dim_;
  std::vector<int64_t> sizes_;
  std::vector<DType> dtypes_;
  std::vector<bool> skipped_;
};

class StackFn final : public autograd::Function {
 public:
  explicit StackFn(int64_t dim) : dim_(dim) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    Tensor out = kernels::stack(in, dim_);
    dim_ = wrap_dim(dim_, out.dim(), "stack");
    for (const Tensor& t : in)
      dtypes_.push_back(t.dtype());
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    std::vector<Tensor> out(dtypes_.size());
    for (size_t i = 0; i < dtypes_.size(); ++i)
      if (needs_input_grad(i))
        out[i] = as_dtype(kernels::select(grads[0], dim_, int64_t(i)), dtypes_[i]);
    return out;
  }

 private:
  int64_t dim_;
  std::vector<DType> dtypes_;
};

// Inputs {x, index}.
class IndexSelectFn final : public autograd::Function {
 public:
  explicit IndexSelectFn(int64_t dim) : dim_(dim) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    shape_ = in[0].shape();
    save_for_backward({in[1]});
    return {kernels::index_select(in[0], dim_, in[1])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    return {kernels::index_add(shape_, dim_, saved_tensors()[0], grads[0]), Tensor()};
  }

 private:
  int64_t dim_;
  Shape shape_;
};

}  // namespace

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  return autograd::Function::apply<CatFn>(tensors, dim)[0];
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  return autograd::Function::apply<StackFn>(tensors, dim)[0];
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  return autograd::Function::apply<IndexSelectFn>({x, index}, dim)[0];
}

}  // namespace tessera
