#include <algorithm>
#include <sstream>

#include "tessera/dtensor/dtensor.h"

namespace tessera {

std::string visualize_sharding(const DTensor& dt) {
  const DTensorSpec& s = dt.spec();
  const DeviceMesh& mesh = s.mesh;
  struct Row {
    std::string coord, rank, block, note;
  };
  std::vector<Row> rows;
  for (int r : mesh.world_ranks()) {
    std::vector<int64_t> c = mesh.coordinate_of(r);
    LocalLayout l = s.local_layout_at(c);
    Row row;
    row.coord = "(";
    for (size_t i = 0; i < c.size(); ++i)
      row.coord += (i ? ", " : "") + std::to_string(c[i]);
    row.coord += ")";
    row.rank = std::to_string(r);
    for (size_t d = 0; d < l.local_shape.size(); ++d) {
      row.block += d ? ", " : "";
      row.block += std::to_string(l.global_offset[d]) + ":" +
                   std::to_string(l.global_offset[d] + l.local_shape[d]);
    }
    row.block = "[" + row.block + "]";
    for (int64_t m = 0; m < mesh.ndim(); ++m)
      if (s.placements[size_t(m)].is_partial())
        row.note += (row.note.empty() ? "partial(" : ",") + mesh.dim_names()[size_t(m)];
    if (!row.note.empty()) row.note += ")";
    if (shape_numel(l.local_shape) == 0) row.note += row.note.empty() ? "empty" : " empty";
    rows.push_back(row);
  }
  size_t w0 = 10, w1 = 4, w2 = 12;
  for (const auto& r : rows) {
    w0 = std::max(w0, r.coord.size());
    w1 = std::max(w1, r.rank.size());
    w2 = std::max(w2, r.block.size());
  }
  std::ostringstream os;
  os << shape_str(s.global_shape) << " " << dtype_name(s.dtype) << " on " << mesh.str() << " "
     << placements_str(s.placements) << "\n";
  auto line = [&](const std::string& a, const std::string& b, const std::string& c,
                  const std::string& d) {
    os << a << std::string(w0 - a.size() + 2, ' ') << b << std::string(w1 - b.size() + 2, ' ') << c
       << std::string(w2 - c.size() + 2, ' ') << d << "\n";
  };
  line("coordinate", "rank", "global block", "");
  for (const auto& r : rows)
    line(r.coord, r.rank, r.block, r.note);
  return os.str();
}

}  // namespace tessera
