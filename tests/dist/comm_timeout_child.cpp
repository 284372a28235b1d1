// A two-rank job that test_comm_errors starts under mpirun to watch failures end the job:
//   comm_timeout_child <mode> <timeout seconds | env>
//   ok        both ranks all_reduce; rank 0 prints "child ok: <value>"; exits 0
//   timeout   rank 1 never joins the all_reduce: the collective timeout must abort the job
//   throw     rank 1 throws an uncaught error: the terminate handler must abort the job
//   mismatch  rank 0 all_reduces [4, 4], rank 1 [4, 5]: under TESSERA_DEBUG_COLLECTIVES=1 both
//             throw, uncaught, and the job aborts
//   gather_shapes    rank 0 all-gathers [2] per rank, rank 1 [3]: MPI's truncation error
//                    becomes a Tessera message (no debug check needed)
//   exit      rank 1 calls exit() while rank 0 enters the all_reduce: the job ends promptly,
//             naming rank 1
//   exit_all  every rank calls exit(0) after the all_reduce (no finalize): a normal end
//   skip      rank 1 skips the first of two all-reduces and returns from main: the job ends
//             promptly, naming rank 1 and the collective it never started
//   broadcast_roots  each rank broadcasts as root: completes, each keeping its own value (only
//                    the debug check catches it)
//   nccl_timeout  as timeout, on cuda:0 tensors over the NCCL backend (emulated NCCL on the
//                 stand-in device): the watchdog must abort the communicator, then the job
//   failed_wait_progress  as gather_shapes, but rank 0 catches the error its wait() throws (the
//                         progress thread found it first), drops the work, and both ranks then
//                         all_reduce: exits 0 with "child ok: 3"
//   failed_wait_direct    the same with the error found by wait() itself
//   failed_wait_polled    the same with the error thrown by is_completed()
//   failed_wait_staged    the same over the host-staged group on the stand-in cuda:0
//   work_past_finalize    each rank keeps a completed but unwaited host-staged work (stand-in
//                         cuda:0) until after tessera::finalize(), then drops it: exits 0
//   refused   rank 1's all_reduce is refused by the MPI group itself (a stand-in cuda:0 tensor),
//             caught, and rank 1 ends normally while rank 0 enters its all_reduce: the job ends
//             promptly, rank 1 counted as having started no collective
// "env" leaves the timeout to TESSERA_COLLECTIVE_TIMEOUT.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <thread>

#include "tessera/comm/comm.h"
#include "tessera/core/factory.h"
#include "tessera/testing/stand_in_device.h"

