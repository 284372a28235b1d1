// Dijkstra over placement lists. A state is a placement list valid for the tensor and mesh; an
// edge changes one mesh dim with a transition of the table, and is allowed only where the
// transitions' geometry holds: a shard being removed or added must be the innermost cut of its
// tensor dim (the last mesh dim in application order to cut it), since a step cuts or joins the
// piece that the other mesh dims leave (step_geometry). Partial appears only where the source or
// the target has it. A step costs the bytes it moves (Transition::bytes_moved) plus, when it
// communicates, kCollectiveBytes for the collective's fixed cost, so that a plan with more
// collectives wins only where it saves more than their latency; ties go to fewer steps.
#include "plan_search.h"

#include <map>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "tessera/dtensor/layout.h"

namespace tessera::redistribute_detail {

namespace {

using Cost = std::pair<int64_t, int64_t>;  // bytes plus collectives' fixed costs, steps

// What one collective's latency is worth in bytes: about 20 us at 3 GB/s between two cores.
constexpr int64_t kCollectiveBytes = 64 << 10;

int64_t step_cost(int64_t bytes) {
  return bytes > 0 ? bytes + kCollectiveBytes : 0;
}

// The application order of a placement list, or nothing when the list is not a valid layout.
std::optional<std::vector<int64_t>> order_of(const DTensorSpec& src, const Placements& p) {
  try {
    return shard_application_order(src.global_shape, src.mesh.shape(), p);
  } catch (const Error&) {
    return std::nullopt;
  }
}

// Whether mesh dim m is the last in `order` to cut tensor dim p[m].dim().
bool innermost(const Placements& p, const std::vector<int64_t>& order, int64_t m) {
  const int64_t d = p[size_t(m)].dim();
  int64_t last = -1;
  for (int64_t k : order)
    if (p[size_t(k)].is_shard(d)) last = k;
  return last == m;
}

const Transition* transition_for(const Placement& from, const Placement& to) {
  for (const Transition* t : transition_table())
    if (t->applies(from, to)) return t;
  return nullptr;
}

// What mesh dim m may hold along the way: Replicate, a plain shard of any tensor dim, and the
// source's and target's own placements there (Partial, StridedShard).
std::vector<Placement> choices(const DTensorSpec& src, const Placements& dst, size_t m) {
  std::vector<Placement> out = {Replicate()};
  for (int64_t d = 0; d < src.ndim(); ++d)
    out.push_back(Shard(d));
  for (const Placement& p : {src.placements[m], dst[m]}) {
    bool seen = false;
    for (const Placement& q : out)
      seen = seen || q == p;
    if (!seen) out.push_back(p);
  }
  return out;
}

struct Visit {
  Cost cost;
  Placements state;
  std::vector<RedistributeStep> steps;
  int64_t bytes = 0;
};

}  // namespace

std::optional<RedistributePlan> cheaper_plan(const DTensorSpec& src, const Placements& dst,
                                             const RedistributePlan& bound) {
  Cost limit = {0, int64_t(bound.steps.size())};
  for (const RedistributeStep& s : bound.steps)
    limit.first += step_cost(
        s.transition->bytes_moved(DTensorSpec(src.mesh, s.before, src.global_shape, src.dtype), s));
  const size_t nm = src.placements.size();
  std::vector<std::vector<Placement>> per_dim;
  for (size_t m = 0; m < nm; ++m)
    per_dim.push_back(choices(src, dst, m));
  auto later = [](const Visit& a, const Visit& b) { return a.cost > b.cost; };
  std::priority_queue<Visit, std::vector<Visit>, decltype(later)> queue(later);
  std::map<std::string, Cost> best;
  queue.push({{0, 0}, src.placements, {}, 0});
  best[placements_str(src.placements)] = {0, 0};
  while (!queue.empty()) {
    Visit v = queue.top();
    queue.pop();
    if (best[placements_str(v.state)] < v.cost) continue;
    if (v.state == dst) {
      if (!(v.cost < limit)) return std::nullopt;
      RedistributePlan plan;
      plan.steps = std::move(v.steps);
      plan.bytes_moved = v.bytes;
      return plan;
    }
    const auto order = order_of(src, v.state);
    const DTensorSpec before(src.mesh, v.state, src.global_shape, src.dtype);
    for (size_t m = 0; m < nm; ++m) {
      const Placement& from = v.state[m];
      if (from.is_shard() && !innermost(v.state, *order, int64_t(m))) continue;
      for (const Placement& to : per_dim[m]) {
        if (to == from) continue;
        // Partial only towards the target's own: a new Partial elsewhere would have to be
        // reduced again.
        if (to.is_partial() && !(to == dst[m])) continue;
        const Transition* t = transition_for(from, to);
        if (t == nullptr) continue;
        Placements next = v.state;
        next[m] = to;
        if (to.is_partial() && !partials_commute(next)) continue;
        const auto next_order = order_of(src, next);
        if (!next_order) continue;
        if (to.is_shard() && !innermost(next, *next_order, int64_t(m))) continue;
        RedistributeStep s;
        s.mesh_dim = int64_t(m);
        s.before = v.state;
        s.after = next;
        s.transition = t;
        const int64_t bytes = t->bytes_moved(before, s);
        const Cost cost = {v.cost.first + step_cost(bytes), v.cost.second + 1};
        if (!(cost < limit)) continue;
        const std::string key = placements_str(next);
        auto it = best.find(key);
        if (it != best.end() && !(cost < it->second)) continue;
        best[key] = cost;
        Visit w{cost, next, v.steps, v.bytes + bytes};
        w.steps.push_back(std::move(s));
        queue.push(std::move(w));
      }
    }
  }
  return std::nullopt;
}

}  // namespace tessera::redistribute_detail
