// Plans a redistribution as per-mesh-dim steps:
//  1. reduce Partials that end up Replicate (or another op) while pieces are smallest;
//  2. undo shards, innermost first, until what stays sharded is a prefix of the target's nesting
//     (an S(a) -> S(b) that lands where the target wants it is one all-to-all);
//  3. add the target's shards in its application order (R -> S free, P -> S reduce-scatter);
//  4. settle the remaining Replicate/Partial differences.
#include <list>
#include <mutex>
#include <unordered_map>

#include "plan_search.h"
#include "tessera/dtensor/redistribute.h"
#include "transitions.h"

namespace tessera {

namespace {

// Plans already made, the most recently used first. The key holds the global shape, so a program
// whose shapes keep changing (sequence lengths, batch remainders) would add entries forever:
// past kCapacity the least recently used plan goes, and is made again if it comes back.
class PlanCache {
 public:
  static constexpr size_t kCapacity = 4096;
  using PlanPtr = std::shared_ptr<const RedistributePlan>;

  PlanPtr find(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return it->second->second;
  }

  // Another thread may have added the same key meanwhile; the plan first stored wins.
  PlanPtr add(const std::string& key, PlanPtr plan) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it != index_.end()) return it->second->second;
    order_.emplace_front(key, std::move(plan));
    index_.emplace(key, order_.begin());
    if (order_.size() > kCapacity) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
    return order_.front().second;
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return order_.size();
  }

  // Plans handed out before stay valid: callers hold them by shared_ptr.
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    index_.clear();
    order_.clear();
  }

 private:
  std::mutex mu_;
  std::list<std::pair<std::string, PlanPtr>> order_;
  std::unordered_map<std::string, std::list<std::pair<std::string, PlanPtr>>::iterator> index_;
};

PlanCache& plan_cache() {
  static PlanCache cache;
  return cache;
}

const Transition* find_transition(const Placement& from, const Placement& to) {
  for (const Transition* t : transition_table())
    if (t->applies(from, to)) return t;
  TESSERA_FAIL("redistribute: no transition from ", from.str(), " to ", to.str());
}

// (mesh dim, placement) of the mesh dims sharding tensor dim d, in application order.
std::vector<std::pair<int64_t, Placement>> nesting(const DTensorSpec& spec, const Placements& p,
                                                   int64_t d) {
  std::vector<std::pair<int64_t, Placement>> out;
  for (int64_t m : shard_application_order(spec.global_shape, spec.mesh.shape(), p))
    if (p[size_t(m)].is_shard(d)) out.emplace_back(m, p[size_t(m)]);
  return out;
}

bool is_prefix_for_dim(const DTensorSpec& spec, const Placements& cur, const Placements& dst,
                       int64_t d) {
  auto c = nesting(spec, cur, d), t = nesting(spec, dst, d);
  if (c.size() > t.size()) return false;
  for (size_t i = 0; i < c.size(); ++i)
    if (c[i] != t[i]) return false;
  return true;
}

bool valid(const DTensorSpec& spec, const Placements& p) {
  try {
    shard_application_order(spec.global_shape, spec.mesh.shape(), p);
    return true;
  } catch (const Error&) {
    return false;
  }
}

class Planner {
 public:
  Planner(const DTensorSpec& src, const Placements& dst)
      : src_(src), cur_(src.placements), dst_(dst) {}

  RedistributePlan run() {
    const int64_t nm = src_.mesh.ndim();
    for (int64_t m = 0; m < nm; ++m) {
      const Placement &c = cur_[size_t(m)], &t = dst_[size_t(m)];
      if (c.is_partial() && !(c == t) && !t.is_shard()) step(m, Replicate());
    }
    for (int64_t d = 0; d < src_.ndim(); ++d) {
      while (!is_prefix_for_dim(src_, cur_, dst_, d)) {
        int64_t m = nesting(src_, cur_, d).back().first;
        const Placement& t = dst_[size_t(m)];
        Placements swapped = cur_;
        swapped[size_t(m)] = t;
        // One all-to-all only when mesh dim m ends up the innermost cut of the target dim;
        // otherwise the pieces it would need sit on ranks of other coordinates.
        bool all_to_all = cur_[size_t(m)].kind() == Placement::Kind::Shard &&
                          t.kind() == Placement::Kind::Shard && t.dim() != d &&
                          valid(src_, swapped) && is_prefix_for_dim(src_, swapped, dst_, t.dim()) &&
                          nesting(src_, swapped, t.dim()).back().first == m;
        step(m, all_to_all ? t : Replicate());
      }
    }
    for (int64_t m : shard_application_order(src_.global_shape, src_.mesh.shape(), dst_))
      if (dst_[size_t(m)].is_shard() && !(cur_[size_t(m)] == dst_[size_t(m)]))
        step(m, dst_[size_t(m)]);
    for (int64_t m = 0; m < nm; ++m) {
      if (cur_[size_t(m)] == dst_[size_t(m)]) continue;
      if (cur_[size_t(m)].is_partial() && dst_[size_t(m)].is_partial()) step(m, Replicate());
      step(m, dst_[size_t(m)]);
    }
    return std::move(plan_);
  }

