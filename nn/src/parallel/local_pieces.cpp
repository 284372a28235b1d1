#include "local_pieces.h"

#include <algorithm>
#include <numeric>

#include "tessera/comm/agree.h"
#include "tessera/core/factory.h"
#include "tessera/dtensor/layout.h"

namespace tessera::detail {

namespace {

std::string sizes_str(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i)
    s += (i ? ", " : "") + std::to_string(v[i]);
  return s + ")";
}

// The check of the pieces along one mesh dim, over that dim's group: every member sees the same
// gathered shapes, so all members of the group find the same error. Returns the error ("" when
// none); the collectives it runs do not depend on what earlier mesh dims found.
std::string check_pieces_along(const Tensor& x, const DeviceMesh& mesh,
                               const Placements& placements, const std::string& what, int64_t m,
                               Shape& g) {
  const Placement& p = placements[size_t(m)];
  const int64_t n = mesh.size(m);
  // Every rank's whole shape first: pieces may differ only along the sharded dim, and a rank
  // whose piece has other dims or another size elsewhere (a batch of another size) would
  // otherwise pass here and leave the ranks gathering pieces of different sizes. Every rank
  // sees every rank's shape, so all of them fail together.
  Tensor ndims = empty({n}, TensorOptions(DType::Int64));
  mesh.host_group(m)->all_gather_into_tensor(ndims, from_vector<int64_t>({x.dim()}))->wait();
  const std::vector<int64_t> all_ndims = ndims.to_vector<int64_t>();
  const bool same_ndim =
      std::all_of(all_ndims.begin(), all_ndims.end(), [&](int64_t k) { return k == all_ndims[0]; });
  if (!same_ndim)
    return what + ": the ranks' pieces (" + placements_str(placements) + " over " + mesh.str() +
           ") have " + sizes_str(all_ndims) + " dims; they must agree";
  Tensor all_shapes = empty({n * x.dim()}, TensorOptions(DType::Int64));
  mesh.host_group(m)->all_gather_into_tensor(all_shapes, from_vector<int64_t>(x.shape()))->wait();
  const std::vector<int64_t> flat = all_shapes.to_vector<int64_t>();
  std::vector<Shape> shapes;
  std::string list;
  for (int64_t i = 0; i < n; ++i) {
    shapes.emplace_back(flat.begin() + i * x.dim(), flat.begin() + (i + 1) * x.dim());
    list += (i ? ", " : "") + shape_str(shapes.back());
  }
  // Dims out of range fail like wrap_dim, but as a text every rank of the mesh can agree on.
  for (const Placement& q : placements)
    if (q.is_shard() && (q.dim() < -x.dim() || q.dim() >= x.dim()))
      return concat(what, ": layouts ", placements_str(placements), " shard dim ", q.dim(),
                    ", out of range for pieces of ", x.dim(), " dims (", list, ")");
  const int64_t d = wrap_dim(p.dim(), x.dim(), what.c_str());
  bool same_elsewhere = true;
  for (const Shape& s : shapes)
    for (int64_t k = 0; k < x.dim(); ++k)
      same_elsewhere = same_elsewhere && (k == d || s[size_t(k)] == flat[size_t(k)]);
  if (!same_elsewhere)
    return concat(what, ": the ranks' pieces (", placements_str(placements), " over ", mesh.str(),
                  ") have shapes ", list, "; they may differ only along dim ", d,
                  ", which the layouts shard");
  for (int64_t k = 0; k < int64_t(placements.size()); ++k)
    if (k != m && placements[size_t(k)].is_shard() &&
        wrap_dim(placements[size_t(k)].dim(), x.dim(), what.c_str()) == d)
      return concat(what, " layouts ", placements_str(placements),
                    " shard one dim over several mesh dims; not supported for local activations");
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < n; ++i)
    sizes.push_back(flat[size_t(i * x.dim() + d)]);
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t(0));
  std::vector<int64_t> chunks;
  for (int64_t i = 0; i < n; ++i)
    chunks.push_back(chunk_of(total, n, i).length);
  if (sizes != chunks)
    return concat(what, ": the ranks' pieces along dim ", d, " (", placements_str(placements),
                  " over ", mesh.str(), ") have sizes ", sizes_str(sizes), ", but a DTensor of ",
                  total, " split ", n, " ways has pieces ", sizes_str(chunks),
                  " (torch.chunk); cut the activation that way");
  g[size_t(d)] = total;
  return "";
}

}  // namespace

Shape global_shape_of_pieces(const Tensor& x, const DeviceMesh& mesh, const Placements& placements,
                             const std::string& what) {
  Shape g = x.shape();
  // The check runs along every sharded mesh dim, over that dim's groups, and goes on after an
  // error: on a mesh of several dims, ranks of one group along a dim may find an error that the
  // other groups along it do not, and they must not leave those in the next mesh dim's gather.
  std::string error;
  for (int64_t m = 0; m < int64_t(placements.size()); ++m) {
    if (!placements[size_t(m)].is_shard()) continue;
    std::string e = check_pieces_along(x, mesh, placements, what, m, g);
    if (error.empty()) error = std::move(e);
  }
  if (mesh.ndim() == 1) {
    if (!error.empty()) TESSERA_FAIL(error);
    return g;
  }
  // Spread the errors over the whole mesh, one mesh dim after the other, so that every rank
  // throws, with the same text.
  std::vector<std::string> errors;
  if (!error.empty()) errors.push_back(error);
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    std::string mine;
    for (const std::string& e : errors)
      mine += (mine.empty() ? "" : "\n") + e;
    for (const std::string& text : all_gather_strings(mesh.host_group(m), mine)) {
      size_t pos = 0;
      while (pos < text.size()) {
        size_t stop = text.find('\n', pos);
        if (stop == std::string::npos) stop = text.size();
        const std::string e = text.substr(pos, stop - pos);
        if (!e.empty() && std::find(errors.begin(), errors.end(), e) == errors.end())
          errors.push_back(e);
        pos = stop + 1;
      }
    }
  }
  if (errors.empty()) return g;
  std::sort(errors.begin(), errors.end());
  std::string all;
  for (const std::string& e : errors)
    all += (all.empty() ? "" : "; ") + e;
  TESSERA_FAIL(all);
}

}  // namespace tessera::detail
