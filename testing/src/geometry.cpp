#include "tessera/testing/geometry.h"

#include <algorithm>

#include "tessera/core/error.h"
#include "tessera/core/kernels/views.h"

namespace tessera::testing {

IndexRange chunk_range(int64_t n, int64_t parts, int64_t index) {
  TESSERA_CHECK(parts > 0 && index >= 0 && index < parts, "chunk_range: piece ", index, " of ",
                parts);
  const int64_t piece = (n + parts - 1) / parts;
  const int64_t start = std::min(piece * index, n);
  return {start, std::min(piece, n - start)};
}

int64_t Window::numel() const {
  return shape_numel(shape);
}

std::vector<int64_t> Window::global_index(const std::vector<int64_t>& local_index) const {
  std::vector<int64_t> g(local_index);
  for (size_t d = 0; d < g.size() && d < offset.size(); ++d)
    g[d] += offset[d];
  return g;
}

std::string Window::str() const {
  std::string s = "[";
  for (size_t d = 0; d < shape.size(); ++d) {
    if (d) s += ", ";
    s += std::to_string(offset[d]) + ":" + std::to_string(offset[d] + shape[d]);
  }
  return s + "]";
}

namespace {

// The mesh dims that cut tensor dim `d`, in the order they apply: the plain shards left to right,
// then each StridedShard (it is nested inside those later shards of its dim).
std::vector<size_t> cuts_of_dim(int64_t d, const Shape& mesh_shape, const Placements& p,
                                int64_t ndim) {
  auto dim_of = [&](const Placement& q) { return q.dim() < 0 ? q.dim() + ndim : q.dim(); };
  std::vector<size_t> order;
  for (size_t m = 0; m < p.size(); ++m)
    if (p[m].kind() == Placement::Kind::Shard && dim_of(p[m]) == d) order.push_back(m);
  for (size_t m = 0; m < p.size(); ++m) {
    if (p[m].kind() != Placement::Kind::StridedShard || dim_of(p[m]) != d) continue;
    int64_t later = 1;
    for (size_t k = m + 1; k < p.size(); ++k)
      if (p[k].kind() == Placement::Kind::Shard && dim_of(p[k]) == d) later *= mesh_shape[k];
    TESSERA_CHECK(later == p[m].split_factor(), "reference_window: ", p[m].str(), " on mesh dim ",
                  m, " of ", placements_str(p), " must have split factor ", later,
                  " (the product of the later shards of tensor dim ", d, ")");
    order.push_back(m);
  }
  return order;
}

}  // namespace

Window reference_window(const Shape& global_shape, const Shape& mesh_shape,
                        const std::vector<int64_t>& coordinate, const Placements& placements) {
  const int64_t ndim = int64_t(global_shape.size());
  TESSERA_CHECK(placements.size() == mesh_shape.size() && coordinate.size() == mesh_shape.size(),
                "reference_window: mesh ", shape_str(mesh_shape), " with ", placements.size(),
                " placements ", placements_str(placements), " at coordinate ",
                coordinate_str(coordinate));
  for (size_t m = 0; m < placements.size(); ++m) {
    TESSERA_CHECK(coordinate[m] >= 0 && coordinate[m] < mesh_shape[m],
                  "reference_window: ", "coordinate ", coordinate_str(coordinate), " outside mesh ",
                  shape_str(mesh_shape));
    if (!placements[m].is_shard()) continue;
    const int64_t d = placements[m].dim();
    TESSERA_CHECK(d >= -ndim && d < ndim, "reference_window: ", placements[m].str(),
                  " on mesh dim ", m, " of a tensor of shape ", shape_str(global_shape));
  }
  Window w{Shape(global_shape.size(), 0), global_shape};
  for (int64_t d = 0; d < ndim; ++d)
    for (size_t m : cuts_of_dim(d, mesh_shape, placements, ndim)) {
      const IndexRange r = chunk_range(w.shape[size_t(d)], mesh_shape[m], coordinate[m]);
      w.offset[size_t(d)] += r.start;
      w.shape[size_t(d)] = r.length;
    }
  return w;
}

std::vector<int64_t> mesh_coordinate(int64_t index, const Shape& mesh_shape) {
  return unravel_index(index, mesh_shape);
}

std::vector<int64_t> unravel_index(int64_t flat, const Shape& shape) {
  std::vector<int64_t> c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    c[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  return c;
}

int64_t ravel_index(const std::vector<int64_t>& index, const Shape& shape) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d)
    flat = flat * shape[d] + index[d];
  return flat;
}

Tensor cut_window(const Tensor& global, const Window& window) {
  TESSERA_CHECK(size_t(global.dim()) == window.shape.size(), "cut_window: window ", window.str(),
                " of a tensor of shape ", shape_str(global.shape()));
  Tensor t = global;
  for (size_t d = 0; d < window.shape.size(); ++d) {
    TESSERA_CHECK(window.offset[d] + window.shape[d] <= global.size(int64_t(d)),
                  "cut_window: window ", window.str(), " outside shape ",
                  shape_str(global.shape()));
    t = kernels::narrow(t, int64_t(d), window.offset[d], window.shape[d]);
  }
  return t.clone();
}

std::string index_str(const std::vector<int64_t>& index) {
  std::string s = "[";
  for (size_t i = 0; i < index.size(); ++i)
    s.append(i ? ", " : "").append(std::to_string(index[i]));
  return s + "]";
}

std::string coordinate_str(const std::vector<int64_t>& coord) {
  std::string s = "(";
  for (size_t i = 0; i < coord.size(); ++i)
    s.append(i ? ", " : "").append(std::to_string(coord[i]));
  return s + ")";
}

}  // namespace tessera::testing
