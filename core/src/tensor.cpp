#include "tessera/core/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ostream>

#include "kernel_list.h"
#include "overlap.h"
#include "portable/element_checks.h"
#include "tessera/core/allocator.h"
#include "tessera/core/detail/cuda_copy.h"
#include "tessera/core/detail/strided_loop.h"
#include "tessera/core/factory.h"

namespace tessera {

Tensor Tensor::make(Storage storage, Shape sizes, Shape strides, int64_t offset, DType dtype) {
  TESSERA_CHECK(sizes.size() == strides.size(), "tensor view: ", sizes.size(), " sizes but ",
                strides.size(), " strides");
  TESSERA_CHECK(offset >= 0, "tensor view: negative storage offset ", offset);
  int64_t max_index = offset;
  bool empty = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TESSERA_CHECK(sizes[i] >= 0, "tensor view: negative size in ", shape_str(sizes));
    TESSERA_CHECK(strides[i] >= 0, "tensor view: negative stride in ", shape_str(strides));
    int64_t span = 0;
    if (sizes[i] == 0)
      empty = true;
    else
      TESSERA_CHECK(!__builtin_mul_overflow(sizes[i] - 1, strides[i], &span) &&
                        !__builtin_add_overflow(max_index, span, &max_index),
                    "tensor view ", shape_str(sizes), " strides ", shape_str(strides), " offset ",
                    offset, " reaches past any storage (the index overflows)");
  }
  if (!empty) {
    size_t need = 0;
    TESSERA_CHECK(
        !__builtin_mul_overflow(size_t(max_index) + 1, tessera::element_size(dtype), &need),
        "tensor view ", shape_str(sizes), " strides ", shape_str(strides), " offset ", offset,
        " reaches past any storage (the byte count overflows)");
    TESSERA_CHECK(need <= storage.nbytes(), "tensor view ", shape_str(sizes), " strides ",
                  shape_str(strides), " offset ", offset, " needs ", need,
                  " bytes but the storage has ", storage.nbytes());
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->sizes = std::move(sizes);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

const TensorImpl& Tensor::checked() const {
  TESSERA_CHECK(impl_ != nullptr, "operation on an undefined tensor");
  return *impl_;
}

// wrap_dim lets a 0-dim tensor take dim 0 or -1 (sum(x, 0) of a scalar is the scalar), but a
// scalar has no size to read.
int64_t Tensor::size(int64_t d) const {
  TESSERA_CHECK(dim() > 0, "size(", d, "): dimension specified as ", d, " but ", str(),
                " has no dimensions");
  return sizes()[wrap_dim(d, dim(), "size")];
}
int64_t Tensor::stride(int64_t d) const {
  TESSERA_CHECK(dim() > 0, "stride(", d, "): dimension specified as ", d, " but ", str(),
                " has no dimensions");
  return strides()[wrap_dim(d, dim(), "stride")];
}

bool Tensor::is_contiguous() const {
  const TensorImpl& t = checked();
  // PyTorch's rule: a tensor with no elements is contiguous whatever its strides (an empty
  // narrow of a transpose too), so that contiguous() copies nothing and checks accept it.
  if (std::find(t.sizes.begin(), t.sizes.end(), 0) != t.sizes.end()) return true;
  int64_t expected = 1;
  for (size_t i = t.sizes.size(); i-- > 0;) {
    if (t.sizes[i] == 1) continue;
    if (t.strides[i] != expected) return false;
    expected *= t.sizes[i];
  }
  return true;
}

uint32_t Tensor::version() const {
  const StorageImpl* s = checked().storage.impl();
  return s ? s->version() : 0;
}

void* Tensor::raw_data() const {
  const TensorImpl& t = checked();
  if (!t.storage.data()) {
    TESSERA_CHECK(t.storage.nbytes() == 0, "data of ", str(),
                  " whose storage was released (a resharded FSDP parameter used before it was "
                  "gathered again?)");
    return nullptr;
  }
  return static_cast<char*>(t.storage.data()) + t.offset * int64_t(tessera::element_size(t.dtype));
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  // A device tensor is copied to the host first, as PyTorch's tolist() and item() do.
  if (!device().is_cpu()) return to(Device::cpu()).to_vector<T>();
  Tensor c = dtype() == DTypeOf<T>::value ? contiguous() : to(DTypeOf<T>::value);
  const T* p = c.data<T>();
  return std::vector<T>(p, p + c.numel());
}

template <class T>
T Tensor::item() const {
  TESSERA_CHECK(numel() == 1, "item() on a tensor of shape ", shape_str(shape()),
                " (needs exactly one element)");
  return to_vector<T>()[0];
}

#define TESSERA_INSTANTIATE(T)                          \
  template std::vector<T> Tensor::to_vector<T>() const; \
  template T Tensor::item<T>() const;
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
TESSERA_INSTANTIATE(BFloat16)
TESSERA_INSTANTIATE(Float16)
TESSERA_INSTANTIATE(int64_t)
TESSERA_INSTANTIATE(int32_t)
TESSERA_INSTANTIATE(bool)
#undef TESSERA_INSTANTIATE

Tensor Tensor::as_strided(Shape sizes, Shape strides, int64_t offset) const {
  return make(storage(), std::move(sizes), std::move(strides), offset, dtype());
}

Tensor Tensor::detach() const {
  const TensorImpl& t = checked();
  return make(t.storage, t.sizes, t.strides, t.offset, t.dtype);
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), TensorOptions(dtype(), device()));
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(DType dt) const {
  if (dt == dtype()) return *this;
  Tensor out = empty(shape(), TensorOptions(dt, device()));
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(Device dev) const {
  if (dev == device()) return *this;
  Tensor out = empty(shape(), TensorOptions(dtype(), dev));
  out.copy_(*this);
  return out;
}

Tensor Tensor::pin_memory() const {
  TESSERA_CHECK(device().is_cpu(), "pin_memory: ", str(), " is not on the host");
  if (is_pinned()) return *this;
  Tensor out = empty(shape(), TensorOptions(dtype()).pin_memory());
  out.copy_(*this);
  return out;
}

bool Tensor::is_pinned() const {
  const Allocator* pinned = pinned_allocator();
  return pinned != nullptr && storage().impl() != nullptr &&
         storage().impl()->allocator() == pinned;
}

namespace {
// A write of no elements still counts, as in PyTorch: a rank whose shard of a parameter is empty
// then sees the same versions as the ranks that wrote theirs, so what FSDP decides from them is
// the same on every rank.
Tensor& count_empty_write(Tensor& t) {
  if (t.storage().impl()) t.storage().impl()->bump_version();
  return t;
}
}  // namespace

namespace detail {
thread_local bool t_grad_enabled = true;
}  // namespace detail

namespace {
void refuse_untracked_write(const Tensor& t, const char* op) {
  TESSERA_CHECK(!detail::t_grad_enabled || !t.requires_grad(), op, ": an in-place write to ",
                t.str(),
                ", which requires grad, while grad mode is on: in-place operations are not "
                "recorded in the autograd graph, so its gradient would ignore the write; write "
                "under NoGradGuard (as optimizers do) or into a clone()");
}
}  // namespace

Tensor& Tensor::copy_(const Tensor& src) {
  TESSERA_CHECK(src.shape() == shape(), "copy_: source shape ", shape_str(src.shape()),
                " does not match destination shape ", shape_str(shape()));
  refuse_untracked_write(*this, "copy_");
  if (numel() == 0) return count_empty_write(*this);
  kernels::portable::check_writable("copy_", *this);
  if (src.device() == device()) {
    if (detail::is_same_view(*this, src)) {
      storage().impl()->bump_version();  // t.copy_(t) writes what is there: no kernel needed
      return *this;
    }
    // A source the destination's writes could reach before they are read (x.copy_(x.t()),
    // x[1:].copy_(x[:-1])) is read from a copy.
    kernels::copy_(*this, detail::overlaps_partially(*this, src) ? src.clone() : src);
    return *this;
  }
  // Between devices bytes move as one block, so strides and dtype are settled on either side by
  // that device's own copy kernel.
  const Tensor packed = src.dtype() == dtype() ? src.contiguous() : src.to(dtype());
  if (is_contiguous()) {
    storage().impl()->bump_version();  // no kernel runs here to count the write
    detail::device_copy(raw_data(), device(), packed.raw_data(), packed.device(), nbytes());
    return *this;
  }
  Tensor staged = empty(shape(), TensorOptions(dtype(), device()));
  detail::device_copy(staged.raw_data(), device(), packed.raw_data(), packed.device(), nbytes());
  kernels::copy_(*this, staged);
  return *this;
}

Tensor& Tensor::fill_(double value) {
  // An integer dtype takes the value truncated, as PyTorch, but only when it holds it: the
  // conversion of NaN or of a value out of range is undefined (int64 filled with 2^63 got
  // INT64_MIN). Checked before the empty case so that every shard of a tensor agrees.
  if (dtype() == DType::Int64 || dtype() == DType::Int32) {
    const bool held = dtype() == DType::Int64
                          ? kernels::portable::holds_integer<int64_t>(std::trunc(value))
                          : kernels::portable::holds_integer<int32_t>(std::trunc(value));
    TESSERA_CHECK(held, "fill_: value ", value, " cannot be converted to ", dtype_name(dtype()),
                  " without overflow (", str(), ")");
  }
  kernels::portable::check_float_fill("fill_", dtype(), value);
  refuse_untracked_write(*this, "fill_");
  if (numel() == 0) return count_empty_write(*this);
  kernels::fill_(*this, value);
  return *this;
}

// --- autograd state ---

AutogradMeta& Tensor::autograd_meta() {
  TensorImpl& t = const_cast<TensorImpl&>(checked());
  if (!t.autograd) t.autograd = std::make_shared<AutogradMeta>();
  return *t.autograd;
}
AutogradMeta* Tensor::autograd_meta_if_exists() const {
  return checked().autograd.get();
}

bool Tensor::requires_grad() const {
  auto* m = autograd_meta_if_exists();
  return m && (m->requires_grad || m->grad_fn);
}

Tensor& Tensor::set_requires_grad(bool requires_grad) {
  AutogradMeta* m = autograd_meta_if_exists();
  TESSERA_CHECK(!(m && m->grad_fn), "set_requires_grad on a non-leaf tensor ", str(),
                ": only leaves can be marked; use detach() first");
  TESSERA_CHECK(!requires_grad || is_floating(dtype()), "set_requires_grad on a ",
                dtype_name(dtype()), " tensor: only floating-point tensors can require grad");
  autograd_meta().requires_grad = requires_grad;
  return *this;
}

bool Tensor::is_leaf() const {
  auto* m = autograd_meta_if_exists();
  return !m || !m->grad_fn;
}

Tensor Tensor::grad() const {
  auto* m = autograd_meta_if_exists();
  return m ? m->grad : Tensor();
}

void Tensor::set_grad(const Tensor& grad) {
  if (grad.defined()) {
    // As PyTorch's `x.grad = g`: backward accumulates into .grad, and optimizers update the
    // tensor from it, so it must be what backward would make, not only of the same shape.
    TESSERA_CHECK(grad.shape() == shape(), "set_grad: gradient shape ", shape_str(grad.shape()),
                  " does not match tensor shape ", shape_str(shape()));
    TESSERA_CHECK(grad.dtype() == dtype(), "set_grad: gradient ", grad.str(), " has dtype ",
                  dtype_name(grad.dtype()), " but the tensor ", str(), " has dtype ",
                  dtype_name(dtype()));
    TESSERA_CHECK(grad.device() == device(), "set_grad: gradient ", grad.str(), " is on ",
                  grad.device().str(), " but the tensor ", str(), " is on ", device().str());
  }
  autograd_meta().grad = grad;
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<autograd::Node> kNone;
  auto* m = autograd_meta_if_exists();
  return m ? m->grad_fn : kNone;
}

uint32_t Tensor::output_nr() const {
  auto* m = autograd_meta_if_exists();
  return m ? m->output_nr : 0;
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return "Tensor" + shape_str(shape()) + " " + dtype_name(dtype()) + " " + device().str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  os << t.str();
  if (t.defined() && t.device().is_cpu() && t.numel() <= 64) {
    os << " {";
    auto v = t.to_vector<double>();
    for (size_t i = 0; i < v.size(); ++i)
      os << (i ? ", " : "") << v[i];
    os << "}";
  }
  return os;
}

}  // namespace tessera
