// The backend-neutral all_gather_runs: pack, all-gather padded pieces, copy the runs out.
#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "tessera/comm/process_group.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"
#include "then_work.h"

namespace tessera {

namespace {

int64_t run_total(const std::vector<GatherRun>& runs) {
  int64_t n = 0;
  for (const GatherRun& r : runs)
    n += r.length;
  return n;
}

std::string where(const ProcessGroup& g) {
  return "all_gather_runs on group '" + g.name() + "' (rank " + std::to_string(g.rank()) + " of " +
         std::to_string(g.size()) + ")";
}

// Copies `length` elements from element `src_at` of `src` to element `dst_at` of `dst` (both
// contiguous): memcpy on the host, a device copy of two one-dimensional views elsewhere (one
// launch per run; the host cannot touch device memory).
void copy_run(Tensor& dst, int64_t dst_at, const Tensor& src, int64_t src_at, int64_t length) {
  if (length == 0) return;
  if (dst.device().is_cpu() && src.device().is_cpu()) {
    const size_t es = src.element_size();
    std::memcpy(static_cast<unsigned char*>(dst.raw_data()) + size_t(dst_at) * es,
                static_cast<const unsigned char*>(src.raw_data()) + size_t(src_at) * es,
                size_t(length) * es);
    return;
  }
  Tensor to = dst.as_strided({length}, {1}, dst.storage_offset() + dst_at);
  to.copy_(src.as_strided({length}, {1}, src.storage_offset() + src_at));
}

}  // namespace

void check_gather_runs(const ProcessGroup& group, const Tensor& out, const Tensor& in,
                       const std::vector<std::vector<GatherRun>>& runs) {
  TESSERA_CHECK(out.defined() && in.defined(), where(group),
                ": the output and the input must be defined tensors");
  TESSERA_CHECK(out.dtype() == in.dtype(), where(group), ": output dtype ", dtype_name(out.dtype()),
                " differs from input dtype ", dtype_name(in.dtype()));
  TESSERA_CHECK(out.is_contiguous() && in.is_contiguous(), where(group), ": the output ", out.str(),
                " and the input ", in.str(), " must be contiguous");
  TESSERA_CHECK(!out.storage().is_same(in.storage()), where(group),
                ": the output and the input share storage");
  TESSERA_CHECK(int64_t(runs.size()) == group.size(), where(group), ": runs for ", runs.size(),
                " ranks but the group has ", group.size());
  for (int r = 0; r < group.size(); ++r) {
    for (const GatherRun& g : runs[size_t(r)]) {
      const std::string run = "run {src " + std::to_string(g.src) + ", dst " +
                              std::to_string(g.dst) + ", length " + std::to_string(g.length) +
                              "} of rank " + std::to_string(r);
      TESSERA_CHECK(
          g.length >= 0 && g.length <= INT_MAX && g.dst >= 0 && g.dst + g.length <= out.numel(),
          where(group), ": ", run, " does not fit the output of ", out.numel(), " elements");
      TESSERA_CHECK(r != group.rank() || (g.src >= 0 && g.src + g.length <= in.numel()),
                    where(group), ": ", run, " does not fit this rank's input of ", in.numel(),
                    " elements");
    }
  }
}

WorkPtr ProcessGroup::all_gather_runs(Tensor& out, const Tensor& in,
                                      const std::vector<std::vector<GatherRun>>& runs) {
  check_gather_runs(*this, out, in, runs);
  int64_t piece = 1;  // all_gather_into_tensor takes no empty dims: at least one element
  for (const auto& r : runs)
    piece = std::max(piece, run_total(r));
  // The pieces live where the tensors do: a device backend gathers device memory.
  Tensor send = zeros({piece}, {in.dtype(), in.device()});
  int64_t at = 0;
  for (const GatherRun& g : runs[size_t(rank())]) {
    copy_run(send, at, in, g.src, g.length);
    at += g.length;
  }
  Tensor gathered = empty({piece * size()}, {in.dtype(), in.device()});
  WorkPtr inner = all_gather_into_tensor(gathered, send);
  return std::make_shared<detail::ThenWork>(std::move(inner),
                                            [out, send, gathered, runs, piece]() mutable {
                                              for (size_t r = 0; r < runs.size(); ++r) {
                                                int64_t from = int64_t(r) * piece;
                                                for (const GatherRun& g : runs[r]) {
                                                  copy_run(out, g.dst, gathered, from, g.length);
                                                  from += g.length;
                                                }
                                              }
                                            });
}

}  // namespace tessera
