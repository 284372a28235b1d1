#pragma once
// Background progress for communication issued ahead of time. MPI moves a non-blocking operation
// forward only while some thread of the process is inside an MPI call, so a Work issued early (a
// prefetching all-gather, a reduce-scatter left running during backward) would otherwise sit
// idle until wait() and hide nothing. c10d's MPI backend answers this with a worker thread that
// runs blocking collectives; here the collectives stay non-blocking and one thread polls them.
#include <vector>

#include "tessera/comm/process_group.h"

namespace tessera {

// Hands `work` to the progress thread (started on first use), which polls it (Work::poll) about
// every 100 microseconds until its transfers complete. wait() is still needed: it finishes the
// work on the caller's thread (copying staged results, dividing for Avg) and reports errors. A
// no-op for a work that does not need polling (Work::needs_polling): a completed one, one whose
// backend moves it by itself, and an MPI one when MPI granted less than MPI_THREAD_SERIALIZED
// (then only the initialising thread may call MPI, and the work progresses inside wait()).
void progress_in_background(const WorkPtr& work);

// What the progress thread has cost since the process started: the CPU time it used (polling,
// and the copies MPI makes inside its polls), and how many polls it made. A rank whose thread
// shares its core pays this time out of its computation; benchmarks report it per step.
//
// Where it runs: a rank bound to CPUs of its own (Open MPI binds each rank to a core when it
// starts 2 or fewer) would bind the thread with it while other CPUs sit idle, so tessera::init
// gives the thread a share of the CPUs of the job that no rank on the node is bound to
// (TESSERA_PROGRESS_CPUS=auto, the default; =inherit keeps it on the rank's CPUs). `cpus` lists
// the CPUs it was moved to, once started; empty while it runs on the rank's own.
struct ProgressStats {
  double cpu_seconds = 0;
  int64_t polls = 0;
  std::vector<int> cpus;
};
ProgressStats progress_stats();

}  // namespace tessera
