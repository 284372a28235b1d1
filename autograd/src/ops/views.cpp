// Differentiable views. Every view but expand maps each input element to at most one output
// element, so one Function serves them all: backward scatters the gradient into zeros through
// the same view. Reshapes take the cheaper path of reshaping the gradient back.
#include <functional>

#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/views.h"

namespace tessera {

namespace {

using ViewOf = std::function<Tensor(const Tensor&)>;

class InjectiveView final : public autograd::Function {
 public:
  explicit InjectiveView(ViewOf view_of) : view_of_(std::move(view_of)) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    shape_ = in[0].shape();
    return {view_of_(in[0])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    Tensor gi = zeros(shape_, TensorOptions(g[0].dtype(), g[0].device()));
    Tensor window = view_of_(gi);
    window.copy_(g[0]);
    return {gi};
  }

 private:
  ViewOf view_of_;
  Shape shape_;
};

class ReshapeView final : public autograd::Function {
 public:
  ReshapeView(Shape shape, bool must_view) : shape_(std::move(shape)), must_view_(must_view) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    in_shape_ = in[0].shape();
    return {must_view_ ? kernels::view(in[0], shape_) : kernels::reshape(in[0], shape_)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    return {kernels::reshape(g[0], in_shape_)};
  }

 private:
  Shape shape_, in_shape_;
  bool must_view_;
};

class ExpandView final : public autograd::Function {
 public:
  explicit ExpandView(Shape shape) : shape_(std::move(shape)) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    in_shape_ = in[0].shape();
    return {kernels::expand(in[0], shape_)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    return {kernels::sum_to_shape(g[0], in_shape_)};
  }

 private:
  Shape shape_, in_shape_;
};

Tensor injective(const Tensor& x, ViewOf f) {
  return autograd::Function::apply<InjectiveView>({x}, std::move(f))[0];
}

}  // namespace

Tensor view(const Tensor& x, const Shape& shape) {
  return autograd::Function::apply<ReshapeView>({x}, shape, true)[0];
}
Tensor reshape(const Tensor& x, const Shape& shape) {
  return autograd::Function::apply<ReshapeView>({x}, shape, false)[0];
}
Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim) {
  Shape s = kernels::flatten(x.detach(), start_dim, end_dim).shape();
  return reshape(x, s);
}
Tensor unsqueeze(const Tensor& x, int64_t dim) {
  return reshape(x, kernels::unsqueeze(x.detach(), dim).shape());
}
Tensor squeeze(const Tensor& x, int64_t dim) {
  return reshape(x, kernels::squeeze(x.detach(), dim).shape());
}
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  return injective(x, [=](const Tensor& t) { return kernels::narrow(t, dim, start, length); });
}
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  return injective(x, [=](const Tensor& t) { return kernels::slice(t, dim, start, end, step); });
}
Tensor select(const Tensor& x, int64_t dim, int64_t index) {
  return injective(x, [=](const Tensor& t) { return kernels::select(t, dim, index); });
}
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  return injective(x, [=](const Tensor& t) { return kernels::transpose(t, d0, d1); });
}
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  return injective(x, [=](const Tensor& t) { return kernels::permute(t, dims); });
}
Tensor expand(const Tensor& x, const Shape& shape) {
  return autograd::Function::apply<ExpandView>({x}, shape)[0];
}
Tensor contiguous(const Tensor& x) {
  if (x.is_contiguous()) return x;
  return injective(x, [](const Tensor& t) { return t.contiguous(); });
}
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  std::vector<Tensor> pieces = kernels::chunk(x.detach(), chunks, dim);
  std::vector<Tensor> out;
  int64_t d = wrap_dim(dim, x.dim(), "chunk"), start = 0;
  for (const Tensor& p : pieces) {
    out.push_back(narrow(x, d, start, p.size(d)));
    start += p.size(d);
  }
  return out;
}
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  kernels::split(x.detach(), sizes, dim);  // validates
  std::vector<Tensor> out;
  int64_t d = wrap_dim(dim, x.dim(), "split"), start = 0;
  for (int64_t s : sizes) {
    out.push_back(narrow(x, d, start, s));
    start += s;
  }
  return out;
}

}  // namespace tessera
