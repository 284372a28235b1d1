#pragma once
// Storage is refcounted bytes on one device; tensors are views over it (shape, strides,
// offset), so slicing and transposing never copy.
#include <cstddef>
#include <memory>

#include "tessera/core/device.h"

namespace tessera {

class Allocator;

class StorageImpl {
 public:
  StorageImpl(size_t nbytes, Device device);
  // From `allocator` instead of the device's (pinned host memory, say).
  StorageImpl(size_t nbytes, Device device, Allocator* allocator);
  ~StorageImpl();
  StorageImpl(const StorageImpl&) = delete;
  StorageImpl& operator=(const StorageImpl&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  Allocator* allocator() const { return allocator_; }
  // Frees the bytes while tensors keep referring to the storage (PyTorch's resize_(0) of an
  // untyped storage): FSDP frees gathered parameters that the autograd graph still holds, and
  // refills them before backward. Touching a released storage's data is an error.
  void release();
  // Allocates the bytes again (contents undefined) after release(); no-op when allocated.
  void reallocate();
  bool is_released() const { return data_ == nullptr && nbytes_ > 0; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  Allocator* allocator_ = nullptr;
};

class Storage {
 public:
  Storage() = default;
  Storage(size_t nbytes, Device device) : impl_(std::make_shared<StorageImpl>(nbytes, device)) {}
  Storage(size_t nbytes, Device device, Allocator* allocator)
      : impl_(std::make_shared<StorageImpl>(nbytes, device, allocator)) {}

  bool defined() const { return impl_ != nullptr; }
  void* data() const { return impl_ ? impl_->data() : nullptr; }
  size_t nbytes() const { return impl_ ? impl_->nbytes() : 0; }
  Device device() const { return impl_ ? impl_->device() : Device::cpu(); }
  long use_count() const { return impl_.use_count(); }
  StorageImpl* impl() const { return impl_.get(); }
  bool is_same(const Storage& o) const { return impl_ == o.impl_; }

 private:
  std::shared_ptr<StorageImpl> impl_;
};

}  // namespace tessera
