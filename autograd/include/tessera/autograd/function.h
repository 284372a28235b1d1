#pragma once
// Differentiable operations are Function subclasses with forward and backward, usable from any
// layer (collectives and redistribute are Functions too):
//
//   class Square : public autograd::Function {
//     std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
//       save_for_backward({in[0]});
//       return {kernels::binary(kernels::BinaryOp::Mul, in[0], in[0])};
//     }
//     std::vector<Tensor> backward(const std::vector<Tensor>& g) override { ... }
//   };
//   Tensor y = autograd::Function::apply<Square>({x})[0];
#include <memory>
#include <string>
#include <vector>

#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/node.h"

namespace tessera::autograd {

namespace detail {
class CheckpointFrame;
}

class Function : public Node {
 public:
  // Runs F(args...).forward(inputs) without recording, then, if grad mode is on and an input
  // requires grad, links the floating-point outputs to a new F node.
  template <class F, class... Args>
  static std::vector<Tensor> apply(const std::vector<Tensor>& inputs, Args&&... args) {
    std::shared_ptr<Function> fn = std::make_shared<F>(std::forward<Args>(args)...);
    return fn->run(inputs);
  }

  virtual std::vector<Tensor> forward(const std::vector<Tensor>& inputs) = 0;
  // One gradient per forward output in (zeros where none flowed, see materialize_grads), one
  // per forward input out (undefined for inputs that need none). Not called when no output
  // received a gradient: the node then passes none on.
  virtual std::vector<Tensor> backward(const std::vector<Tensor>& grad_outputs) = 0;

  std::string name() const override;
  void release_saved_tensors() override;
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) final;
  // The shape, dtype and device forward output `output_nr` had.
  GradientMeta gradient_meta(uint32_t output_nr) const final;

 protected:
  // Keeps tensors for backward with their versions: saved_tensors() refuses any that an
  // in-place write changed since (PyTorch's "modified by an inplace operation" error). Inside a
  // checkpointed region (checkpoint.h) it keeps only their descriptions, and saved_tensors()
  // gets them from the region's recomputation.
  void save_for_backward(std::vector<Tensor> tensors);
  const std::vector<Tensor>& saved_tensors() const;
  bool needs_input_grad(size_t i) const;
  size_t num_inputs() const { return needs_input_grad_.size(); }
  // When true (default), undefined output gradients reach backward() as zeros.
  void set_materialize_grads(bool v) { materialize_grads_ = v; }

 private:
  static constexpr size_t kNotSaved = size_t(-1);
  std::vector<Tensor> run(const std::vector<Tensor>& inputs);
  void release_frame();

  mutable std::vector<Tensor> saved_;     // filled from frame_ when checkpointed
  std::vector<uint32_t> saved_versions_;  // each saved tensor's version when it was saved
  std::shared_ptr<detail::CheckpointFrame> frame_;
  std::vector<size_t> frame_ids_;  // each saved tensor's index in frame_ (kNotSaved: undefined)
  bool saved_released_ = false;
  std::vector<bool> needs_input_grad_;
  bool materialize_grads_ = true;
  struct OutputMeta {
    Shape shape;
    DType dtype;
    Device device;
  };
  std::vector<OutputMeta> output_meta_;
};

}  // namespace tessera::autograd
