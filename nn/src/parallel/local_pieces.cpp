#include "local_pieces.h"

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
    const int64_t d = wrap_dim(p.dim(), x.dim(), what.c_str());
    for (int64_t k = 0; k < int64_t(placements.size()); ++k)
      TESSERA_CHECK(k == m || !placements[size_t(k)].is_shard() ||
                        wrap_dim(placements[size_t(k)].dim(), x.dim(), what.c_str()) != d,
                    what, " layouts ", placements_str(placements),
                    " shard one dim over several mesh dims; not supported for local activations");
    const int64_t n = mesh.size(m);
    Tensor all = empty({n}, TensorOptions(DType::Int64));
    mesh.host_group(m)->all_gather_into_tensor(all, from_vector<int64_t>({x.size(d)}))->wait();
    const std::vector<int64_t> sizes = all.to_vector<int64_t>();
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
