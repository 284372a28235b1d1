// The backend-neutral all_gather_runs: pack, all-gather padded pieces, copy the runs out.
#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tessera/comm/process_group.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/shape_ops.h"
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
  // Each output element comes from one run: a backend moving the runs straight to their places
  // (one MPI receive datatype per rank) may not have two write one element.
  struct Placed {
    int64_t dst, length;
    int rank;
  };
  std::vector<Placed> placed;
  for (int r = 0; r < group.size(); ++r)
    for (const GatherRun& g : runs[size_t(r)])
      if (g.length > 0) placed.push_back({g.dst, g.length, r});
  std::sort(placed.begin(), placed.end(),
            [](const Placed& a, const Placed& b) { return a.dst < b.dst; });
  for (size_t i = 1; i < placed.size(); ++i) {
    const Placed &a = placed[i - 1], &b = placed[i];
    TESSERA_CHECK(a.dst + a.length <= b.dst, where(group), ": the runs of rank ", a.rank,
                  " (output elements ", a.dst, " to ", a.dst + a.length - 1, ") and of rank ",
                  b.rank, " (from ", b.dst,
                  ") overlap in the output; each element must come from "
                  "one run");
  }
}

WorkPtr ProcessGroup::all_gather_runs(Tensor& out, const Tensor& in,
                                      const std::vector<std::vector<GatherRun>>& runs) {
  check_gather_runs(*this, out, in, runs);
  int64_t piece = 1;  // all_gather_into_tensor takes no empty dims: at least one element
  for (const auto& r : runs)
    piece = std::max(piece, run_total(r));
  // The pieces live where the tensors do: a device backend gathers device memory. Packing and
  // unpacking are one copy kernel each, whatever the number of runs.
  Tensor send = zeros({piece}, {in.dtype(), in.device()});
  std::vector<kernels::CopyRun> pack;
  int64_t at = 0;
  for (const GatherRun& g : runs[size_t(rank())]) {
    pack.push_back({g.src, at, g.length});
    at += g.length;
  }
  kernels::copy_runs_(send, in, pack);
  std::vector<kernels::CopyRun> unpack;
  for (size_t r = 0; r < runs.size(); ++r) {
    int64_t from = int64_t(r) * piece;
    for (const GatherRun& g : runs[r]) {
      unpack.push_back({from, g.dst, g.length});
      from += g.length;
    }
  }
  Tensor gathered = empty({piece * size()}, {in.dtype(), in.device()});
  WorkPtr inner = all_gather_into_tensor(gathered, send);
  return std::make_shared<detail::ThenWork>(
      std::move(inner), [out, send, gathered, unpack = std::move(unpack)]() mutable {
        kernels::copy_runs_(out, gathered, unpack);
      });
}

}  // namespace tessera
