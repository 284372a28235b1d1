#include "../departures.h"

#include <chrono>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "mpi_state.h"

namespace tessera::mpi {

namespace {

constexpr int kNoticeTag = 1;
// A departing rank waits for the others as long as they take (MPI_Finalize would too), so it
// sleeps between polls rather than spinning on a core another rank may need.
constexpr std::chrono::microseconds kDepartPoll{200};

struct Notice {
  Departure how = Departure::Finalize;
  std::map<uint64_t, int64_t> started;  // by group id
};

struct State {
  std::mutex mutex;
  std::map<uint64_t, std::shared_ptr<std::atomic<int64_t>>> counters;
  MPI_Comm comm = MPI_COMM_NULL;   // a duplicate of MPI_COMM_WORLD
  std::map<int, Notice> departed;  // by world rank
};
State& state() {
  // Never destroyed: the at-exit finalize uses it after static destruction may have begun.
  static State* s = new State;
  return *s;
}

// [how, groups, id, started, id, started, ...]
std::vector<int64_t> encode_departure(Departure how) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mutex);
  std::vector<int64_t> msg = {int64_t(how), int64_t(s.counters.size())};
  for (const auto& [id, counter] : s.counters) {
    msg.push_back(int64_t(id));
    msg.push_back(counter->load());
  }
  return msg;
}

Notice decode_departure(const std::vector<int64_t>& msg) {
  Notice n;
  if (msg.size() < 2) return n;
  n.how = Departure(msg[0]);
  for (size_t i = 2; i + 1 < msg.size(); i += 2)
    n.started[uint64_t(msg[i])] = msg[i + 1];
  return n;
}

// Receives one waiting notice, if any; caller holds lock(). True when it received one.
bool receive_notice(MPI_Comm comm, int source) {
  int flag = 0;
  MPI_Status st;
  MPI_Iprobe(source, kNoticeTag, comm, &flag, &st);
  if (!flag) return false;
  int count = 0;
  MPI_Get_count(&st, MPI_INT64_T, &count);
  std::vector<int64_t> msg(size_t(count > 0 ? count : 0));
  MPI_Recv(msg.data(), count, MPI_INT64_T, st.MPI_SOURCE, kNoticeTag, comm, MPI_STATUS_IGNORE);
  State& s = state();
  std::lock_guard<std::mutex> g(s.mutex);
  s.departed[st.MPI_SOURCE] = decode_departure(msg);
  return true;
}

bool heard_from(int rank) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mutex);
  return s.departed.count(rank) != 0;
}

}  // namespace

}  // namespace tessera::mpi

namespace tessera::detail {

using mpi::lock;

std::shared_ptr<std::atomic<int64_t>> register_group(uint64_t group_id) {
  using namespace mpi;
  State& s = state();
  std::lock_guard<std::mutex> g(s.mutex);
  std::shared_ptr<std::atomic<int64_t>>& c = s.counters[group_id];
  if (!c) c = std::make_shared<std::atomic<int64_t>>(0);
  return c;
}

}  // namespace tessera::detail

namespace tessera::mpi {

void open_departures() {
  auto guard = lock();
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size == 1) return;  // nobody to tell
  MPI_Comm comm = MPI_COMM_NULL;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup", "tessera::init");
  MPI_Comm_set_name(comm, "tessera.departures");
  state().comm = comm;
}

void depart(Departure how) {
  State& s = state();
  if (s.comm == MPI_COMM_NULL) return;
  const std::vector<int64_t> msg = encode_departure(how);
  int me = 0;
  int size = 1;
  std::vector<MPI_Request> sends;
  MPI_Request barrier = MPI_REQUEST_NULL;
  {
    auto guard = lock();
    MPI_Comm_rank(s.comm, &me);
    MPI_Comm_size(s.comm, &size);
    for (int r = 0; r < size; ++r) {
      if (r == me) continue;
      sends.push_back(MPI_REQUEST_NULL);
      MPI_Isend(msg.data(), int(msg.size()), MPI_INT64_T, r, kNoticeTag, s.comm, &sends.back());
    }
    // Sent before the barrier: a rank still waiting in a collective hears of this departure.
    MPI_Ibarrier(s.comm, &barrier);
  }
  for (;;) {
    int done = 0;
    {
      auto guard = lock();
      while (receive_notice(s.comm, MPI_ANY_SOURCE)) {
      }
      MPI_Test(&barrier, &done, MPI_STATUS_IGNORE);
    }
    if (done) break;
    std::this_thread::sleep_for(kDepartPoll);
  }
  // Every rank has sent its notice by now; collect the rest so no message outlives MPI.
  auto guard = lock();
  for (int r = 0; r < size; ++r) {
    while (r != me && !heard_from(r))
      receive_notice(s.comm, r);
  }
  MPI_Waitall(int(sends.size()), sends.data(), MPI_STATUSES_IGNORE);
  MPI_Comm_free(&s.comm);
  s.comm = MPI_COMM_NULL;
}

}  // namespace tessera::mpi

namespace tessera::detail {

std::string departed_before(uint64_t group_id, const std::vector<int>& world_ranks,
                            const std::string& name, int64_t seq) {
  using namespace mpi;
  State& s = state();
  if (seq < 0) return "";
  {
    // Under the lock: depart() frees the communicator (and nulls it) under it, maybe on
    // another thread while this one waits.
    auto guard = lock();
    if (s.comm == MPI_COMM_NULL) return "";
    while (receive_notice(s.comm, MPI_ANY_SOURCE)) {
    }
  }
  std::lock_guard<std::mutex> g(s.mutex);
  for (int member : world_ranks) {
    auto it = s.departed.find(member);
    if (it == s.departed.end()) continue;
    auto started = it->second.started.find(group_id);
    const int64_t n = started == it->second.started.end() ? 0 : started->second;
    if (n > seq) continue;
    const bool exited = it->second.how == Departure::Exit;
    // Appended piece by piece: GCC 12 warns (-Wrestrict) on "literal" + std::string.
    std::string text = "world rank ";
    text += std::to_string(member);
    text += exited ? " has left the job (it exited without calling tessera::finalize(), so the "
                     "at-exit finalize ran)"
                   : " has left the job (it called tessera::finalize())";
    text += " having started ";
    text += std::to_string(n);
    text += n == 1 ? " collective" : " collectives";
    text += " on group '";
    text += name;
    text += "', and this is collective #";
    text += std::to_string(seq + 1);
    text +=
        " there: it will never join. A rank left early, or skipped a collective the others "
        "made";
    return text;
  }
  return "";
}

}  // namespace tessera::detail
