// Full and sharded state dicts of a Module. Both check every key before writing anything, so a
// failed load leaves the model as it was.
#include <algorithm>
#include <map>
#include <mutex>
#include <set>

#include "tessera/autograd/grad_mode.h"
#include "tessera/comm/agree.h"
#include "tessera/comm/backend.h"
#include "tessera/comm/runtime.h"
#include "tessera/nn/module.h"

namespace tessera {

namespace {

// Lists every missing, unexpected and mis-shaped key of `state` (a map whose values have
// shape()) against the module's parameters and buffers, and throws when the load must not go on;
// else returns the missing and unexpected keys.
template <class Map>
IncompatibleKeys check_keys(const char* op, const std::string& module, const Map& state,
                            const std::vector<std::pair<std::string, Shape>>& expected,
                            bool strict) {
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> known;
  for (const auto& [name, shape] : expected) {
    known.insert(name);
    auto it = state.find(name);
    if (it == state.end()) {
      missing.push_back(name);
    } else if (it->second.shape() != shape) {
      mismatched.push_back(name + " (expected " + shape_str(shape) + ", got " +
                           shape_str(it->second.shape()) + ")");
    }
  }
  for (const auto& [name, t] : state)
    if (!known.count(name)) unexpected.push_back(name);
  const bool bad = !mismatched.empty() || (strict && (!missing.empty() || !unexpected.empty()));
  TESSERA_CHECK(!bad, op, " into ", module, ": ",
                missing.empty() ? "" : "missing keys: " + join(missing) + "; ",
                unexpected.empty() ? "" : "unexpected keys: " + join(unexpected) + "; ",
                mismatched.empty() ? "" : "mis-shaped keys: " + join(mismatched));
  std::sort(missing.begin(), missing.end());
  IncompatibleKeys keys;
  keys.missing_keys = std::move(missing);
  keys.unexpected_keys = std::move(unexpected);
  return keys;
}

std::vector<std::pair<std::string, Shape>> expected_shapes(
    const std::vector<std::pair<std::string, Parameter*>>& params,
    const std::vector<std::pair<std::string, Tensor*>>& buffers) {
  std::vector<std::pair<std::string, Shape>> out;
  for (const auto& [name, p] : params)
    out.emplace_back(name, p->global_shape());
  for (const auto& [name, b] : buffers)
    out.emplace_back(name, b->shape());
  return out;
}

// The world mesh of a device type that sharded_state_dict puts plain tensors on, the same one
// for every call: a mesh owns process groups (on NCCL a communicator each), so a new one per call
// would pile them up over a run that checkpoints often. Made on first use, which is collective:
// every rank meets the same device types in the same order in the same model, so every rank makes
// the same meshes in the same call. Dropped when the runtime finalizes, while MPI still runs.
DeviceMesh world_mesh(DeviceType type) {
  static std::mutex mutex;
  static std::map<DeviceType, DeviceMesh> meshes;
  static bool clear_at_finalize = false;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = meshes.find(type);
  if (it != meshes.end()) return it->second;
  if (!clear_at_finalize) {
    detail::at_finalize([] {
      std::lock_guard<std::mutex> l(mutex);
      meshes.clear();
    });
    clear_at_finalize = true;
  }
  return meshes.emplace(type, DeviceMesh(type, Shape{world_size()}, {"world"})).first->second;
}

}  // namespace

std::string IncompatibleKeys::str() const {
  // A model of another size mismatches every key: the first few say it.
  constexpr size_t kShown = 8;
  auto first_few = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < kShown; ++i)
      s += (s.empty() ? "" : ", ") + v[i];
    if (v.size() > kShown) s += ", and " + std::to_string(v.size() - kShown) + " more";
    return s;
  };
  std::string s;
  auto add = [&](const char* what, const std::vector<std::string>& v) {
    if (v.empty()) return;
    s += (s.empty() ? "" : "; ") + std::string(what) + ": " + first_few(v);
  };
  add("missing keys", missing_keys);
  add("unexpected keys", unexpected_keys);
  add("mis-shaped keys", mismatched_keys);
  return s.empty() ? "no incompatible keys" : s;
}

