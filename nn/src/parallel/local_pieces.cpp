#include "local_pieces.h"

#include <algorithm>
#include <numeric>

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

}  // namespace

Shape global_shape_of_pieces(const Tensor& x, const DeviceMesh& mesh, const Placements& placements,
                             const std::string& what) {
  Shape g = x.shape();
  for (int64_t m = 0; m < int64_t(placements.size()); ++m) {
    const Placement& p = placements[size_t(m)];
    if (!p.is_shard()) continue;
    const int64_t n = mesh.size(m);
    // Every rank's whole shape first: pieces may differ only along the sharded dim, and a rank
    // whose piece has other dims or another size elsewhere (a batch of another size) would
    // otherwise pass here and leave the ranks gathering pieces of different sizes. Every rank
    // sees every rank's shape, so all of them fail together.
    Tensor ndims = empty({n}, TensorOptions(DType::Int64));
    mesh.host_group(m)->all_gather_into_tensor(ndims, from_vector<int64_t>({x.dim()}))->wait();
    const std::vector<int64_t> all_ndims = ndims.to_vector<int64_t>();
    const bool same_ndim = std::all_of(all_ndims.begin(), all_ndims.end(),
                                       [&](int64_t k) { return k == all_ndims[0]; });
    TESSERA_CHECK(same_ndim, what, ": the ranks' pieces (", placements_str(placements), " over ",
                  mesh.str(), ") have ", sizes_str(all_ndims), " dims; they must agree");
    const int64_t d = wrap_dim(p.dim(), x.dim(), what.c_str());
    Tensor all_shapes = empty({n * x.dim()}, TensorOptions(DType::Int64));
    mesh.host_group(m)->all_gather_into_tensor(all_shapes, from_vector<int64_t>(x.shape()))->wait();
    const std::vector<int64_t> flat = all_shapes.to_vector<int64_t>();
    bool same_elsewhere = true;
    std::string list;
    for (int64_t i = 0; i < n; ++i) {
      const Shape s(flat.begin() + i * x.dim(), flat.begin() + (i + 1) * x.dim());
      list += (i ? ", " : "") + shape_str(s);
      for (int64_t k = 0; k < x.dim(); ++k)
        same_elsewhere = same_elsewhere && (k == d || s[size_t(k)] == flat[size_t(k)]);
    }
    TESSERA_CHECK(same_elsewhere, what, ": the ranks' pieces (", placements_str(placements),
                  " over ", mesh.str(), ") have shapes ", list, "; they may differ only along dim ",
                  d, ", which the layouts shard");
    for (int64_t k = 0; k < int64_t(placements.size()); ++k)
      TESSERA_CHECK(k == m || !placements[size_t(k)].is_shard() ||
                        wrap_dim(placements[size_t(k)].dim(), x.dim(), what.c_str()) != d,
                    what, " layouts ", placements_str(placements),
                    " shard one dim over several mesh dims; not supported for local activations");
    std::vector<int64_t> sizes;
    for (int64_t i = 0; i < n; ++i)
      sizes.push_back(flat[size_t(i * x.dim() + d)]);
    const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t(0));
    std::vector<int64_t> chunks;
    for (int64_t i = 0; i < n; ++i)
      chunks.push_back(chunk_of(total, n, i).length);
    TESSERA_CHECK(sizes == chunks, what, ": the ranks' pieces along dim ", d, " (",
                  placements_str(placements), " over ", mesh.str(), ") have sizes ",
                  sizes_str(sizes), ", but a DTensor of ", total, " split ", n, " ways has pieces ",
                  sizes_str(chunks), " (torch.chunk); cut the activation that way");
    g[size_t(d)] = total;
  }
  return g;
}

}  // namespace tessera::detail
