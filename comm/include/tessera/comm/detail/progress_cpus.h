#pragma once
// Where the progress thread behind tessera::progress_in_background runs. The policy is a pure
// function of the node's layout, here so that tests can give it any machine's.
//
// Why it moves at all: a launcher that binds each rank to a core (Open MPI does for 2 ranks or
// fewer) binds every thread of the rank with it, so the copies MPI makes inside the progress
// thread's polls are taken from that core's computation while other cores sit idle, and a
// prefetch that hides a wait makes the step no faster. The job's CPUs that no rank of the node is
// bound to are spare; the progress threads run there. A rank's own binding is never changed.
#include <string>
#include <vector>

namespace tessera::detail {

// CPU numbers, ascending and distinct.
using CpuList = std::vector<int>;

// The kernel's list format ("0-3,8,10-11", as in /sys/devices/system/cpu/online) to a CpuList;
// malformed text is an error naming `what` and the text.
CpuList parse_cpu_list(const std::string& text, const std::string& what);
std::string format_cpu_list(const CpuList& cpus);

// The CPUs for the progress thread of local rank `me`, given the affinity of every rank on this
// node (indexed by local rank) and the CPUs the job may use on it. Empty: the thread keeps its
// rank's affinity, because no CPU is spare (the ranks are not bound, or are bound to all of them).
// Spare CPUs are shared out so that progress threads do not compete with each other: with at
// least as many spare CPUs as ranks each thread gets a block of its own, otherwise the ranks
// take turns over them, one CPU each.
CpuList progress_cpus_for(const std::vector<CpuList>& local_ranks, int me,
                          const CpuList& available);

// What tessera::init chose for this rank's progress thread (TESSERA_PROGRESS_CPUS): empty when
// it stays on the rank's CPUs.
CpuList planned_progress_cpus();

}  // namespace tessera::detail
