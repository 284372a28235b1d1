// all_gather_runs: every rank's pieces go straight to their places in every output, described
// by MPI datatypes (one per rank) in one MPI_Ialltoallw, so nothing is staged or copied by us.
#include <memory>

#include "buffers.h"
#include "mpi_process_group.h"
#include "mpi_state.h"
#include "mpi_types.h"
#include "tessera/core/error.h"

namespace tessera::mpi {

namespace {

// The elements of `runs` at their `src` (or `dst`) offsets, in units of `element`. Call under
// lock(); null (count 0) when the runs are empty.
MPI_Datatype runs_type(const std::vector<GatherRun>& runs, bool source, MPI_Datatype element,
                       int64_t element_size, PlacedTypes& owned) {
  std::vector<int> lengths;
  std::vector<MPI_Aint> displacements;
  for (const GatherRun& r : runs) {
    if (r.length == 0) continue;
    lengths.push_back(int(r.length));
    displacements.push_back(MPI_Aint((source ? r.src : r.dst) * element_size));
  }
  if (lengths.empty()) return MPI_DATATYPE_NULL;
  MPI_Datatype t = MPI_DATATYPE_NULL;
  check(MPI_Type_create_hindexed(int(lengths.size()), lengths.data(), displacements.data(), element,
                                 &t),
        "MPI_Type_create_hindexed", "all_gather_runs");
  check(MPI_Type_commit(&t), "MPI_Type_commit", "all_gather_runs");
  return owned.adopt(t);
}

}  // namespace

WorkPtr MpiProcessGroup::all_gather_runs(Tensor& out, const Tensor& in,
                                         const std::vector<std::vector<GatherRun>>& runs) {
  constexpr const char* kOp = "all_gather_runs";
  enter(kOp);
  check_cpu(out, kOp, "the output");
  check_cpu(in, kOp, "the input");
  CallInfo call = tensor_call(OpKind::AllGatherRuns, in.dtype(), in.shape());
  call.out_shape = out.shape();

  auto args = std::make_shared<AllToAllW>(size_t(size()));
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    const MPI_Datatype element = datatype(in.dtype());
    const int64_t element_size = int64_t(in.element_size());
    const MPI_Datatype send =
        runs_type(runs[size_t(rank())], /*source=*/true, element, element_size, args->types);
    for (int r = 0; r < size(); ++r) {
      if (send != MPI_DATATYPE_NULL) {
        args->send_types[size_t(r)] = send;
        args->send_counts[size_t(r)] = 1;
      }
      const MPI_Datatype recv =
          runs_type(runs[size_t(r)], /*source=*/false, element, element_size, args->types);
      if (recv != MPI_DATATYPE_NULL) {
        args->recv_types[size_t(r)] = recv;
        args->recv_counts[size_t(r)] = 1;
      }
    }
    check(MPI_Ialltoallw(in.raw_data(), args->send_counts.data(), args->displs.data(),
                         args->send_types.data(), out.raw_data(), args->recv_counts.data(),
                         args->displs.data(), args->recv_types.data(), comm_->comm,
                         work->new_request()),
          "MPI_Ialltoallw", where(kOp));
  }
  work->keep_alive(in);
  work->keep_alive(out);
  // Released with the completion step, after MPI is done with the types and their arrays.
  work->then([args](const std::vector<MPI_Status>&) {});
  return work;
}

}  // namespace tessera::mpi
