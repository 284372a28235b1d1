// DTensor::redistribute against the raw MPI collective that moves the same bytes, same run.
// Run under `mpirun -np N`, any N (N = 2 is the reference setting on 2 cores). Prints JSON on rank
// 0; per case and size: the best time of each contender (each timed iteration starts after a
// barrier and counts as the slowest rank's time), ratio = tessera_s / mpi_s from the best times
// (1.0 means no overhead), and paired_median_ratio, the median of the same ratio over back-to-back
// pairs, which is the steadier figure when other processes share the machine.
//
//   redistribute [--quick] [--case NAME]... [--mib N]...
//     --quick runs 1 and 4 MiB only; --case and --mib run only the named transitions (e.g.
//     "S(0)->S(1)") and sizes.
//
// Tensors are float32 [rows, cols], global size 1, 4, 16, 64 MiB, with cols = 1024 and rows rounded
// down to multiples of the world size N (at N = 3: cols 1023, so that every rank's piece and every
// pair's block is the same size and the raw collectives apply). The baselines:
//   S(0) -> R     MPI_Allgather
//   S(1) -> R     MPI_Allgather of each rank's columns as one contiguous block (tessera must also
//                 interleave them into rows; that is part of what is measured)
//   P -> R        MPI_Allreduce (sum)
//   P -> S(0)     MPI_Reduce_scatter_block (sum)
//   S(0) -> S(1)  MPI_Alltoall of contiguous blocks of the size each pair exchanges (tessera
//                 must also cut each peer's columns out of its rows; that is part of what is
//                 measured)
// S(0) -> S(1) also runs a second baseline, the "strided floor": the least a program written
// against MPI directly does for the same reshard into the same layout: for each peer, a
// contiguous receive into its rows of the result and one send described by an MPI_Type_vector
// (the peer's columns of this rank's rows), this rank's own columns copied row by row while
// they travel. Shared-memory MPI moves a contiguous message with one copy (the receiver reads
// the sender's buffer) but a strided one with two (packed into shared fragments, then out), so
// this floor, not the all-to-all of pre-packed blocks, is what MPI allows for a reshard whose
// pieces are strided; "paired_vs_floor" is tessera's time over it.
// The MPI side writes into preallocated buffers; tessera allocates its result as a user's
// redistribute would.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cli.h"
#include "stats.h"
#include "tessera/tessera.h"

