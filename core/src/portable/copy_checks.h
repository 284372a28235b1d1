#pragma once
// Private to core: the argument checks of copy_runs_, shared by the CPU implementation and the
// device one, so both refuse the same inputs with the same words.
#include <algorithm>
#include <string>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/core/kernels/shape_ops.h"
#include "tessera/core/tensor.h"

namespace tessera::kernels::portable {

inline std::string run_str(const CopyRun& r) {
  return "{src " + std::to_string(r.src) + ", dst " + std::to_string(r.dst) + ", length " +
         std::to_string(r.length) + "}";
}

inline void check_copy_runs(const Tensor& dst, const Tensor& src,
                            const std::vector<CopyRun>& runs) {
  TESSERA_CHECK(dst.defined() && src.defined(), "copy_runs_: undefined tensor");
  TESSERA_CHECK(dst.dtype() == src.dtype(), "copy_runs_: destination ", dst.str(), " and source ",
                src.str(), " differ in dtype");
  TESSERA_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy_runs_: destination ", dst.str(),
                " and source ", src.str(), " must be contiguous");
  TESSERA_CHECK(!dst.storage().is_same(src.storage()), "copy_runs_: destination ", dst.str(),
                " and source ", src.str(), " share storage");
  std::vector<CopyRun> by_dst;
  for (const CopyRun& r : runs) {
    TESSERA_CHECK(r.length >= 0 && r.src >= 0 && r.dst >= 0 && r.src + r.length <= src.numel() &&
                      r.dst + r.length <= dst.numel(),
                  "copy_runs_: run ", run_str(r), " does not fit the source of ", src.numel(),
                  " and the destination of ", dst.numel(), " elements");
    if (r.length > 0) by_dst.push_back(r);
  }
  // Runs are copied in parallel: two writing one element would race.
  std::sort(by_dst.begin(), by_dst.end(),
            [](const CopyRun& a, const CopyRun& b) { return a.dst < b.dst; });
  for (size_t i = 1; i < by_dst.size(); ++i)
    TESSERA_CHECK(by_dst[i].dst >= by_dst[i - 1].dst + by_dst[i - 1].length, "copy_runs_: runs ",
                  run_str(by_dst[i - 1]), " and ", run_str(by_dst[i]),
                  " overlap in the destination");
}

}  // namespace tessera::kernels::portable
