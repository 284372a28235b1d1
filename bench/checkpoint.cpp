// Checkpoint save and load against raw MPI-IO moving the same bytes, in the same run. Run under
// `mpirun -np N` (2 and 4 are the reference settings). Prints JSON on rank 0.
//
//   checkpoint [--mib N] [--rounds N] [--dir DIR] [--no-fsync]
//
// The state: float32 tensors [rows, 1024] of 16 MiB each, --mib in all (default 256), sharded
// Shard(0) over the N ranks as FSDP holds them ("rows"). The other layout holds the same bytes
// per rank cut differently ("columns"): at 2 ranks Shard(1), at 4 or more a (2, N/2) mesh
// [S(0), S(1)]; its windows are not runs of the file. Each round runs, in this order:
//   raw write    every rank writes its rows of every tensor at the offsets a dense row-major
//                layout gives them, into a new file that rank 0 then renames over the previous
//                one (then MPI_File_sync with fsync): the same commit as a save, so both
//                allocate fresh file pages alike (overwriting in place would reuse cached pages,
//                which no crash-safe checkpoint can). Collective (write_at_all) and independent
//                (write_at) writes both run; the faster is the baseline.
//   save         tessera::save of the rows (fsync as the raw write)
//   raw read     the rows read back, collective and independent; the faster is the baseline
//   load         tessera::load of the rows file into the rows layout (checksums verified), by
//                default copied out of the mapped file
//   load unverified, load transactional: the same with LoadOptions verify = false, and with
//                transactional = true
//   load columns tessera::load of the rows file into the columns layout
//   load hdf5, load columns hdf5: load and load columns with memory_map = false (independent HDF5
//                reads over MPI-IO)
//   load from columns: a file saved from the columns layout, loaded into the rows layout (the
//                file does not depend on the layout that saved it)
//   async        tessera::async_save: the time until it returns (the training thread is free
//                again); its wait is untimed
// Each time is the slowest rank's, every rank starting together. Ratios are paired per round
// (tessera / raw of the same round, other / rows, async / save); the JSON gives their median,
// min and max over the rounds, and the median times in seconds. A first round warms up untimed.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cli.h"
#include "stats.h"
#include "tessera/comm/mpi_interop.h"
#include "tessera/tessera.h"

using namespace tessera;

namespace {

constexpr int64_t kCols = 1024;
constexpr int64_t kTensorMiB = 16;

struct Args {
  int64_t mib = 256;
  int rounds = 5;
  std::string dir = "/tmp";
  bool fsync = true;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    const bool has_value = i + 1 < argc;
    if (f == "--mib" && has_value) {
      a.mib = cli::parse_int("checkpoint bench: " + f, argv[++i], kTensorMiB, 1 << 20);
    } else if (f == "--rounds" && has_value) {
      a.rounds = int(cli::parse_int("checkpoint bench: " + f, argv[++i], 1, 1000));
    } else if (f == "--dir" && has_value) {
      a.dir = argv[++i];
    } else if (f == "--no-fsync") {
      a.fsync = false;
    } else {
      TESSERA_FAIL("checkpoint bench: unknown or incomplete flag '", f,
                   "'; usage: checkpoint [--mib N] [--rounds N] [--dir DIR] [--no-fsync]");
    }
  }
  TESSERA_CHECK(a.mib % kTensorMiB == 0, "checkpoint bench: --mib must be a multiple of ",
                kTensorMiB);
  return a;
}

// tessera's progress thread (and an asynchronous save's writer) may be in MPI at any time: the
// benchmark's own MPI calls take the same lock.
template <class F>
auto mpi(F&& f) {
  MpiCallGuard guard;
  return f();
}

double timed(const std::function<void()>& f) {
  mpi([] { return MPI_Barrier(MPI_COMM_WORLD); });
  const double t0 = MPI_Wtime();
  f();
  double mine = MPI_Wtime() - t0, slowest = 0;
  mpi([&] { return MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD); });
  return slowest;
}