namespace {

using tessera::DType;
using tessera::ProcessGroupPtr;
using tessera::Tensor;
using tessera::WorkPtr;

// Lets the progress thread poll `work` until it needs no more polling (its transfers ended, or
// failed), so that the failure, if any, is the one the thread stored.
void progress_until_done(const WorkPtr& work) {
  tessera::progress_in_background(work);
  while (work->needs_polling())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// failed_wait_<how>: rank 0 all-gathers 2 elements per rank, rank 1 gathers 3, so rank 0's
// wait() throws MPI's truncation. Rank 0 catches it and drops the work; the job must go on.
int failed_wait(const ProcessGroupPtr& group, const std::string& how) {
  const int rank = group->rank();
  std::optional<tessera::testing::StandInDevice> device;
  if (how == "staged") device.emplace();
  {
    const ProcessGroupPtr g = how == "staged" ? tessera::host_staged_group(group) : group;
    const int64_t n = rank == 0 ? 2 : 3;
    Tensor in = tessera::full({n}, rank + 1, DType::Float32);
    Tensor out = tessera::empty({2 * n}, DType::Float32);
    if (device) {
      in = in.to(tessera::Device::cuda(0));
      out = out.to(tessera::Device::cuda(0));
    }
    WorkPtr work = g->all_gather_into_tensor(out, in);
    if (how != "direct" && how != "polled") progress_until_done(work);
    try {
      // polled: the caller asks is_completed() until it is, or throws.
      while (how == "polled" && !work->is_completed())
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      work->wait();
      std::printf("rank %d gathered\n", rank);
    } catch (const std::exception& e) {
      std::printf("rank %d caught: %s\n", rank, e.what());
    }
  }  // the work is dropped here
  Tensor t = tessera::full({4}, rank + 1, DType::Float32);
  group->all_reduce(t, tessera::ReduceOp::Sum)->wait();
  if (rank == 0) std::printf("child ok: %g\n", double(t.to_vector<float>()[0]));
  return 0;
}

// work_past_finalize: a completed host-staged work that nobody waited for outlives the runtime.
int work_past_finalize(const ProcessGroupPtr& group) {
  const int rank = group->rank();
  tessera::testing::StandInDevice device;
  {
    Tensor d = tessera::full({4}, rank + 1, DType::Float32).to(tessera::Device::cuda(0));
    WorkPtr work = tessera::host_staged_group(group)->all_reduce(d, tessera::ReduceOp::Sum);
    progress_until_done(work);
    tessera::finalize();
    std::printf("rank %d finalized with an unwaited work\n", rank);
  }  // the work is dropped here
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  tessera::Runtime runtime(argc, argv);
  if (argc != 3) {
    std::fprintf(
        stderr,
        "usage: %s ok|timeout|throw|mismatch|exit|exit_all|skip|gather_shapes|broadcast_roots|"
        "nccl_timeout|failed_wait_progress|failed_wait_direct|failed_wait_polled|"
        "failed_wait_staged|work_past_finalize|refused <timeout seconds|env>\n",
        argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  if (std::string(argv[2]) != "env") tessera::set_collective_timeout_seconds(std::atof(argv[2]));
  const int rank = tessera::world_rank();
  // A named group, so the timeout message has a group name of our choosing to look for.
  auto group = tessera::world_group()->split(0, rank, "stuck_group");
  const int64_t cols = mode == "mismatch" && rank == 1 ? 5 : 4;
  tessera::Tensor t = tessera::full({4, cols}, rank + 1, tessera::DType::Float32);

  if (mode.rfind("failed_wait_", 0) == 0) return failed_wait(group, mode.substr(12));
  if (mode == "work_past_finalize") return work_past_finalize(group);
  if (mode == "nccl_timeout") {
    tessera::testing::use_emulated_nccl();
    tessera::testing::StandInDevice device;
    auto cuda = tessera::world_group(tessera::DeviceType::CUDA)->split(0, rank, "stuck_group");
    tessera::Tensor d = t.to(tessera::Device::cuda(0));
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(120));
      return 0;
    }
    cuda->all_reduce(d, tessera::ReduceOp::Sum)->wait();
    return 0;
  }
  if (rank == 1 && mode == "timeout") {
    // Outlives any sane timeout: only an abort of the whole job ends this rank early.
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  if (rank == 1 && mode == "throw") TESSERA_FAIL("child rank 1 fails on purpose");
  if (mode == "gather_shapes") {
    // Rank 0 gathers 2 elements per rank, rank 1 gathers 3.
    const int64_t n = rank == 0 ? 2 : 3;
    tessera::Tensor in = tessera::full({n}, rank + 1, tessera::DType::Float32);
    tessera::Tensor out = tessera::empty({2 * n}, tessera::DType::Float32);
    group->all_gather_into_tensor(out, in)->wait();
    std::printf("rank %d gathered\n", rank);
    return 0;
  }
  if (mode == "broadcast_roots") {
    // Each rank names itself the root: MPI completes it, each rank keeping its own value.
    tessera::Tensor b = tessera::full({3}, rank + 1, tessera::DType::Float32);
    group->broadcast(b, rank)->wait();
    std::printf("rank %d holds %g after the broadcast\n", rank, double(b.to_vector<float>()[0]));
    return 0;
  }

  if (mode == "exit" && rank == 1) std::exit(3);  // the others are about to all_reduce
  if (mode == "refused" && rank == 1) {
    tessera::testing::StandInDevice device;
    tessera::Tensor d = t.to(tessera::Device::cuda(0));
    try {
      group->all_reduce(d, tessera::ReduceOp::Sum);
    } catch (const std::exception& e) {
      std::printf("rank 1 caught: %s\n", e.what());
    }
    return 0;
  }
  // Rank 1 skips the first of two all-reduces and ends normally: rank 0's first one pairs with
  // rank 1's only one, and its second can never complete.
  if (mode != "skip" || rank != 1) group->all_reduce(t, tessera::ReduceOp::Sum)->wait();
  if (mode == "skip") group->all_reduce(t, tessera::ReduceOp::Sum)->wait();
  if (rank == 0) std::printf("child ok: %g\n", double(t.to_vector<float>()[0]));
  if (mode == "exit_all") std::exit(0);  // every rank, after the last collective: a normal end
  return 0;
}
