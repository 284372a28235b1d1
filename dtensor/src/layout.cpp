#include "tessera/dtensor/layout.h"

#include <algorithm>

#include "tessera/core/error.h"

namespace tessera {

Chunk chunk_of(int64_t n, int64_t parts, int64_t index) {
  int64_t each = (n + parts - 1) / parts;
  int64_t start = std::min(n, each * index);
  return {start, std::min(each, n - start)};
}

std::vector<int64_t> shard_application_order(const Shape& global_shape, const Shape& mesh_shape,
                                             const Placements& placements) {
  const int64_t ndim = int64_t(global_shape.size());
  TESSERA_CHECK(placements.size() == mesh_shape.size(), "placements ", placements_str(placements),
                " have ", placements.size(), " entries for a ", mesh_shape.size(), "-d mesh ",
                shape_str(mesh_shape));
  struct Deferred {
    int64_t mesh_dim;
    int64_t remaining;
  };
  std::vector<int64_t> order;
  std::vector<Deferred> deferred;
  for (int64_t m = 0; m < int64_t(placements.size()); ++m) {
    const Placement& p = placements[size_t(m)];
    if (!p.is_shard()) {
      order.push_back(m);
      continue;
    }
    TESSERA_CHECK(p.dim() >= 0 && p.dim() < ndim, "placement ", p.str(), " on mesh dim ", m,
                  " shards dim ", p.dim(), " of a tensor with shape ", shape_str(global_shape));
    if (p.is_strided_shard()) {
      TESSERA_CHECK(p.split_factor() >= 1, "placement ", p.str(), ": split factor must be >= 1");
      if (p.split_factor() > 1) {
        deferred.push_back({m, p.split_factor()});
        continue;
      }
    }
    order.push_back(m);
    // A plain shard of dim d completes (part of) the split that earlier strided shards of d are
    // nested in; once complete they take their place right after it, innermost last.
    for (auto it = deferred.begin(); it != deferred.end();) {
      const Placement& q = placements[size_t(it->mesh_dim)];
      if (q.dim() == p.dim()) {
        TESSERA_CHECK(it->remaining % mesh_shape[size_t(m)] == 0, "placement ", q.str(),
                      " on mesh dim ", it->mesh_dim, ": later mesh dims sharding dim ", q.dim(),
                      " do not multiply to split factor ", q.split_factor(), " (mesh ",
                      shape_str(mesh_shape), ", placements ", placements_str(placements), ")");
        it->remaining /= mesh_shape[size_t(m)];
        if (it->remaining == 1) {
          order.push_back(it->mesh_dim);
          it = deferred.erase(it);
          continue;
        }
      }
      ++it;
    }
  }
  TESSERA_CHECK(deferred.empty(), "placement ",
                deferred.empty() ? "" : placements[size_t(deferred[0].mesh_dim)].str(),
                " on mesh dim ", deferred.empty() ? 0 : deferred[0].mesh_dim,
                ": later mesh dims sharding its dim do not multiply to its split factor (mesh ",
                shape_str(mesh_shape), ", placements ", placements_str(placements), ")");
  return order;
}

LocalLayout compute_local_layout(const Shape& global_shape, const Shape& mesh_shape,
                                 const std::vector<int64_t>& coordinate,
                                 const Placements& placements) {
  TESSERA_CHECK(coordinate.size() == mesh_shape.size(), "mesh coordinate of ", coordinate.size(),
                " dims for a ", mesh_shape.size(), "-d mesh");
  LocalLayout out{global_shape, Shape(global_shape.size(), 0)};
  for (int64_t m : shard_application_order(global_shape, mesh_shape, placements)) {
    const Placement& p = placements[size_t(m)];
    if (!p.is_shard()) continue;
    const size_t d = size_t(p.dim());
    Chunk c = chunk_of(out.local_shape[d], mesh_shape[size_t(m)], coordinate[size_t(m)]);
    out.global_offset[d] += c.start;
    out.local_shape[d] = c.length;
  }
  return out;
}

}  // namespace tessera
