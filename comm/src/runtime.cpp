#include "tessera/comm/runtime.h"

#include <mpi.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "checked_process_group.h"
#include "departures.h"
#include "mpi/mpi_process_group.h"
#include "mpi/mpi_state.h"
#include "mpi/mpi_types.h"
#include "mpi/progress_placement.h"
#include "progress_thread.h"
#include "tessera/core/error.h"

namespace tessera {

namespace detail {
void drop_backend_worlds();  // backend.cpp
}  // namespace detail

namespace {

constexpr double kDefaultTimeoutSeconds = 300.0;

// Flags are plain atomics with constant initialisation: group destructors consult them during
// static destruction at exit, when no other object may be relied on any more.
constinit std::atomic<bool> g_initialized{false};
constinit std::atomic<bool> g_finalized{false};
constinit std::atomic<bool> g_owns_mpi{false};
constinit std::atomic<int> g_world_rank{0};
constinit std::atomic<int> g_world_size{1};
constinit std::atomic<int> g_thread_level{MPI_THREAD_SINGLE};
constinit std::atomic<double> g_timeout{kDefaultTimeoutSeconds};
constinit std::atomic<bool> g_debug{false};

struct RuntimeState {
  std::mutex init_mutex;
  std::mutex call_mutex;
  std::thread::id init_thread;
  ProcessGroupPtr world;
  std::mutex hooks_mutex;
  std::vector<std::function<void()>> finalize_hooks;
  // Held while the hooks run: a second finalize (another thread's, or exit's) waits for them
  // instead of finalizing MPI under a hook that still communicates. Recursive for a hook that
  // calls finalize itself.
  std::recursive_mutex hooks_running;
};
RuntimeState& state() {
  // Never destroyed: a user's static ProcessGroupPtr may outlive every other static.
  static RuntimeState* s = new RuntimeState;
  return *s;
}

double parse_timeout(const char* text) {
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(text, &end);
  TESSERA_CHECK(end != text && *end == '\0' && errno == 0 && v > 0, "TESSERA_COLLECTIVE_TIMEOUT='",
                text, "' is not a positive number of seconds (for example 300 or 2.5)");
  return v;
}

bool parse_flag(const char* name, const char* text) {
  std::string v(text);
  if (v.empty() || v == "0" || v == "false" || v == "off" || v == "no") return false;
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  TESSERA_FAIL(name, "='", v, "' is not a switch: use 1/0, true/false, on/off or yes/no");
}

// TESSERA_PROGRESS_CPUS: true for "auto" (the default), false for "inherit".
bool parse_progress_cpus(const char* text) {
  if (!text || std::string(text) == "auto") return true;
  TESSERA_CHECK(std::string(text) == "inherit", "TESSERA_PROGRESS_CPUS='", text,
                "' is not a placement: use auto (the progress thread runs on CPUs no rank of the ",
                "node is bound to, when there are any) or inherit (it stays on its rank's CPUs)");
  return false;
}

// Error messages carry "[rank r] " already; abort_job adds it again, so drop the inner one.
std::string strip_rank_prefix(std::string what) {
  std::string prefix = "[rank " + std::to_string(error_rank()) + "] ";
  if (what.compare(0, prefix.size(), prefix) == 0) what.erase(0, prefix.size());
  return what;
}

[[noreturn]] void on_terminate() {
  std::string what = "std::terminate called without an active exception";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = "uncaught exception: " + strip_rank_prefix(ex.what());
    } catch (...) {
      what = "uncaught exception of a type not derived from std::exception";
    }
  }
  abort_job(what);
}

void finalize_as(mpi::Departure how);

// A program that ends without tessera::finalize(): a normal end, or an exit() on this rank while
// the others still compute; departing tells the others which (departures.h).
void finalize_at_exit() {
  if (g_initialized.load() && !g_finalized.load()) finalize_as(mpi::Departure::Exit);
}

}  // namespace

