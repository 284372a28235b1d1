// Chooses the CPUs of this rank's progress thread (tessera/comm/detail/progress_cpus.h) from
// the affinities of the ranks on this node, exchanged once at init.
#include "progress_placement.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <sstream>
#include <vector>

#include "../progress_thread.h"
#include "mpi_state.h"
#include "tessera/comm/detail/progress_cpus.h"
#include "tessera/core/error.h"

namespace tessera::mpi {

namespace {

detail::CpuList cpus_of(const cpu_set_t& set) {
  detail::CpuList cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The CPUs the job may use on this node: those online that the process which started this rank
// (mpirun, or srun's step daemon) may run on. A rank's own affinity cannot tell, once the
// launcher has narrowed it. Empty when either is unreadable.
detail::CpuList job_cpus() {
  std::istringstream status(read_file("/proc/" + std::to_string(getppid()) + "/status"));
  detail::CpuList parent;
  for (std::string line; std::getline(status, line);) {
    const std::string key = "Cpus_allowed_list:";
    const size_t value = line.find_first_not_of(" \t", key.size());
    if (line.compare(0, key.size(), key) == 0 && value != std::string::npos)
      parent = detail::parse_cpu_list(line.substr(value), "the launcher's Cpus_allowed_list");
  }
  const std::string online_text = read_file("/sys/devices/system/cpu/online");
  if (parent.empty() || online_text.empty()) return {};
  const detail::CpuList online =
      detail::parse_cpu_list(online_text, "/sys/devices/system/cpu/online");
  detail::CpuList both;
  for (int c : parent)
    if (std::binary_search(online.begin(), online.end(), c)) both.push_back(c);
  return both;
}

}  // namespace

void place_progress_thread(bool automatic) {
  // Every rank exchanges, whatever its own setting says: a collective only some ranks entered
  // would hang the others.
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (sched_getaffinity(0, sizeof(mine), &mine) != 0) CPU_ZERO(&mine);
  std::vector<cpu_set_t> all;
  int me = 0, n = 1;
  {
    auto guard = lock();
    MPI_Comm node = MPI_COMM_NULL;
    check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
          "MPI_Comm_split_type", "tessera::init (placing the progress thread)");
    MPI_Comm_rank(node, &me);
    MPI_Comm_size(node, &n);
    all.resize(size_t(n));
    const int rc = MPI_Allgather(&mine, int(sizeof(mine)), MPI_BYTE, all.data(), int(sizeof(mine)),
                                 MPI_BYTE, node);
    MPI_Comm_free(&node);
    check(rc, "MPI_Allgather", "tessera::init (placing the progress thread)");
  }
  if (!automatic) return;
  // A rank whose affinity is unknown counts as bound to everything: nothing is spare then.
  std::vector<detail::CpuList> ranks;
  for (const cpu_set_t& s : all)
    ranks.push_back(cpus_of(s));
  detail::CpuList available;
  try {
    available = job_cpus();
  } catch (const Error&) {
    available.clear();  // an unreadable layout leaves the thread where it is
  }
  for (detail::CpuList& r : ranks)
    if (r.empty()) r = available;
  detail::set_planned_progress_cpus(detail::progress_cpus_for(ranks, me, available));
}

}  // namespace tessera::mpi
