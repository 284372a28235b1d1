#pragma once
// A Tensor is a plain local array on one device: a view (shape, strides, offset, dtype) over a
// Storage. It knows nothing of other ranks; see dtensor/ for that.
//
// Methods here never record autograd history. The differentiable operations (including views
// such as tessera::view and tessera::transpose) are free functions in <tessera/autograd/ops.h>.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/device.h"
#include "tessera/core/dtype.h"
#include "tessera/core/error.h"
#include "tessera/core/shape.h"
#include "tessera/core/storage.h"

namespace tessera {

namespace detail {
// Grad mode's flag (autograd's grad_enabled() and its guards read and set it), kept in core so
// that in-place writes can tell whether they would bypass a graph being recorded.
extern thread_local bool t_grad_enabled;
}  // namespace detail

namespace autograd {
class Node;
}
struct AutogradMeta;

struct TensorImpl {
  Storage storage;
  Shape sizes;
  Shape strides;
  int64_t offset = 0;
  DType dtype = DType::Float32;
  std::shared_ptr<AutogradMeta> autograd;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}
  // A tensor over existing storage; checks that the view fits inside it.
  static Tensor make(Storage storage, Shape sizes, Shape strides, int64_t offset, DType dtype);

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  // How many Tensors share this one's impl (autograd takes a gradient nobody else holds as .grad
  // without a copy).
  long use_count() const { return impl_.use_count(); }

  const Shape& shape() const { return checked().sizes; }
  const Shape& sizes() const { return checked().sizes; }
  const Shape& strides() const { return checked().strides; }
  int64_t dim() const { return int64_t(checked().sizes.size()); }
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  int64_t numel() const { return shape_numel(checked().sizes); }
  int64_t storage_offset() const { return checked().offset; }
  DType dtype() const { return checked().dtype; }
  Device device() const { return checked().storage.device(); }
  size_t element_size() const { return tessera::element_size(dtype()); }
  size_t nbytes() const { return size_t(numel()) * element_size(); }
  const Storage& storage() const { return checked().storage; }
  bool is_contiguous() const;
  // How many in-place writes the storage has seen (PyTorch's `_version`; see StorageImpl).
  uint32_t version() const;

  // Pointer to the first element. data<T>() checks that T matches the dtype.
  void* raw_data() const;
  template <class T>
  T* data() const {
    TESSERA_CHECK(DTypeOf<T>::value == dtype(), "data<", dtype_name(DTypeOf<T>::value),
                  ">() on a tensor of dtype ", dtype_name(dtype()));
    return static_cast<T*>(raw_data());
  }
  // Values in logical (row-major) order, converted to T.
  template <class T>
  std::vector<T> to_vector() const;
  template <class T>
  T item() const;

  // --- views and copies, no autograd ---
  Tensor as_strided(Shape sizes, Shape strides, int64_t offset) const;
  // A tensor sharing storage with no autograd history.
  Tensor detach() const;
  Tensor contiguous() const;  // self when already contiguous
  Tensor clone() const;       // always a fresh contiguous copy
  Tensor to(DType dtype) const;
  Tensor to(Device device) const;
  // A copy in pinned host memory (pinned_allocator()), self when pinned already: device copies
  // from and to it run at full speed. An error for a device tensor or where nothing can pin.
  Tensor pin_memory() const;
  bool is_pinned() const;
  // Copies src (same shape, any dtype, any strides) into this tensor's elements. Like fill_,
  // refused on a tensor that requires grad while grad mode is on: no in-place operation is
  // recorded in the autograd graph, so the gradient would silently ignore the write (PyTorch
  // records it, or refuses it on a leaf); write under NoGradGuard or into a clone.
  Tensor& copy_(const Tensor& src);
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }

  // --- autograd state (the engine lives in autograd/) ---
  bool requires_grad() const;
  // Only leaves may be marked; returns *this for chaining.
  Tensor& set_requires_grad(bool requires_grad);
  bool is_leaf() const;
  // The accumulated gradient of a leaf (undefined until a backward reaches it).
  Tensor grad() const;
  void set_grad(const Tensor& grad);
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  uint32_t output_nr() const;
  AutogradMeta& autograd_meta();  // created on first use
  AutogradMeta* autograd_meta_if_exists() const;

  std::string str() const;  // "Tensor[2, 3] float32 cpu"

 private:
  const TensorImpl& checked() const;
  std::shared_ptr<TensorImpl> impl_;
};

// Autograd bookkeeping carried by a tensor. Defined here so that tensors can hold it; only the
// autograd layer interprets it.
struct AutogradMeta {
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<autograd::Node> grad_fn;  // null for leaves
  uint32_t output_nr = 0;
  std::weak_ptr<autograd::Node> grad_accumulator;  // leaves: the node that accumulates `grad`
  bool retains_grad = false;
  std::vector<std::function<Tensor(const Tensor&)>> grad_hooks;  // leaves
  std::vector<std::function<void(Tensor&)>> post_accumulate_grad_hooks;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// The dtype a binary op on `a` and `b` computes in (torch.result_type): promote_types of the two,
// except that a 0-dim operand raises it only when of a higher category (bool < integer <
// floating) than an operand with dims, so that `f32[3] * f64[]` stays float32 as in PyTorch.
DType result_type(const Tensor& a, const Tensor& b);

}  // namespace tessera
