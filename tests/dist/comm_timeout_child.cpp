// A two-rank job that test_comm_errors starts under mpirun to watch failures end the job:
//   comm_timeout_child <mode> <timeout seconds | env>
//   ok        both ranks all_reduce; rank 0 prints "child ok: <value>"; exits 0
//   timeout   rank 1 never joins the all_reduce: the collective timeout must abort the job
//   throw     rank 1 throws an uncaught error: the terminate handler must abort the job
//   mismatch  rank 0 all_reduces [4, 4], rank 1 [4, 5]: under TESSERA_DEBUG_COLLECTIVES=1 both
//             throw, uncaught, and the job aborts
// "env" leaves the timeout to TESSERA_COLLECTIVE_TIMEOUT.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "tessera/comm/comm.h"
#include "tessera/core/factory.h"

int main(int argc, char** argv) {
  tessera::Runtime runtime(argc, argv);
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s ok|timeout|throw|mismatch <timeout seconds|env>\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  if (std::string(argv[2]) != "env") tessera::set_collective_timeout_seconds(std::atof(argv[2]));
  const int rank = tessera::world_rank();
  // A named group, so the timeout message has a group name of our choosing to look for.
  auto group = tessera::world_group()->split(0, rank, "stuck_group");
  const int64_t cols = mode == "mismatch" && rank == 1 ? 5 : 4;
  tessera::Tensor t = tessera::full({4, cols}, rank + 1, tessera::DType::Float32);

  if (rank == 1 && mode == "timeout") {
    // Outlives any sane timeout: only an abort of the whole job ends this rank early.
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  if (rank == 1 && mode == "throw") TESSERA_FAIL("child rank 1 fails on purpose");

  group->all_reduce(t, tessera::ReduceOp::Sum)->wait();
  if (rank == 0) std::printf("child ok: %g\n", double(t.to_vector<float>()[0]));
  return 0;
}
