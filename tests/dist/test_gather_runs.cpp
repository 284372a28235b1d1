// all_gather_runs: rank r's runs land where they say in every rank's output, for every dtype,
// with empty runs and ranks, against values computed here from the rank numbers; through the
// MPI group's own implementation and through the default every backend inherits.
#include <gtest/gtest.h>

#include "tessera/comm/comm.h"
#include "tessera/core/core.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using tessera::testing::expect_error;

namespace {

// FSDP's pattern: 3 "parameters" of rows x 4 sharded on rows over the group, each rank's input
// padded to ceil(rows / k) rows per parameter, the output the unsharded parameters one after
// another. Rows 7, 2 and 0: uneven pieces, ranks with nothing, an empty parameter.
struct Layout {
  std::vector<std::vector<GatherRun>> runs;
  int64_t in_numel = 0, out_numel = 0;
};

Layout fsdp_layout(int k) {
  const std::vector<int64_t> rows = {7, 2, 0};
  const int64_t cols = 4;
  Layout l;
  l.runs.resize(size_t(k));
  int64_t in_offset = 0, out_offset = 0;
  for (int64_t n : rows) {
    const int64_t chunk = (n + k - 1) / k;
    for (int r = 0; r < k; ++r) {
      const int64_t start = std::min(n, r * chunk), len = std::min(chunk, n - start);
      l.runs[size_t(r)].push_back({in_offset, out_offset + start * cols, len * cols});
    }
    in_offset += chunk * cols;
    out_offset += n * cols;
  }
  l.in_numel = in_offset;
  l.out_numel = out_offset;
  return l;
}

// The MPI group's own all_gather_runs (one MPI_Ialltoallw), and the default any backend has
// (padded all-gather, then copies).
class AllGatherRuns : public ::testing::TestWithParam<bool> {
 protected:
  WorkPtr gather(ProcessGroup& pg, Tensor& out, const Tensor& in,
                 const std::vector<std::vector<GatherRun>>& runs) {
    return GetParam() ? pg.ProcessGroup::all_gather_runs(out, in, runs)
                      : pg.all_gather_runs(out, in, runs);
  }
};

INSTANTIATE_TEST_SUITE_P(Backend, AllGatherRuns, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Default" : "Mpi"; });

TEST_P(AllGatherRuns, PiecesLandInPlaceForEveryDtype) {
  ProcessGroupPtr pg = world_group();
  const Layout l = fsdp_layout(pg->size());
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16, DType::Int64,
                   DType::Int32}) {
    SCOPED_TRACE(dtype_name(dt));
    // Element i of rank r's input holds 1000 r + i; 16-bit floats get small integers, which
    // they hold exactly.
    const bool half = dt == DType::BFloat16 || dt == DType::Float16;
    auto value = [&](int r, int64_t i) {
      return half ? double((r * 37 + i) % 128) : double(1000 * r + i);
    };
    std::vector<double> in(size_t(l.in_numel), -1.0);
    for (int64_t i = 0; i < l.in_numel; ++i)
      in[size_t(i)] = value(pg->rank(), i);
    Tensor input = from_vector<double>(in, {l.in_numel}).to(dt);
    Tensor out = full({l.out_numel}, -7.0, dt);
    WorkPtr work = gather(*pg, out, input, l.runs);
    progress_in_background(work);  // as FSDP does
    work->wait();
    std::vector<double> want(size_t(l.out_numel), -7.0);
    for (int r = 0; r < pg->size(); ++r)
      for (const GatherRun& g : l.runs[size_t(r)])
        for (int64_t j = 0; j < g.length; ++j)
          want[size_t(g.dst + j)] = value(r, g.src + j);
    EXPECT_EQ(out.to(DType::Float64).to_vector<double>(), want);
  }
}

TEST_P(AllGatherRuns, BadRunsAreErrorsOnEveryRank) {
  ProcessGroupPtr pg = world_group();
  Layout l = fsdp_layout(pg->size());
  Tensor in = zeros({l.in_numel}), out = zeros({l.out_numel});
  auto too_far = l.runs;
  too_far[0].push_back({0, l.out_numel - 1, 2});
  expect_error([&] { gather(*pg, out, in, too_far); },
               {"all_gather_runs on group 'world'", "of rank 0 does not fit the output"});
  std::vector<std::vector<GatherRun>> short_list(size_t(pg->size() + 1));
  expect_error([&] { gather(*pg, out, in, short_list); }, {"runs for", "ranks"});
  Tensor wrong = zeros({l.out_numel}, DType::Float64);
  expect_error([&] { gather(*pg, wrong, in, l.runs); }, {"differs from input dtype"});
  // The last rank's first run written again by rank 0 (the backends would disagree on which
  // write wins).
  auto overlapping = l.runs;
  const GatherRun& last = l.runs.back().front();
  overlapping[0].push_back({0, last.dst, 1});
  expect_error([&] { gather(*pg, out, in, overlapping); },
               {"overlap in the output", "each element must come from one run"});
}

}  // namespace
