#include "tessera/autograd/function.h"

#include <algorithm>
#include <typeinfo>

#include "checkpoint_frame.h"
#include "tessera/core/factory.h"

namespace tessera::autograd {

std::string Function::name() const {
  return detail::node_name(typeid(*this).name());
}

std::vector<Tensor> Function::run(const std::vector<Tensor>& inputs) {
  bool record = false;
  needs_input_grad_.assign(inputs.size(), false);
  if (grad_enabled()) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      needs_input_grad_[i] = inputs[i].defined() && inputs[i].requires_grad();
      record = record || needs_input_grad_[i];
    }
  }
  std::vector<Tensor> outputs;
  auto* frame = detail::CheckpointFrame::packing();
  if (frame) frame->saw_inputs(inputs, typeid(*this).name());
  {
    NoGradGuard no_grad;
    outputs = forward(inputs);
  }
  if (!record) {
    release_frame();
    saved_.clear();
    return outputs;
  }
  std::vector<Edge> edges(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    if (needs_input_grad_[i]) edges[i] = gradient_edge(inputs[i]);
  set_next_edges(std::move(edges));
  set_num_outputs(uint32_t(outputs.size()));
  output_meta_.clear();
  std::shared_ptr<Node> self = shared_from_this();
  for (size_t i = 0; i < outputs.size(); ++i) {
    Tensor& out = outputs[i];
    if (!out.defined()) {
      output_meta_.push_back({});
      continue;
    }
    output_meta_.push_back({out.shape(), out.dtype(), out.device()});
    if (!is_floating(out.dtype())) continue;
    // A fresh impl, so that a tensor saved inside forward() never points back at this node
    // (no reference cycle) and an input returned unchanged keeps its own history.
    out = out.detach();
    AutogradMeta& meta = out.autograd_meta();
    meta.grad_fn = self;
    meta.output_nr = uint32_t(i);
  }
  return outputs;
}

std::vector<Tensor> Function::apply(std::vector<Tensor>&& grad_outputs) {
  grad_outputs.resize(output_meta_.size());
  // No gradient reached any output (a custom backward returned none for the tensor this node
  // made): no gradient flows on, as from PyTorch's nodes, so a leaf reached only through here
  // keeps an undefined .grad rather than zeros.
  if (std::none_of(grad_outputs.begin(), grad_outputs.end(),
                   [](const Tensor& g) { return g.defined(); }))
    return std::vector<Tensor>(needs_input_grad_.size());
  if (materialize_grads_) {
    for (size_t i = 0; i < grad_outputs.size(); ++i) {
      if (grad_outputs[i].defined()) continue;
      const OutputMeta& m = output_meta_[i];
      grad_outputs[i] = zeros(m.shape, TensorOptions(m.dtype, m.device));
    }
  }
  // A checkpointed node's recomputed tensors are its only while it runs (the frame hands each
  // out once): a retained graph must not hold the region's activations between backwards.
  struct DropRecomputed {
    Function& fn;
    ~DropRecomputed() {
      if (fn.frame_) std::fill(fn.saved_.begin(), fn.saved_.end(), Tensor());
    }
  } drop{*this};
  std::vector<Tensor> grads = backward(grad_outputs);
  TESSERA_CHECK(grads.size() == needs_input_grad_.size(), name(), "::backward returned ",
                grads.size(), " gradients for ", needs_input_grad_.size(), " inputs");
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!needs_input_grad_[i]) {
      grads[i] = Tensor();
      continue;
    }
    if (!grads[i].defined()) continue;
    // As PyTorch's engine validates each node's outputs against what the next node takes: a
    // gradient of another shape reached the next node silently; one of another dtype is cast.
    const Edge& e = next_edges()[i];
    const GradientMeta want = e.function ? e.function->gradient_meta(e.input_nr) : GradientMeta{};
    if (!want.known()) continue;
    TESSERA_CHECK(grads[i].shape() == *want.shape, name(),
                  " returned an invalid gradient at index ", i, " - got ",
                  shape_str(grads[i].shape()), " but expected shape ", shape_str(*want.shape));
    TESSERA_CHECK(grads[i].device() == want.device, name(),
                  " returned an invalid gradient at index ", i, " - expected device ",
                  want.device.str(), " but got ", grads[i].device().str());
    if (grads[i].dtype() != want.dtype) grads[i] = grads[i].to(want.dtype);
  }
  return grads;
}

GradientMeta Function::gradient_meta(uint32_t output_nr) const {
  if (output_nr >= output_meta_.size()) return {};
  const OutputMeta& m = output_meta_[output_nr];
  return {&m.shape, m.dtype, m.device};
}

void Function::save_for_backward(std::vector<Tensor> tensors) {
  if (auto* frame = detail::CheckpointFrame::packing()) {
    frame_ = frame->shared_from_this();
    frame_ids_.clear();
    for (const Tensor& t : tensors)
      frame_ids_.push_back(t.defined() ? frame->pack(t, typeid(*this).name()) : kNotSaved);
    saved_.assign(tensors.size(), Tensor());
    saved_versions_.clear();
    return;
  }
  if (auto* frame = detail::CheckpointFrame::keeping()) {
    // A node of the recomputation's graph, which never runs backward: the frame keeps them.
    for (const Tensor& t : tensors)
      if (t.defined()) frame->keep(t);
    saved_.clear();
    saved_versions_.clear();
    return;
  }
  saved_ = std::move(tensors);
  saved_versions_.clear();
  for (const Tensor& t : saved_)
    saved_versions_.push_back(t.defined() ? t.version() : 0);
}

const std::vector<Tensor>& Function::saved_tensors() const {
  TESSERA_CHECK(!saved_released_, name(),
                ": saved tensors were already freed by a previous backward; pass "
                "retain_graph=true to backward through the graph twice");
  if (frame_) {
    // The frame checks each tensor against the forward, and against writes since it was
    // recomputed; within one apply() they are taken once.
    for (size_t i = 0; i < saved_.size(); ++i)
      if (frame_ids_[i] != kNotSaved && !saved_[i].defined())
        saved_[i] = frame_->unpack(frame_ids_[i], typeid(*this).name());
    return saved_;
  }
  for (size_t i = 0; i < saved_.size(); ++i) {
    if (!saved_[i].defined() || saved_[i].version() == saved_versions_[i]) continue;
    TESSERA_FAIL(name(),
                 ": one of the tensors needed for gradient computation has been modified "
                 "by an in-place operation: saved tensor ",
                 i, " (", saved_[i].str(), ") is at version ", saved_[i].version(),
                 "; expected version ", saved_versions_[i],
                 " instead. Something wrote it in place between forward and "
                 "backward (copy_, fill_, zero_, an optimizer step, kernels::add_ ...); write "
                 "into a clone() instead, or do the write after backward");
  }
  return saved_;
}

void Function::release_frame() {
  if (!frame_) return;
  for (size_t id : frame_ids_)
    if (id != kNotSaved) frame_->release(id);
  frame_.reset();
  frame_ids_.clear();
}

void Function::release_saved_tensors() {
  release_frame();
  saved_.clear();
  saved_.shrink_to_fit();
  saved_released_ = true;
}

bool Function::needs_input_grad(size_t i) const {
  return i < needs_input_grad_.size() && needs_input_grad_[i];
}

}  // namespace tessera::autograd
