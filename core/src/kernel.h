#pragma once
// Private to core: one dispatch-table row. A Kernel holds one implementation per device type
// and, when called, (1) finds the one device all its tensor arguments are on, (2) runs that
// device type's implementation, or (3) runs the CPU one on host copies when host fallback allows.
// The device checks live here once instead of in every kernel.
#include <array>
#include <atomic>
#include <exception>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/core/kernels/dispatch.h"
#include "tessera/core/kernels/linalg.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/core/kernels/vocab_parallel.h"
#include "tessera/core/tensor.h"

namespace tessera::kernels::registry {

inline constexpr size_t kNumDeviceTypes = 2;

// The device shared by every defined tensor argument; CPU when there is none.
class CommonDevice {
 public:
  explicit CommonDevice(const char* op) : op_(op) {}
  void add(const Tensor& t) {
    ++position_;
    if (!t.defined()) return;
    if (!first_.defined()) {
      first_ = t;
      first_position_ = position_;
      return;
    }
    TESSERA_CHECK(t.device() == first_.device(), op_, ": expects all tensors on one device, got ",
                  first_.str(), " (tensor argument ", first_position_, ") and ", t.str(),
                  " (tensor argument ", position_, ")");
  }
  void add(const std::vector<Tensor>& ts) {
    for (const Tensor& t : ts)
      add(t);
  }
  template <class T>
  void add(const T&) {}
  Device device() const { return first_.defined() ? first_.device() : Device::cpu(); }

 private:
  const char* op_;
  Tensor first_;
  int first_position_ = 0;
  int position_ = 0;
};

// Host fallback: a host tensor over a copy of the bytes `t` spans in its device storage, with
// t's strides, so a view needs no device kernel to reach the host.
Tensor host_mirror(const Tensor& t);
// Writes a mirror's bytes back over the span of the device tensor it mirrors.
void write_back(const Tensor& host, Tensor& device_tensor);
void count_host_fallback_call();
// One line on stderr: `op` has no implementation for `device` and runs on host copies.
void warn_host_fallback(const char* op, Device device);
HostFallback fallback_mode(DeviceType type);

template <class A>
auto host_arg(A& a) {
  using T = std::remove_const_t<A>;
  if constexpr (std::is_same_v<T, Tensor>) {
    return a.defined() ? host_mirror(a) : Tensor();
  } else if constexpr (std::is_same_v<T, std::vector<Tensor>>) {
    std::vector<Tensor> out;
    out.reserve(a.size());
    for (const Tensor& t : a)
      out.push_back(t.defined() ? host_mirror(t) : Tensor());
    return out;
  } else {
    return std::ref(a);
  }
}

inline void to_device(Tensor& t, Device d) {
  if (t.defined()) t = t.to(d);
}
inline void to_device(NormResult& r, Device d) {
  to_device(r.out, d);
  to_device(r.mean, d);
  to_device(r.rstd, d);
}
inline void to_device(NormGrads& r, Device d) {
  to_device(r.grad_x, d);
  to_device(r.grad_weight, d);
  to_device(r.grad_bias, d);
}
inline void to_device(AttentionResult& r, Device d) {
  to_device(r.out, d);
  to_device(r.lse, d);
}
inline void to_device(AttentionGrads& r, Device d) {
  to_device(r.dq, d);
  to_device(r.dk, d);
  to_device(r.dv, d);
}
inline void to_device(DropoutResult& r, Device d) {
  to_device(r.out, d);
  to_device(r.mask, d);
}
inline void to_device(MaxResult& r, Device d) {
  to_device(r.values, d);
  to_device(r.indices, d);
}

inline void to_device(VocabShardIds& r, Device d) {
  to_device(r.local, d);
  to_device(r.foreign, d);
}
inline void to_device(VocabCrossEntropy& r, Device d) {
  to_device(r.lse, d);
  to_device(r.loss, d);
}

template <class Sig>
class Kernel;

template <class R, class... A>
class Kernel<R(A...)> {
 public:
  using Fn = R (*)(A...);

  Kernel(const char* name, Fn cpu) : name_(name) { fns_[size_t(DeviceType::CPU)] = cpu; }
  const char* name() const { return name_; }
  // Registers a device type's implementation (a device backend does this once, at start-up).
  void set(DeviceType type, Fn fn) { fns_[size_t(type)].store(fn); }
  Fn get(DeviceType type) const { return fns_[size_t(type)].load(); }

  R operator()(A... args) const {
    // A tensor passed by non-const reference is written: its version goes up once the kernel has
    // returned, as PyTorch counts an in-place op (a call refused by its checks wrote nothing).
    if constexpr (!(std::is_same_v<A, Tensor&> || ...)) {
      return dispatch(args...);
    } else if constexpr (std::is_void_v<R>) {
      dispatch(args...);
      (bump_version_if_mutable<A>(args), ...);
    } else {
      R out = dispatch(args...);
      (bump_version_if_mutable<A>(args), ...);
      return out;
    }
  }

 private:
  R dispatch(A... args) const {
    CommonDevice common(name_);
    (common.add(args), ...);
    const Device device = common.device();
    if (device.is_cpu()) return fns_[0].load()(args...);
    const HostFallback mode = fallback_mode(device.type);
    Fn fn = fns_[size_t(device.type)].load();
    if (fn && mode != HostFallback::All) return fn(args...);
    TESSERA_CHECK(mode != HostFallback::Off, name_, ": this build has no ", device.str(),
                  " kernel for it; kernels::set_host_fallback(DeviceType::CUDA, "
                  "HostFallback::Missing) runs such kernels on host copies");
    // As PyTorch's MPS fallback, say once per kernel that a real device is computing on the host.
    if (mode == HostFallback::Missing && !warned_.exchange(true)) warn_host_fallback(name_, device);
    return on_host(device, std::index_sequence_for<A...>{}, args...);
  }

  template <size_t... I>
  R on_host(Device device, std::index_sequence<I...>, A... args) const {
    count_host_fallback_call();
    auto host = std::make_tuple(host_arg(args)...);
    if constexpr (std::is_void_v<R>) {
      std::apply(fns_[0].load(), host);
      (write_back_if_mutable<A>(std::get<I>(host), args), ...);
    } else {
      R out = std::apply(fns_[0].load(), host);
      (write_back_if_mutable<A>(std::get<I>(host), args), ...);
      to_device(out, device);
      return out;
    }
  }

  // A kernel that takes a tensor by non-const reference writes it: that is an in-place write
  // autograd must be able to see (StorageImpl::version).
  template <class P, class Arg>
  static void bump_version_if_mutable(Arg& arg) {
    if constexpr (std::is_same_v<P, Tensor&>) {
      if (arg.defined() && arg.storage().impl()) arg.storage().impl()->bump_version();
    }
  }

  template <class P, class H, class Arg>
  static void write_back_if_mutable(H& host, Arg& arg) {
    if constexpr (std::is_same_v<P, Tensor&>) {
      if (arg.defined()) write_back(host, arg);
    }
  }

  const char* name_;
  std::array<std::atomic<Fn>, kNumDeviceTypes> fns_{};
  mutable std::atomic<bool> warned_{false};
};

}  // namespace tessera::kernels::registry
