#include "tessera/autograd/node.h"

#include <atomic>

#include "tessera/autograd/grad_mode.h"
#include "tessera/core/kernels/elementwise.h"

namespace tessera::autograd {

namespace {
std::atomic<uint64_t> g_sequence{0};
}

Node::Node() : sequence_nr_(g_sequence.fetch_add(1)) {}

void Node::add_pre_hook(uint32_t output_nr, GradHook hook, bool prepend) {
  // A multimap keeps equal keys in insertion order; a hint at the first equal key inserts
  // before them.
  if (prepend)
    pre_hooks_.emplace_hint(pre_hooks_.lower_bound(output_nr), output_nr, std::move(hook));
  else
    pre_hooks_.emplace(output_nr, std::move(hook));
}

GradientReductionPtr Node::incoming_reduction(uint32_t output_nr) const {
  auto it = incoming_.find(output_nr);
  return it == incoming_.end() ? nullptr : it->second;
}

void Node::set_retain_hook(uint32_t output_nr, GradHook hook) {
  retain_hooks_[output_nr] = std::move(hook);
}

namespace {

// As PyTorch's: a hook may replace a gradient, not change what it is for (a gradient of another
// shape would reach a backward that computes with it, or broadcasts it, silently).
void check_hook_result(const Tensor& replaced, const Tensor& grad, const std::string& where) {
  TESSERA_CHECK(replaced.shape() == grad.shape() && replaced.dtype() == grad.dtype() &&
                    replaced.device() == grad.device(),
                "a gradient hook on ", where, " returned ", replaced.str(), " for the gradient ",
                grad.str(), ": it may replace the gradient, not change its shape, dtype or device");
}

// Whether `g` is the only reference to its tensor and the tensor to its storage, which it covers
// exactly and densely: nothing else can read or write those bytes, nor keep a larger buffer alive
// through them.
bool owns_whole_buffer(const Tensor& g) {
  return !grad_enabled() && g.use_count() == 1 && g.storage().use_count() == 1 &&
         g.is_contiguous() && g.storage_offset() == 0 && g.storage().nbytes() == g.nbytes();
}

}  // namespace

std::vector<Tensor> Node::run_pre_hooks(std::vector<Tensor>&& grads) {
  auto run = [this, &grads](uint32_t nr, GradHook& hook) {
    if (nr >= grads.size() || !grads[nr].defined()) return;
    Tensor replaced = hook(grads[nr]);
    if (!replaced.defined()) return;
    check_hook_result(replaced, grads[nr], "output " + std::to_string(nr) + " of " + name());
    grads[nr] = replaced;
  };
  if (pre_hooks_.empty() && retain_hooks_.empty()) return std::move(grads);
  // A hook may register hooks on this node (on the tensor it runs for): as the module hooks,
  // the pass runs the hooks there were when it started, so one that adds a hook each time it
  // runs still ends.
  auto pre_hooks = pre_hooks_;
  auto retain_hooks = retain_hooks_;
  for (auto& [nr, hook] : pre_hooks)
    run(nr, hook);
  for (auto& [nr, hook] : retain_hooks)
    run(nr, hook);
  return std::move(grads);
}

AccumulateGrad::AccumulateGrad(Tensor leaf) : leaf_(std::move(leaf)) {}

GradientMeta AccumulateGrad::gradient_meta(uint32_t output_nr) const {
  if (output_nr != 0) return {};
  return {&leaf_.shape(), leaf_.dtype(), leaf_.device()};
}

Tensor AccumulateGrad::run_leaf_hooks(Tensor g) {
  // A copy: a hook may register hooks on the leaf, which would move the list being walked; the
  // pass runs the hooks there were when it started.
  const auto grad_hooks = leaf_.autograd_meta().grad_hooks;
  for (const auto& hook : grad_hooks) {
    Tensor replaced = hook(g);
    if (!replaced.defined()) continue;
    check_hook_result(replaced, g, "a leaf " + leaf_.str());
    g = std::move(replaced);
  }
  return g;
}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>&& grad_outputs) {
  Tensor g = grad_outputs.empty() ? Tensor() : std::move(grad_outputs[0]);
  if (!g.defined()) return {};
  g = run_leaf_hooks(std::move(g));
  AutogradMeta& meta = leaf_.autograd_meta();
  TESSERA_CHECK(g.shape() == leaf_.shape(), "gradient of shape ", shape_str(g.shape()),
                " for a leaf of shape ", shape_str(leaf_.shape()));
  if (!meta.grad.defined()) {
    // As PyTorch's AccumulateGrad, the first gradient becomes .grad without a copy when nothing
    // else can see its buffer; otherwise (another slot, a hook, the caller of backward, a saved
    // tensor or a view shares it) .grad gets a private copy, so that accumulating into it in
    // place never writes anyone else's values.
    if (g.dtype() != leaf_.dtype())
      meta.grad = g.to(leaf_.dtype());
    else if (owns_whole_buffer(g))
      meta.grad = g.autograd_meta_if_exists() ? g.detach() : std::move(g);
    else
      meta.grad = g.clone();
  } else {
    kernels::add_(meta.grad, g);
  }
  const auto post_hooks = meta.post_accumulate_grad_hooks;
  for (const auto& hook : post_hooks)
    hook(leaf_);
  return {};
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined()) return {};
  AutogradMeta* m = t.autograd_meta_if_exists();
  if (!m) return {};
  if (m->grad_fn) return {m->grad_fn, m->output_nr};
  if (!m->requires_grad) return {};
  std::shared_ptr<Node> acc = m->grad_accumulator.lock();
  if (!acc) {
    // The accumulator refers to the leaf through a tensor sharing its impl, so .grad set by the
    // engine is the leaf's own.
    acc = std::make_shared<AccumulateGrad>(t);
    m->grad_accumulator = acc;
  }
  return {acc, 0};
}

}  // namespace tessera::autograd
