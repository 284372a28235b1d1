#include "registry.h"

#include <algorithm>
#include <mutex>
#include <unordered_set>

#include "fsdp_group.h"

namespace tessera::detail {

namespace {

struct LiveGroups {
  std::mutex mutex;
  // The raw pointer identifies the entry to remove once the weak one has expired.
  std::vector<std::pair<const FSDPGroup*, std::weak_ptr<FSDPGroup>>> entries;
};

// Never destroyed: the groups of a model in a static variable die after it would.
LiveGroups& registry() {
  static LiveGroups* r = new LiveGroups;
  return *r;
}

}  // namespace

void register_group(const std::shared_ptr<FSDPGroup>& group) {
  LiveGroups& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.entries.emplace_back(group.get(), group);
}

void unregister_group(const FSDPGroup* group) {
  LiveGroups& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::erase_if(r.entries, [&](const auto& e) { return e.first == group; });
}

std::vector<std::shared_ptr<FSDPGroup>> live_groups() {
  LiveGroups& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::shared_ptr<FSDPGroup>> out;
  for (const auto& e : r.entries)
    if (auto g = e.second.lock()) out.push_back(std::move(g));
  return out;
}

std::vector<std::shared_ptr<FSDPGroup>> groups_of(
    const std::vector<std::shared_ptr<FSDPGroup>>& groups, const Module& module) {
  std::vector<std::shared_ptr<FSDPGroup>> out;
  for (const auto& g : groups)
    if (g->module_.lock().get() == &module) out.push_back(g);
  return out;
}

std::vector<std::shared_ptr<FSDPGroup>> groups_inside(
    const std::vector<std::shared_ptr<FSDPGroup>>& groups, Module& module) {
  std::unordered_set<const Module*> inside;
  for (const auto& [name, m] : module.named_modules())
    if (m.get() != &module) inside.insert(m.get());
  std::vector<std::shared_ptr<FSDPGroup>> out;
  for (const auto& g : groups)
    if (inside.contains(g->module_.lock().get())) out.push_back(g);
  return out;
}

bool held_by(const std::vector<std::shared_ptr<FSDPGroup>>& groups, const Parameter& p) {
  if (!p.defined() || !p.is_dtensor()) return false;
  return std::any_of(groups.begin(), groups.end(), [&](const std::shared_ptr<FSDPGroup>& g) {
    return g->flat_.defined() && p.stored().storage().is_same(g->flat_.storage());
  });
}

namespace {

// Splits `pg` by `color` once per (pg, role); the cache holds only communicators still in use.
ProcessGroupPtr cached_split(const ProcessGroupPtr& pg, const std::string& role, int color) {
  struct Entry {
    std::weak_ptr<ProcessGroup> source, dup;
    std::string role;
  };
  static std::mutex mutex;
  static std::vector<Entry> cache;
  std::lock_guard<std::mutex> lock(mutex);
  std::erase_if(cache, [](const Entry& e) { return e.source.expired() || e.dup.expired(); });
  for (const Entry& e : cache)
    if (e.role == role && e.source.lock() == pg) return e.dup.lock();
  ProcessGroupPtr dup = pg->split(color, pg->rank(), pg->name() + "." + role);
  cache.push_back({pg, dup, role});
  return dup;
}

}  // namespace

ProcessGroupPtr dedicated_group(const ProcessGroupPtr& pg, const std::string& role) {
  return cached_split(pg, role, 0);
}

ProcessGroupPtr post_forward_group(const ProcessGroupPtr& pg, int64_t n) {
  return cached_split(pg, "fsdp_post_forward_" + std::to_string(n), int(pg->rank() / n));
}

}  // namespace tessera::detail
