#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera {

// Backpropagates from `outputs`. Without grad_outputs each output must be a scalar and gets 1; a
// gradient given in another dtype is cast to its output's (PyTorch's engine does the same).
// Saved tensors are freed as each node runs unless retain_graph.
// `inputs` (PyTorch's backward(inputs=...)): when given, only these accumulate into .grad, and
// only the nodes between the outputs and them run; a non-leaf among them gets its .grad as
// retain_grad would give it. Each must require grad; one the graph does not reach gets nothing.
void backward(const std::vector<Tensor>& outputs, const std::vector<Tensor>& grad_outputs = {},
              bool retain_graph = false, const std::vector<Tensor>& inputs = {});
inline void backward(const Tensor& output, const Tensor& grad_output = {},
                     bool retain_graph = false) {
  backward(std::vector<Tensor>{output},
           grad_output.defined() ? std::vector<Tensor>{grad_output} : std::vector<Tensor>{},
           retain_graph);
}

// Hooks. A gradient hook may return a replacement gradient of the same shape, dtype and device
// (or an undefined tensor to keep it).
// On a leaf it runs before accumulation; on a non-leaf when its gradient is computed. A tensor's
// hooks run in the order they were registered; `prepend` puts this one before those registered
// so far.
void register_hook(const Tensor& t, std::function<Tensor(const Tensor&)> hook,
                   bool prepend = false);
// Runs on a leaf after its .grad has been updated by a backward (FSDP starts its reduce-scatter
// from here).
void register_post_accumulate_grad_hook(const Tensor& leaf, std::function<void(Tensor&)> hook);
// Keeps the .grad of a non-leaf.
void retain_grad(const Tensor& t);

namespace autograd {
// PyTorch's torch.autograd.grad: the gradients of `outputs` (seeded as backward() seeds them)
// with respect to `inputs`, leaves or not, returned in their order instead of accumulated into
// any .grad: only the nodes between the outputs and the inputs run, so no leaf's .grad changes
// and no post-accumulate hook (FSDP's reduce-scatter) runs. The hooks a backward would run at an
// input (a leaf's, a non-leaf's, retain_grad's) run before its gradient is taken. Refused, before
// anything runs, for an input that does not require grad or that the outputs' graph does not
// reach, and after the run for one no node passed a gradient to; allow_unused returns an
// undefined tensor for those two instead. Saved tensors of the nodes run are freed unless
// retain_graph.
// No create_graph: the gradients record no history.
std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs = {}, bool retain_graph = false,
                         bool allow_unused = false);

// Runs `cb` once the backward pass currently executing has finished all its nodes; callbacks
// queued by callbacks also run. Outside a backward pass this is an error.
void queue_callback(std::function<void()> cb);
bool in_backward();
// A number that identifies the backward pass currently executing (0 outside one). A callback
// queued by a pass that threw never runs; comparing ids lets its owner notice.
uint64_t backward_id();
}  // namespace autograd

}  // namespace tessera
