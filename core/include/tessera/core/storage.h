#pragma once
// Storage is refcounted bytes on one device; tensors are views over it (shape, strides,
// offset), so slicing and transposing never copy.
#include <atomic>
#include <cstddef>
#include <cstdint>
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

  // The version counter (PyTorch's `_version`), one per storage so that every view of it shares
  // it: each kernel that writes a tensor in place (Tensor::copy_, fill_, the optimizer updates,
  // the random fills, kernels::add_, ...) increments it once it has run, and autograd compares it
  // with the value recorded when a tensor was saved for backward, so a value changed under a
  // saved graph is an error instead of a wrong gradient. Raw writes through data() do not count,
  // nor collectives that write their outputs directly (those that copy into them do). Only
  // changes are compared: what a fresh tensor starts at (a clone is filled by a copy) is not
  // PyTorch's number.
  uint32_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }
  // Sets the counter back after refilling the bytes with exactly what a saved graph read (FSDP's
  // re-gather into the storage it released after forward), as PyTorch's
  // _unsafe_preserve_version_counter does. Anything else that calls it hides a real change.
  void restore_version(uint32_t version) { version_.store(version, std::memory_order_relaxed); }

  // Increases with each storage made in this process: activation checkpointing tells what its
  // region made (serial at least next_serial() at the region's start) from what it read.
  uint64_t serial() const { return serial_; }
  static uint64_t next_serial();

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  Allocator* allocator_ = nullptr;
  std::atomic<uint32_t> version_{0};
  uint64_t serial_;
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
  // To recognise this storage later without keeping it alive.
  std::weak_ptr<StorageImpl> weak_impl() const { return impl_; }
  bool is_same(const Storage& o) const { return impl_ == o.impl_; }

 private:
  std::shared_ptr<StorageImpl> impl_;
};

}  // namespace tessera
