#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"

namespace tessera {

namespace {

class CloneFn final : public autograd::Function {
 public:
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override { return {in[0].clone()}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override { return {g[0]}; }
};

class CastFn final : public autograd::Function {
 public:
  explicit CastFn(DType to) : to_(to) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    from_ = in[0].dtype();
    return {in[0].to(to_)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override { return {g[0].to(from_)}; }

 private:
  DType to_, from_ = DType::Float32;
};

class ToDeviceFn final : public autograd::Function {
 public:
  explicit ToDeviceFn(Device to) : to_(to) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    from_ = in[0].device();
    return {in[0].to(to_)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override { return {g[0].to(from_)}; }

 private:
  Device to_, from_;
};

}  // namespace

Tensor clone(const Tensor& x) {
  return autograd::Function::apply<CloneFn>({x})[0];
}
Tensor cast(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  return autograd::Function::apply<CastFn>({x}, dtype)[0];
}

Tensor to_device(const Tensor& x, Device device) {
  if (x.device() == device) return x;
  return autograd::Function::apply<ToDeviceFn>({x}, device)[0];
}

}  // namespace tessera