// The raw baseline: each rank's rows of each tensor at their place in a dense file.
void raw_io(const std::string& path, std::vector<Tensor>& locals, int64_t rows, bool write,
            bool fsync, bool collective) {
  const int n = world_size(), r = world_rank();
  const int64_t tensor_bytes = rows * kCols * 4;
  MPI_File fh;
  const std::string target = write ? path + ".tmp" : path;
  mpi([&] {
    return MPI_File_open(MPI_COMM_WORLD, target.c_str(),
                         write ? (MPI_MODE_CREATE | MPI_MODE_WRONLY) : MPI_MODE_RDONLY,
                         MPI_INFO_NULL, &fh);
  });
  for (size_t t = 0; t < locals.size(); ++t) {
    const int64_t row0 = r * (rows / n);
    const MPI_Offset at = MPI_Offset(int64_t(t) * tensor_bytes + row0 * kCols * 4);
    const int count = int(locals[t].numel());
    mpi([&] {
      void* p = locals[t].raw_data();
      if (collective)
        return write ? MPI_File_write_at_all(fh, at, p, count, MPI_FLOAT, MPI_STATUS_IGNORE)
                     : MPI_File_read_at_all(fh, at, p, count, MPI_FLOAT, MPI_STATUS_IGNORE);
      return write ? MPI_File_write_at(fh, at, p, count, MPI_FLOAT, MPI_STATUS_IGNORE)
                   : MPI_File_read_at(fh, at, p, count, MPI_FLOAT, MPI_STATUS_IGNORE);
    });
  }
  if (write && fsync) mpi([&] { return MPI_File_sync(fh); });
  mpi([&] { return MPI_File_close(&fh); });
  if (write) {
    if (r == 0) std::filesystem::rename(target, path);
    mpi([] { return MPI_Barrier(MPI_COMM_WORLD); });
  }
}

using bench::Spread;
using bench::spread;