 private:
  void step(int64_t m, const Placement& to) {
    RedistributeStep s;
    s.mesh_dim = m;
    s.before = cur_;
    s.after = cur_;
    s.after[size_t(m)] = to;
    s.transition = find_transition(cur_[size_t(m)], to);
    DTensorSpec before(src_.mesh, cur_, src_.global_shape, src_.dtype);
    plan_.bytes_moved += s.transition->bytes_moved(before, s);
    cur_ = s.after;
    plan_.steps.push_back(std::move(s));
  }

  const DTensorSpec& src_;
  Placements cur_;
  const Placements& dst_;
  RedistributePlan plan_;
};

}  // namespace

std::string RedistributeStep::str() const {
  return "mesh dim " + std::to_string(mesh_dim) + ": " + before[size_t(mesh_dim)].str() + " -> " +
         after[size_t(mesh_dim)].str() + " (" + (transition ? transition->name() : "?") + ")";
}

std::string RedistributePlan::str() const {
  std::string s;
  for (const auto& st : steps)
    s += (s.empty() ? "" : "; ") + st.str();
  return s.empty() ? "(no steps)" : s;
}

std::shared_ptr<const RedistributePlan> plan_redistribute(const DTensorSpec& src,
                                                          const Placements& dst_in) {
  DTensorSpec dst(src.mesh, dst_in, src.global_shape, src.dtype);  // validates, normalizes
  // Plans depend on the mesh shape, not on which ranks form it, nor on this rank's coordinate:
  // the key is shapes, dtype (the search weighs bytes) and placements. A plan must be a function
  // of its key alone, so that ranks whose caches hold different entries still agree on it.
  std::string key = shape_str(src.mesh.shape()) + shape_str(src.global_shape) +
                    dtype_name(src.dtype) + placements_str(src.placements) + "->" +
                    placements_str(dst.placements);
  if (auto plan = plan_cache().find(key)) return plan;
  // The ordered plan is the policy; a search replaces it only by a plan that moves fewer bytes
  // (or as many in fewer steps).
  RedistributePlan plan = Planner(src, dst.placements).run();
  if (auto cheaper = redistribute_detail::cheaper_plan(src, dst.placements, plan))
    plan = std::move(*cheaper);
  return plan_cache().add(key, std::make_shared<const RedistributePlan>(std::move(plan)));
}

size_t redistribute_plan_cache_size() {
  return plan_cache().size();
}

void clear_redistribute_plan_cache() {
  plan_cache().clear();
}

namespace redistribute_detail {

Tensor run_plan(const RedistributePlan& plan, const DTensorSpec& src, const Tensor& local) {
  Tensor cur = local;
  for (const RedistributeStep& s : plan.steps) {
    if (src.mesh.size(s.mesh_dim) == 1) continue;
    const DTensorSpec before(src.mesh, s.before, src.global_shape, src.dtype);
    cur = s.transition->apply(cur, before, s);
  }
  // Every transition writes a tensor of its own; so must a plan whose steps were all skipped,
  // or an in-place write to a full_tensor() would reach the DTensor on one rank and not on many.
  if (!plan.steps.empty() && cur.storage().is_same(local.storage())) cur = cur.clone();
  return cur;
}

Tensor run_plan_backward(const RedistributePlan& plan, const DTensorSpec& src, const Tensor& grad) {
  Tensor cur = grad;
  for (auto it = plan.steps.rbegin(); it != plan.steps.rend(); ++it) {
    if (src.mesh.size(it->mesh_dim) == 1) continue;
    const DTensorSpec before(src.mesh, it->before, src.global_shape, src.dtype);
    cur = it->transition->backward(cur, before, *it);
  }
  return cur;
}

}  // namespace redistribute_detail

Tensor redistribute_local(const Tensor& local, const DTensorSpec& src, const Placements& dst) {
  // The transitions cut pieces by the layout's geometry: a piece of another shape would lose or
  // invent elements on some routes instead of failing.
  const Shape expected = src.local_layout().local_shape;
  TESSERA_CHECK(local.shape() == expected, "redistribute_local to ", placements_str(dst),
                ": the local piece is ", shape_str(local.shape()), " but ",
                placements_str(src.placements), " of global shape ", shape_str(src.global_shape),
                " on ", src.mesh.str(), " give mesh coordinate ", shape_str(src.mesh.coordinate()),
                " a piece of ", shape_str(expected));
  return redistribute_detail::run_plan(*plan_redistribute(src, dst), src, local);
}

}  // namespace tessera
