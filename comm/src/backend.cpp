#include "tessera/comm/backend.h"

#include <map>
#include <mutex>

#include "checked_process_group.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"

namespace tessera {

namespace {

const char* type_name(DeviceType type) {
  return type == DeviceType::CPU ? "cpu" : "cuda";
}

struct Backend {
  std::string name;
  BackendFactory make_world;
  ProcessGroupPtr world;  // made on first use
};

struct Registry {
  std::mutex mutex;
  std::map<DeviceType, Backend> backends;
};
Registry& registry() {
  // Never destroyed, like the runtime's state: groups may be dropped during static destruction.
  static Registry* r = new Registry;
  return *r;
}

}  // namespace

namespace detail {
// finalize(): drops the world groups made by backends, before MPI ends.
void drop_backend_worlds() {
  Registry& r = registry();
  std::lock_guard<std::mutex> guard(r.mutex);
  for (auto& [type, b] : r.backends)
    b.world.reset();
}
}  // namespace detail

void register_backend(DeviceType type, const std::string& name, BackendFactory make_world) {
  TESSERA_CHECK(type != DeviceType::CPU, "register_backend('", name,
                "'): the CPU's backend is MPI; register backends for other device types");
  TESSERA_CHECK(!name.empty() && make_world, "register_backend: a backend for ", type_name(type),
                " needs a name and a factory");
  Registry& r = registry();
  std::lock_guard<std::mutex> guard(r.mutex);
  auto it = r.backends.find(type);
  TESSERA_CHECK(it == r.backends.end() || !it->second.world, "register_backend('", name, "'): the ",
                type_name(type), " backend '", it->second.name,
                "' is already in use (its world group exists)");
  r.backends[type] = Backend{name, std::move(make_world), nullptr};
}

std::string backend_name(DeviceType type) {
  if (type == DeviceType::CPU) return "mpi";
  Registry& r = registry();
  std::lock_guard<std::mutex> guard(r.mutex);
  auto it = r.backends.find(type);
  return it == r.backends.end() ? "" : it->second.name;
}

ProcessGroupPtr world_group(DeviceType type) {
  if (type == DeviceType::CPU) return world_group();
  Registry& r = registry();
  BackendFactory make;
  {
    std::lock_guard<std::mutex> guard(r.mutex);
    auto it = r.backends.find(type);
    if (it == r.backends.end() && type == DeviceType::CUDA) {
      const std::string why = nccl_unavailable();
      TESSERA_CHECK(why.empty(), "world_group(cuda): no communication backend for cuda tensors ",
                    "is registered and NCCL is not usable (", why,
                    "); register one, e.g. register_backend(DeviceType::CUDA, \"mpi\", ",
                    "host_staged_backend()), which carries them through host memory");
      it = r.backends.emplace(type, Backend{"nccl", nccl_backend(), nullptr}).first;
    }
    TESSERA_CHECK(it != r.backends.end(), "world_group(", type_name(type),
                  "): no communication backend for ", type_name(type), " tensors is registered");
    if (it->second.world) return it->second.world;
    make = it->second.make_world;
  }
  // Outside the lock: the factory communicates.
  ProcessGroupPtr raw = make();
  TESSERA_CHECK(raw && raw->size() == world_size() && raw->rank() == world_rank(), "world_group(",
                type_name(type), "): the backend's world group must hold every world rank (",
                world_size(), ") in world-rank order");
  ProcessGroupPtr world = detail::CheckedProcessGroup::wrap(raw, detail::debug_world_group());
  std::lock_guard<std::mutex> guard(r.mutex);
  Backend& b = r.backends.at(type);
  if (!b.world) b.world = std::move(world);
  return b.world;
}

}  // namespace tessera