std::string json(const Spread& s) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "{\"median\": %.3f, \"min\": %.3f, \"max\": %.3f}", s.median,
                s.min, s.max);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  const Args a = parse(argc, argv);
  const int64_t n = world_size();
  const int64_t rows = kTensorMiB * (1 << 20) / 4 / kCols;
  TESSERA_CHECK(rows % n == 0, "checkpoint bench: ", rows, " rows must split evenly over ", n,
                " ranks (the raw baseline assumes it)");
  const int64_t tensors = a.mib / kTensorMiB;
  DeviceMesh line(Shape{n}, {"dp"});
  Generator gen(5);
  StateDict state;
  std::vector<Tensor> raw(static_cast<size_t>(tensors));
  for (int64_t t = 0; t < tensors; ++t) {
    DTensor d = randn({rows, kCols}, line, {Shard(0)}, gen);
    state["model/w" + std::to_string(t)] = d;
    raw[size_t(t)] = d.to_local().clone();
  }
  // The other layout: the same bytes per rank, cut differently.
  StateDict other;
  std::optional<DeviceMesh> grid;
  if (n >= 4) grid.emplace(Shape{2, n / 2}, std::vector<std::string>{"a", "b"});
  for (int64_t t = 0; t < tensors; ++t) {
    const std::string key = "model/w" + std::to_string(t);
    other[key] = grid ? distribute_tensor(zeros({rows, kCols}), *grid, {Shard(0), Shard(1)})
                      : distribute_tensor(zeros({rows, kCols}), line, {Shard(1)});
  }
  const std::string base = a.dir + "/tessera_bench_checkpoint_np" + std::to_string(n);
  const std::string raw_path = base + ".raw", path = base + ".h5", async_path = base + ".async.h5";
  const SaveOptions so{.fsync = a.fsync};

  std::map<std::string, std::vector<double>> times, ratios;
  const std::string columns_path = base + ".columns.h5";
  StateDict columns_state;
  for (const auto& [key, v] : other)
    columns_state[key] = std::get<DTensor>(v).redistribute(std::get<DTensor>(v).placements());
  for (const auto& [key, v] : state)
    std::get<DTensor>(columns_state[key]).copy_from_full(std::get<DTensor>(v).full_tensor());
  save(columns_state, columns_path, so);
  // Round -1 warms up, untimed: the first opens and creations of each file, the first load's
  // setup.
  for (int round = -1; round < a.rounds; ++round) {
    const double wc = timed([&] { raw_io(raw_path, raw, rows, true, a.fsync, true); });
    const double wi = timed([&] { raw_io(raw_path, raw, rows, true, a.fsync, false); });
    const double s = timed([&] { save(state, path, so); });
    const double rc = timed([&] { raw_io(raw_path, raw, rows, false, false, true); });
    const double ri = timed([&] { raw_io(raw_path, raw, rows, false, false, false); });
    const double l = timed([&] { load(state, path); });
    const double lu = timed([&] { load(state, path, {.verify = false}); });
    const double lt = timed([&] { load(state, path, {.transactional = true}); });
    const double oc = timed([&] { load(other, path); });
    const double of = timed([&] { load(state, columns_path); });
    const double lh = timed([&] { load(state, path, {.memory_map = false}); });
    const double och = timed([&] { load(other, path, {.memory_map = false}); });
    AsyncSave pending;
    const double as = timed([&] { pending = async_save(state, async_path, so); });
    pending.wait();
    if (round < 0) continue;
    const double w = std::min(wc, wi), r = std::min(rc, ri);
    times["raw_write_collective"].push_back(wc);
    times["raw_write_independent"].push_back(wi);
    times["save"].push_back(s);
    times["raw_read_collective"].push_back(rc);
    times["raw_read_independent"].push_back(ri);
    times["load"].push_back(l);
    times["load_unverified"].push_back(lu);
    times["load_transactional"].push_back(lt);
    times["load_columns"].push_back(oc);
    times["load_from_columns"].push_back(of);
    times["load_hdf5"].push_back(lh);
    times["load_columns_hdf5"].push_back(och);
    times["async_save_blocked"].push_back(as);
    ratios["save_vs_mpiio"].push_back(s / w);
    ratios["load_vs_mpiio"].push_back(l / r);
    ratios["load_unverified_vs_mpiio"].push_back(lu / r);
    ratios["load_transactional_vs_mpiio"].push_back(lt / r);
    ratios["load_columns_vs_rows"].push_back(oc / l);
    ratios["load_from_columns_vs_from_rows"].push_back(of / l);
    ratios["load_hdf5_vs_mpiio"].push_back(lh / r);
    ratios["load_columns_hdf5_vs_rows_hdf5"].push_back(och / lh);
    ratios["async_blocked_vs_sync_save"].push_back(as / s);
  }
  // The loads must have read the right values.
  bool ok = true;
  for (const auto& [key, v] : other) {
    const Tensor got = std::get<DTensor>(v).full_tensor();
    const Tensor want = std::get<DTensor>(state.at(key)).full_tensor();
    ok = ok && std::memcmp(got.raw_data(), want.raw_data(), got.nbytes()) == 0;
  }
  if (world_rank() == 0) {
    std::printf("{\n  \"benchmark\": \"checkpoint\",\n  \"ranks\": %lld,\n  \"state_mib\": %lld,\n",
                (long long)n, (long long)a.mib);
    std::printf("  \"rounds\": %d,\n  \"fsync\": %s,\n  \"columns_layout\": \"%s\",\n", a.rounds,
                a.fsync ? "true" : "false",
                grid ? "(2, N/2) mesh [S(0), S(1)]" : "[S(1)] on the same ranks");
    std::printf("  \"values_match\": %s,\n  \"ratios\": {\n", ok ? "true" : "false");
    size_t i = 0;
    for (const auto& [name, v] : ratios)
      std::printf("    \"%s\": %s%s\n", name.c_str(), json(spread(v)).c_str(),
                  ++i < ratios.size() ? "," : "");
    std::printf("  },\n  \"median_seconds\": {\n");
    i = 0;
    for (const auto& [name, v] : times)
      std::printf("    \"%s\": %.4f%s\n", name.c_str(), spread(v).median,
                  ++i < times.size() ? "," : "");
    std::printf("  }\n}\n");
  }
  if (world_rank() == 0)
    for (const auto& p : {raw_path, path, async_path, columns_path})
      std::filesystem::remove(p);
  return ok ? 0 : 1;
}