// State dicts walk every name (remove_duplicate = false), as PyTorch's do: a tied tensor is
// saved under each of its names and loaded from each (the same value, written once per name).
std::map<std::string, Tensor> Module::state_dict() {
  std::map<std::string, Tensor> out;
  for (auto& [name, p] : named_parameters(true, /*remove_duplicate=*/false))
    out[name] = p->full();
  for (auto& [name, b] : named_buffers(true, /*remove_duplicate=*/false))
    out[name] = b->detach();
  return out;
}

IncompatibleKeys Module::load_state_dict(const std::map<std::string, Tensor>& state, bool strict) {
  // A load is not an op to differentiate (as PyTorch's, under no_grad): a buffer that requires
  // grad would otherwise refuse its write after the parameters were written.
  NoGradGuard no_grad;
  auto params = named_parameters(true, /*remove_duplicate=*/false);
  auto buffers = named_buffers(true, /*remove_duplicate=*/false);
  IncompatibleKeys keys =
      check_keys("load_state_dict", type_name_, state, expected_shapes(params, buffers), strict);
  for (auto& [name, p] : params) {
    auto it = state.find(name);
    if (it != state.end()) p->copy_from_full(it->second.to(p->dtype()));
  }
  for (auto& [name, b] : buffers) {
    auto it = state.find(name);
    if (it != state.end()) b->copy_(it->second);
  }
  return keys;
}

std::map<std::string, DTensor> Module::sharded_state_dict() {
  NoGradGuard no_grad;
  std::map<std::string, DTensor> out;
  auto params = named_parameters(true, /*remove_duplicate=*/false);
  auto buffers = named_buffers(true, /*remove_duplicate=*/false);
  // One world mesh per device type the plain tensors live on: PyTorch's state_dict keeps each
  // tensor on its device, and a mesh of another device type would make from_local copy a device
  // tensor to the host (and the entry stop sharing the parameter's storage). Only where that
  // device type has no communication backend (a CUDA build without NCCL, none registered) do its
  // tensors come as host copies on the CPU's mesh.
  auto replicated = [&](const Tensor& t) {
    DeviceType type = t.device().type;
    if (type != DeviceType::CPU && backend_name(type).empty() &&
        (type != DeviceType::CUDA || !nccl_unavailable().empty()))
      type = DeviceType::CPU;
    return DTensor::from_local(t.detach(), world_mesh(type), {Replicate()}, t.shape());
  };
  for (auto& [name, p] : params)
    out[name] = p->is_dtensor() ? p->stored_dtensor().detach() : replicated(p->stored());
  for (auto& [name, b] : buffers)
    out[name] = replicated(*b);
  return out;
}

IncompatibleKeys Module::load_sharded_state_dict(const std::map<std::string, DTensor>& state,
                                                 bool strict) {
  NoGradGuard no_grad;
  auto params = named_parameters(true, /*remove_duplicate=*/false);
  auto buffers = named_buffers(true, /*remove_duplicate=*/false);
  // The load is collective: a dict that fails its check on some ranks only (ranks passing
  // different dicts) must stop every rank, not leave the others in the collectives below.
  IncompatibleKeys keys;
  run_agreed(world_group(), "load_sharded_state_dict into " + type_name_, [&] {
    keys = check_keys("load_sharded_state_dict", type_name_, state,
                      expected_shapes(params, buffers), strict);
  });
  for (auto& [name, p] : params) {
    auto it = state.find(name);
    if (it == state.end()) continue;
    const DTensor& src = it->second;
    if (p->is_dtensor() && src.mesh() == p->stored_dtensor().mesh()) {
      const Tensor local = src.redistribute(p->stored_dtensor().placements()).to_local();
      p->stored().detach().copy_(local.to(p->dtype()));
    } else {
      p->copy_from_full(src.full_tensor().to(p->dtype()));
    }
  }
  for (auto& [name, b] : buffers) {
    auto it = state.find(name);
    if (it != state.end()) b->copy_(it->second.full_tensor());
  }
  return keys;
}

}  // namespace tessera