namespace mpi {

bool active() {
  return g_initialized.load() && !g_finalized.load();
}

std::unique_lock<std::mutex> lock() {
  return std::unique_lock<std::mutex>(state().call_mutex);
}

bool threads_may_communicate() {
  return g_thread_level.load() >= MPI_THREAD_SERIALIZED;
}

void require_usable(const char* op) {
  TESSERA_CHECK(!g_finalized.load(), op,
                ": the tessera runtime was finalized; no communication is ",
                "possible after tessera::finalize()");
  TESSERA_CHECK(g_initialized.load(), op, ": call tessera::init() (or create a tessera::Runtime) ",
                "before communicating");
  if (g_thread_level.load() < MPI_THREAD_SERIALIZED) {
    TESSERA_CHECK(std::this_thread::get_id() == state().init_thread, op,
                  ": MPI granted only thread level ", g_thread_level.load(),
                  " (below MPI_THREAD_SERIALIZED), so only the thread that called "
                  "tessera::init() may communicate");
  }
}

std::string error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, size_t(len));
}

void check(int rc, const char* call, const std::string& context) {
  if (rc == MPI_SUCCESS) return;
  TESSERA_FAIL(context, ": ", call, " failed: ", error_string(rc));
}

}  // namespace mpi

void init(int* argc, char*** argv) {
  RuntimeState& s = state();
  std::lock_guard<std::mutex> guard(s.init_mutex);
  if (g_initialized.load()) {
    TESSERA_CHECK(!g_finalized.load(), "tessera::init after tessera::finalize: MPI cannot be ",
                  "initialised twice in one process");
    return;
  }
  int mpi_finalized = 0;
  MPI_Finalized(&mpi_finalized);
  TESSERA_CHECK(!mpi_finalized, "tessera::init: MPI was already finalized in this process");

  // Read the environment first: a bad value should fail before MPI starts.
  double timeout = kDefaultTimeoutSeconds;
  if (const char* t = std::getenv("TESSERA_COLLECTIVE_TIMEOUT")) timeout = parse_timeout(t);
  bool debug = false;
  if (const char* d = std::getenv("TESSERA_DEBUG_COLLECTIVES")) {
    debug = parse_flag("TESSERA_DEBUG_COLLECTIVES", d);
  }
  const bool move_progress = parse_progress_cpus(std::getenv("TESSERA_PROGRESS_CPUS"));

  int mpi_initialized = 0;
  MPI_Initialized(&mpi_initialized);
  int provided = MPI_THREAD_SINGLE;
  if (mpi_initialized) {
    // The application started MPI itself; it also finalizes it.
    MPI_Query_thread(&provided);
  } else {
    // Every collective here is non-blocking, and OpenMPI's default non-blocking all-reduce is
    // 1.4-1.7x slower than its blocking one on large tensors; the ring algorithm matches it. A
    // value the user set in the environment wins.
    setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", /*overwrite=*/0);
    // Open MPI's MPI-IO writes each rank's pieces of a collective write itself, unaggregated,
    // when the file is open on at most 2 processes: a checkpoint saved from column windows
    // (tensor parallelism's row-parallel weights) became 2 KiB writes per row and rank, and the
    // page cache kept that file in small pages, so loading it soon after took 1.2-1.3x the time
    // of a file written in rows. Without that component it aggregates as it does for 3 or more.
    setenv("OMPI_MCA_fcoll_individual_priority", "0", /*overwrite=*/0);
    // SERIALIZED rather than MULTIPLE: our calls are serialised by one lock anyway, and MULTIPLE
    // costs MPI internal locking on every call. Without mpirun this is OpenMPI's singleton init.
    mpi::check(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread",
               "tessera::init");
    g_owns_mpi.store(true);
    // Calls without a communicator (MPI_Testall) report errors through the world's handler, which
    // would abort with MPI's text alone; returned codes become errors that say what went wrong.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  g_thread_level.store(provided);
  s.init_thread = std::this_thread::get_id();

  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  g_world_rank.store(rank);
  g_world_size.store(size);
  set_error_rank(rank);
  g_timeout.store(timeout);
  g_debug.store(debug);

  mpi::create_types();
  g_initialized.store(true);
  std::set_terminate(on_terminate);
  static std::once_flag at_exit_once;
  std::call_once(at_exit_once, [] { std::atexit(finalize_at_exit); });

  // The world group: MPI's, wrapped with the checks and the watchdog every backend gets; its
  // debug check travels on a communicator of its own.
  MPI_Comm world_dup = MPI_COMM_NULL;
  mpi::check(MPI_Comm_dup(MPI_COMM_WORLD, &world_dup), "MPI_Comm_dup", "tessera::init");
  s.world = detail::CheckedProcessGroup::wrap(mpi::MpiProcessGroup::create(world_dup, "world"),
                                              detail::debug_world_group());
  // Only when tessera also ends MPI: departing waits for every rank, which an application that
  // keeps using MPI after tessera::finalize() would not expect.
  if (g_owns_mpi.load()) mpi::open_departures();
  mpi::place_progress_thread(move_progress);
}

ProcessGroupPtr detail::debug_world_group() {
  MPI_Comm dup = MPI_COMM_NULL;
  {
    auto guard = mpi::lock();
    mpi::check(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "MPI_Comm_dup", "creating a debug group");
  }
  return mpi::MpiProcessGroup::create(dup, "world");
}

void finalize() {
  finalize_as(mpi::Departure::Finalize);
}

namespace {

// Each hook once, the last registered first, before finalize takes the runtime's lock: they
// communicate.
void run_finalize_hooks() {
  RuntimeState& s = state();
  std::lock_guard<std::recursive_mutex> running(s.hooks_running);
  while (g_initialized.load() && !g_finalized.load()) {
    std::function<void()> hook;
    {
      std::lock_guard<std::mutex> g(s.hooks_mutex);
      if (s.finalize_hooks.empty()) return;
      hook = std::move(s.finalize_hooks.back());
      s.finalize_hooks.pop_back();
    }
    try {
      hook();
    } catch (const std::exception& e) {
      abort_job(std::string("while finalizing: ") + e.what());
    } catch (...) {
      abort_job("while finalizing: a hook threw an exception not derived from std::exception");
    }
  }
}

void finalize_as(mpi::Departure how) {
  run_finalize_hooks();
  RuntimeState& s = state();
  std::lock_guard<std::mutex> guard(s.init_mutex);
  if (!g_initialized.load() || g_finalized.load()) return;
  mpi::depart(how);
  detail::stop_progress();
  // Groups still held by the user free their communicators only while MPI is active; release
  // ours now so the world communicator is freed properly.
  s.world.reset();
  detail::drop_backend_worlds();
  mpi::free_types();
  g_finalized.store(true);
  if (g_owns_mpi.load()) MPI_Finalize();
}

}  // namespace

bool is_initialized() {
  return mpi::active();
}

int world_rank() {
  mpi::require_usable("world_rank");
  return g_world_rank.load();
}

int world_size() {
  mpi::require_usable("world_size");
  return g_world_size.load();
}

ProcessGroupPtr world_group() {
  mpi::require_usable("world_group");
  return state().world;
}

namespace detail {
void at_finalize(std::function<void()> hook) {
  std::lock_guard<std::mutex> g(state().hooks_mutex);
  state().finalize_hooks.push_back(std::move(hook));
}
}  // namespace detail

void abort_job(const std::string& what) {
  // One write per message so lines of different ranks do not interleave mid-line.
  std::string line = "[rank " + std::to_string(error_rank()) + "] tessera: " + what + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
  std::cout.flush();
  std::fflush(stdout);
  if (mpi::active()) MPI_Abort(MPI_COMM_WORLD, 1);
  // Without MPI (before init, after finalize) there are no other ranks to take down.
  std::_Exit(1);
}

double collective_timeout_seconds() {
  return g_timeout.load();
}

void set_collective_timeout_seconds(double seconds) {
  TESSERA_CHECK(seconds > 0, "set_collective_timeout_seconds(", seconds,
                "): the timeout must be a positive number of seconds");
  g_timeout.store(seconds);
}

bool debug_collectives() {
  return g_debug.load();
}
void set_debug_collectives(bool on) {
  g_debug.store(on);
}

}  // namespace tessera