namespace {

using tessera::DTensor;
using tessera::Placements;
using tessera::Tensor;

constexpr int64_t kCols = 1024;

// The global shape of a `mib` MiB case on n ranks: both dims multiples of n.
tessera::Shape case_shape(int64_t mib, int n) {
  const int64_t cols = kCols / n * n;
  const int64_t rows = mib * (1 << 20) / int64_t(sizeof(float)) / cols / n * n;
  return {rows, cols};
}
constexpr double kBudgetSeconds = 1.5;

struct Timing {
  double tessera_s = 1e30, mpi_s = 1e30, paired_ratio = 0;
  double floor_s = 0, paired_vs_floor = 0;  // S(0)->S(1) only
  int reps = 0;
  const char* match = "false";  // JSON: whether tessera's result holds the expected values
};

// Time of `f` on the slowest rank, every rank entering together.
double timed(const std::function<void()>& f) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  f();
  double mine = MPI_Wtime() - t0, slowest = 0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

// Moves must give the same bits; sums of more than two terms may be added in another order than
// MPI's (float addition is not associative), so they must agree to a few ulps per term.
bool same_values(const Tensor& t, const std::vector<float>& v, int summed_terms) {
  if (size_t(t.numel()) != v.size()) return false;
  Tensor c = t.contiguous();
  if (summed_terms <= 2)
    return std::memcmp(c.data<float>(), v.data(), v.size() * sizeof(float)) == 0;
  const float* a = c.data<float>();
  const double tol = 4.0 * summed_terms * 1.2e-7;
  for (size_t i = 0; i < v.size(); ++i)
    if (std::abs(double(a[i]) - double(v[i])) > tol * (std::abs(double(v[i])) + 1e-30))
      return false;
  return true;
}

struct Case {
  const char* name;
  Placements from, to;
};

Timing run_case(const Case& c, const tessera::DeviceMesh& mesh, int64_t mib) {
  const int n = int(mesh.size());
  const int rank = tessera::world_rank();
  const tessera::Shape global = case_shape(mib, n);
  const int64_t rows = global[0], cols_total = global[1];
  tessera::Generator gen(7);
  // Partial sources hold a term of the global shape on every rank; sharded ones their rows.
  const bool partial = c.from[0].is_partial();
  const bool columns_shard = c.from[0].is_shard(1);
  const tessera::Shape local_shape = partial         ? global
                                     : columns_shard ? tessera::Shape{rows, cols_total / n}
                                                     : tessera::Shape{rows / n, cols_total};
  gen.set_offset(uint64_t(rank) * uint64_t(rows * cols_total));
  Tensor local = tessera::rand(local_shape, gen);
  DTensor src = DTensor::from_local(local, mesh, c.from, global);

  const std::string name = c.name;
  const float* in = local.data<float>();
  const int64_t local_numel = local.numel();
  std::vector<float> out;
  std::function<void()> raw;
  if (name == "S(0)->R" || name == "S(1)->R") {
    out.resize(size_t(local_numel * n));
    raw = [&] {
      MPI_Allgather(in, int(local_numel), MPI_FLOAT, out.data(), int(local_numel), MPI_FLOAT,
                    MPI_COMM_WORLD);
    };
  } else if (name == "P->R") {
    out.resize(size_t(local_numel));
    raw = [&] {
      MPI_Allreduce(in, out.data(), int(local_numel), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    };
  } else if (name == "P->S(0)") {
    out.resize(size_t(local_numel / n));
    raw = [&] {
      MPI_Reduce_scatter_block(in, out.data(), int(local_numel / n), MPI_FLOAT, MPI_SUM,
                               MPI_COMM_WORLD);
    };
  } else {  // S(0)->S(1): each pair exchanges a [rows / n, cols / n] block
    out.resize(size_t(local_numel));
    raw = [&] {
      MPI_Alltoall(in, int(local_numel / n), MPI_FLOAT, out.data(), int(local_numel / n), MPI_FLOAT,
                   MPI_COMM_WORLD);
    };
  }
  Tensor result;
  auto ours = [&] { result = src.redistribute(c.to).to_local(); };
  std::vector<float> floor_out;
  std::function<void()> floor;
  MPI_Datatype columns = MPI_DATATYPE_NULL;
  if (name == "S(0)->S(1)") {
    const int64_t local_rows = rows / n, cols = cols_total / n, block = local_rows * cols;
    floor_out.resize(size_t(local_numel));
    MPI_Type_vector(int(local_rows), int(cols), int(cols_total), MPI_FLOAT, &columns);
    MPI_Type_commit(&columns);
    floor = [&, local_rows, cols, block] {
      std::vector<MPI_Request> requests;
      for (int p = 0; p < n; ++p) {
        if (p == rank) continue;
        requests.emplace_back();
        MPI_Irecv(floor_out.data() + p * block, int(block), MPI_FLOAT, p, 0, MPI_COMM_WORLD,
                  &requests.back());
        requests.emplace_back();
        MPI_Isend(in + p * cols, 1, columns, p, 0, MPI_COMM_WORLD, &requests.back());
      }
      for (int64_t i = 0; i < local_rows; ++i)
        std::memcpy(floor_out.data() + rank * block + i * cols, in + i * cols_total + rank * cols,
                    size_t(cols) * sizeof(float));
      MPI_Waitall(int(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
    };
  }

  // Warm-up (page faults, plan cache, MPI's connection setup), then a correctness check where
  // the raw result is in the same layout as tessera's.
  for (int i = 0; i < 2; ++i) {
    ours();
    raw();
    if (floor) floor();
  }
  // The raw all-to-all moves other elements than the reshard (its blocks are pre-packed), so
  // the reshard is checked against its columns of the gathered matrix instead.
  std::vector<float> expected = out;
  if (name == "S(1)->R") {  // rank r's block of every row comes from its r-th piece
    const int64_t cols = cols_total / n;
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j)
          expected[size_t(i * cols_total + r * cols + j)] =
              out[size_t(r * local_numel + i * cols + j)];
  }
  if (name == "S(0)->S(1)") {
    std::vector<float> full(size_t(local_numel * n));
    MPI_Allgather(in, int(local_numel), MPI_FLOAT, full.data(), int(local_numel), MPI_FLOAT,
                  MPI_COMM_WORLD);
    const int64_t cols = cols_total / n;
    expected.clear();
    for (int64_t i = 0; i < rows; ++i) {
      const float* row = full.data() + i * cols_total + rank * cols;
      expected.insert(expected.end(), row, row + cols);
    }
  }
  Timing t;
  int match = same_values(result, expected, partial ? n : 1) ? 1 : 0, all = 0;
  if (floor) match = match && floor_out == expected;
  MPI_Allreduce(&match, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  t.match = all == 1 ? "true" : "false";

  // Repetitions from a time budget per case and size (both contenders), between 15 and 400.
  const double one = timed(ours) + timed(raw) + (floor ? timed(floor) : 0.0);
  const int reps = std::clamp(int(kBudgetSeconds / std::max(one, 1e-6)), 15, 400);
  std::vector<double> ratios, floor_ratios;
  t.floor_s = floor ? 1e30 : 0;
  for (int i = 0; i < reps; ++i) {
    // Alternate who goes first, so drift in machine load hits all alike.
    double a = 0, b = 0, f = 0;
    if (i % 2 == 0) {
      a = timed(ours);
      b = timed(raw);
      if (floor) f = timed(floor);
    } else {
      if (floor) f = timed(floor);
      b = timed(raw);
      a = timed(ours);
    }
    result = Tensor();
    t.tessera_s = std::min(t.tessera_s, a);
    t.mpi_s = std::min(t.mpi_s, b);
    ratios.push_back(a / b);
    if (floor) {
      t.floor_s = std::min(t.floor_s, f);
      floor_ratios.push_back(a / f);
    }
  }
  t.paired_ratio = tessera::bench::median(ratios);
  if (floor) {
    t.paired_vs_floor = tessera::bench::median(floor_ratios);
    MPI_Type_free(&columns);
  }
  t.reps = reps;
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  tessera::Runtime runtime(argc, argv);
  bool quick = false;
  std::vector<std::string> only;
  std::vector<int64_t> mibs;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--quick") {
      quick = true;
      continue;
    }
    TESSERA_CHECK(i + 1 < argc && (f == "--case" || f == "--mib"),
                  "redistribute bench: unknown or incomplete flag '", f,
                  "'; usage: redistribute [--quick] [--case NAME]... [--mib N]...");
    if (f == "--case") only.push_back(argv[++i]);
    if (f == "--mib")
      mibs.push_back(tessera::cli::parse_int("redistribute bench: --mib", argv[++i], 1, 1 << 16));
  }
  const int n = tessera::world_size();
  tessera::DeviceMesh mesh({n}, {"x"});
  const std::vector<Case> cases = {
      {"S(0)->R", {tessera::Shard(0)}, {tessera::Replicate()}},
      {"S(1)->R", {tessera::Shard(1)}, {tessera::Replicate()}},
      {"P->R", {tessera::Partial()}, {tessera::Replicate()}},
      {"P->S(0)", {tessera::Partial()}, {tessera::Shard(0)}},
      {"S(0)->S(1)", {tessera::Shard(0)}, {tessera::Shard(1)}},
  };
  std::vector<int64_t> sizes = {1, 4, 16, 64};
  if (quick) sizes = {1, 4};
  if (!mibs.empty()) sizes = mibs;

  std::string json =
      "{\n  \"benchmark\": \"redistribute\",\n  \"world_size\": " + std::to_string(n) +
      ",\n  \"dtype\": \"float32\",\n  \"cols\": " + std::to_string(case_shape(1, n)[1]) +
      ",\n  \"results\": [\n";
  bool first = true;
  for (const Case& c : cases) {
    if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
    for (int64_t mib : sizes) {
      Timing t = run_case(c, mesh, mib);
      char line[512];
      std::snprintf(line, sizeof(line),
                    "%s    {\"case\": \"%s\", \"mib\": %lld, \"rows\": %lld, \"tessera_s\": %.6e, "
                    "\"mpi_s\": %.6e, \"ratio\": %.3f, \"paired_median_ratio\": %.3f, ",
                    first ? "" : ",\n", c.name, (long long)mib, (long long)case_shape(mib, n)[0],
                    t.tessera_s, t.mpi_s, t.tessera_s / t.mpi_s, t.paired_ratio);
      json += line;
      if (t.floor_s > 0) {
        std::snprintf(line, sizeof(line), "\"floor_s\": %.6e, \"paired_vs_floor\": %.3f, ",
                      t.floor_s, t.paired_vs_floor);
        json += line;
      }
      std::snprintf(line, sizeof(line), "\"reps\": %d, \"values_match\": %s}", t.reps, t.match);
      json += line;
      first = false;
    }
  }
  json += "\n  ]\n}\n";
  if (tessera::world_rank() == 0) std::fputs(json.c_str(), stdout);
  return 0;
}
