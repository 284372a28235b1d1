// The reducing and gathering collectives of the MPI group. Each takes arguments the wrapping
// CheckedProcessGroup has checked on every rank, picks MPI buffers that avoid copies when the
// tensors allow it, and starts one non-blocking MPI call.
#include "buffers.h"
#include "mpi_process_group.h"
#include "mpi_state.h"
#include "mpi_types.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"

namespace tessera::mpi {

namespace {

// A contiguous tensor to receive `out`'s values: `out` itself when MPI can write it directly.
Tensor receive_buffer(const Tensor& out, const std::vector<ByteRange>& send_ranges) {
  if (out.is_contiguous() && !any_overlap({byte_range(out)}, send_ranges)) return out;
  return empty(out.shape(), out.dtype());
}

// What to do once the reduction landed in `buf`: Avg divides, staged results are copied out.
MpiWork::Completion finish_reduction(Tensor buf, Tensor out, ReduceOp op, int size) {
  return [buf, out, op, size](const std::vector<MPI_Status>&) mutable {
    if (op == ReduceOp::Avg) divide(buf.raw_data(), buf.numel(), buf.dtype(), size);
    if (!buf.is_same(out)) out.copy_(buf);
  };
}

}  // namespace

WorkPtr MpiProcessGroup::all_reduce(Tensor& t, ReduceOp op) {
  constexpr const char* kOp = "all_reduce";
  enter(kOp);
  check_cpu(t, kOp, "the tensor");
  CallInfo call = tensor_call(OpKind::AllReduce, t.dtype(), t.shape());
  call.reduce = op;
  const int count = to_count(t.numel(), kOp);
  Tensor buf = t.contiguous();
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    check(MPI_Iallreduce(MPI_IN_PLACE, buf.raw_data(), count, datatype(t.dtype()),
                         reduce_op(op, t.dtype()), comm_->comm, work->new_request()),
          "MPI_Iallreduce", where(kOp));
  }
  work->then(finish_reduction(buf, t, op, size()));
  return work;
}

WorkPtr MpiProcessGroup::all_gather_into_tensor(Tensor& out, const Tensor& in) {
  constexpr const char* kOp = "all_gather_into_tensor";
  enter(kOp);
  check_cpu(out, kOp, "the output");
  check_cpu(in, kOp, "the input");
  CallInfo call = tensor_call(OpKind::AllGatherIntoTensor, in.dtype(), in.shape());
  call.out_shape = out.shape();
  const int64_t count = in.numel();
  to_count(count, kOp);
  to_count(out.numel(), kOp);

  Tensor recv = out.is_contiguous() ? out : empty(out.shape(), out.dtype());
  const Tensor flat = kernels::reshape(recv, {recv.numel()});
  auto slot = [&](int r) { return kernels::narrow(flat, 0, int64_t(r) * count, count); };
  Tensor own = slot(rank());
  // FSDP gathers a shard that is a view of its own slot in the output: nothing to copy. Any
  // other overlap would alias MPI's buffers, so the input is copied.
  const bool in_place = count > 0 && in.is_contiguous() && in.raw_data() == own.raw_data();
  Tensor send = in;
  if (!in_place && !(in.is_contiguous() && !overlaps(byte_range(in), byte_range(recv))))
    send = in.clone();

  // Through MPI_Ialltoallw rather than MPI_Iallgather: Open MPI's non-blocking all-gather took
  // 1.4-1.6x its blocking one at 1 MiB on 2 ranks (1.03-1.15x at 4-64 MiB), and an exchange of
  // the same pieces with this rank's own piece copied after it, not during it, matches the
  // blocking one (a rank busy copying does not answer its peer's single-copy handshake).
  const size_t n = size_t(size()), me = size_t(rank());
  auto args = std::make_shared<AllToAllW>(n);
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    if (count > 0) {
      const MPI_Datatype piece = args->types.add(send);
      for (size_t r = 0; r < n; ++r) {
        if (r == me) continue;
        args->send_types[r] = piece;
        args->send_counts[r] = 1;
        args->recv_types[r] = args->types.add(slot(int(r)));
        args->recv_counts[r] = 1;
      }
    }
    check(MPI_Ialltoallw(MPI_BOTTOM, args->send_counts.data(), args->displs.data(),
                         args->send_types.data(), MPI_BOTTOM, args->recv_counts.data(),
                         args->displs.data(), args->recv_types.data(), comm_->comm,
                         work->new_request()),
          "MPI_Ialltoallw", where(kOp));
  }
  // The lambda keeps MPI's arguments and the buffers until MPI is done with them.
  work->then([args, send, own, recv, out, in_place](const std::vector<MPI_Status>&) mutable {
    if (!in_place) own.copy_(kernels::reshape(send, own.shape()));
    if (!recv.is_same(out)) out.copy_(recv);
  });
  return work;
}

WorkPtr MpiProcessGroup::all_gather(std::vector<Tensor>& outputs, const Tensor& in) {
  constexpr const char* kOp = "all_gather";
  enter(kOp);
  check_cpu(in, kOp, "the input");
  check_cpu(outputs, kOp, "outputs");
  CallInfo call = tensor_call(OpKind::AllGather, in.dtype(), in.shape());
  call.pieces = int64_t(outputs.size());
  const int count = to_count(in.numel(), kOp);

  auto recv = std::make_shared<FlatList>(flat_recv(outputs, in.dtype(), kOp));
  const char* mine = static_cast<const char*>(recv->base) +
                     int64_t(recv->displs[size_t(rank())]) * int64_t(in.element_size());
  Tensor send;
  const void* send_ptr = MPI_IN_PLACE;
  if (!(count > 0 && !recv->staging.defined() && in.is_contiguous() && in.raw_data() == mine)) {
    send = in.is_contiguous() && !any_overlap({byte_range(in)}, recv->ranges) ? in : in.clone();
    send_ptr = send.raw_data();
  }
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    const MPI_Datatype type = datatype(in.dtype());
    check(MPI_Iallgatherv(send_ptr, count, type, recv->base, recv->counts.data(),
                          recv->displs.data(), type, comm_->comm, work->new_request()),
          "MPI_Iallgatherv", where(kOp));
  }
  work->keep_alive(send);
  // Copies of the tensor handles, so the caller's vector need not outlive the work.
  work->then([recv, outs = outputs](const std::vector<MPI_Status>&) { unpack(*recv, outs); });
  return work;
}

WorkPtr MpiProcessGroup::reduce_scatter_tensor(Tensor& out, const Tensor& in, ReduceOp op) {
  constexpr const char* kOp = "reduce_scatter_tensor";
  enter(kOp);
  check_cpu(out, kOp, "the output");
  check_cpu(in, kOp, "the input");
  CallInfo call = tensor_call(OpKind::ReduceScatterTensor, in.dtype(), in.shape());
  call.reduce = op;
  call.out_shape = out.shape();
  const int count = to_count(out.numel(), kOp);
  to_count(in.numel(), kOp);

  // MPI_IN_PLACE would read the whole input from the output buffer, which never matches a
  // caller's layout: overlapping buffers are separated by receiving into a fresh one.
  Tensor send = in.contiguous();
  Tensor recv = receive_buffer(out, {byte_range(send)});
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    check(MPI_Ireduce_scatter_block(send.raw_data(), recv.raw_data(), count, datatype(in.dtype()),
                                    reduce_op(op, in.dtype()), comm_->comm, work->new_request()),
          "MPI_Ireduce_scatter_block", where(kOp));
  }
  work->keep_alive(send);
  work->then(finish_reduction(recv, out, op, size()));
  return work;
}

WorkPtr MpiProcessGroup::reduce_scatter(Tensor& out, const std::vector<Tensor>& inputs,
                                        ReduceOp op) {
  constexpr const char* kOp = "reduce_scatter";
  enter(kOp);
  check_cpu(out, kOp, "the output");
  check_cpu(inputs, kOp, "inputs");
  CallInfo call = tensor_call(OpKind::ReduceScatter, out.dtype(), out.shape());
  call.reduce = op;
  call.pieces = int64_t(inputs.size());
  to_count(out.numel(), kOp);

  auto send = std::make_shared<FlatList>(flat_send(inputs, out.dtype(), true, kOp));
  Tensor recv = receive_buffer(out, send->ranges);
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    check(
        MPI_Ireduce_scatter(send->base, recv.raw_data(), send->counts.data(), datatype(out.dtype()),
                            reduce_op(op, out.dtype()), comm_->comm, work->new_request()),
        "MPI_Ireduce_scatter", where(kOp));
  }
  MpiWork::Completion finish = finish_reduction(recv, out, op, size());
  work->then([send, finish](const std::vector<MPI_Status>& st) { finish(st); });
  return work;
}

WorkPtr MpiProcessGroup::all_to_all(std::vector<Tensor>& outputs,
                                    const std::vector<Tensor>& inputs) {
  constexpr const char* kOp = "all_to_all";
  enter(kOp);
  check_cpu(inputs, kOp, "inputs");
  check_cpu(outputs, kOp, "outputs");
  const DType dt = inputs[0].dtype();
  const size_t me = size_t(rank());
  CallInfo call = tensor_call(OpKind::AllToAll, dt, inputs[me].shape());
  call.pieces = int64_t(inputs.size());

  // Pieces go to MPI where they lie, described by datatypes, rather than packed into one
  // buffer: the strided pieces of a reshard (a column block of each row) would otherwise cost a
  // full extra copy. Inputs that overlap an output, or that datatypes cannot describe, are
  // copied first; outputs MPI must not write in place are received into fresh tensors.
  std::vector<ByteRange> in_ranges, out_ranges;
  for (size_t r = 0; r < inputs.size(); ++r) {
    in_ranges.push_back(byte_range(inputs[r]));
    out_ranges.push_back(byte_range(outputs[r]));
    to_count(inputs[r].numel(), kOp);
    to_count(outputs[r].numel(), kOp);
  }
  // Byte ranges first (cheap); interleaved views of one tensor (its column blocks) overlap there
  // without sharing elements, which the exact pairwise test tells apart.
  auto any_shared = [](const std::vector<Tensor>& x, const std::vector<Tensor>& y, bool same) {
    for (size_t i = 0; i < x.size(); ++i) {
      for (size_t j = same ? i + 1 : 0; j < y.size(); ++j) {
        if (share_memory(x[i], y[j])) return true;
      }
    }
    return false;
  };
  const bool copy_inputs = any_overlap(in_ranges, out_ranges) && any_shared(inputs, outputs, false);
  // Outputs that share memory are written in rank order, the last piece winning, which MPI
  // cannot promise.
  const bool stage_outputs = pieces_overlap(out_ranges) && any_shared(outputs, outputs, true);
  std::vector<Tensor> sends = inputs, recvs = outputs;
  for (size_t r = 0; r < inputs.size(); ++r) {
    bool negative = false;
    for (int64_t d = 0; d < inputs[r].dim(); ++d)
      negative = negative || (inputs[r].stride(d) < 0 && inputs[r].size(d) > 1);
    if (copy_inputs || negative) sends[r] = inputs[r].clone();
    if (stage_outputs || !writable_in_place(outputs[r])) recvs[r] = empty(outputs[r].shape(), dt);
  }

  const size_t n = size_t(size());
  auto args = std::make_shared<AllToAllW>(n);
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    for (size_t r = 0; r < n; ++r) {
      // This rank's own piece is copied below, straight from input to output, while the
      // others travel; through MPI it would be packed and unpacked.
      if (r == me) continue;
      if (sends[r].numel() > 0) {
        args->send_types[r] = args->types.add(sends[r]);
        args->send_counts[r] = 1;
      }
      if (recvs[r].numel() > 0) {
        args->recv_types[r] = args->types.add(recvs[r]);
        args->recv_counts[r] = 1;
      }
    }
    check(MPI_Ialltoallw(MPI_BOTTOM, args->send_counts.data(), args->displs.data(),
                         args->send_types.data(), MPI_BOTTOM, args->recv_counts.data(),
                         args->displs.data(), args->recv_types.data(), comm_->comm,
                         work->new_request()),
          "MPI_Ialltoallw", where(kOp));
  }
  // Only the element counts of the two must agree, as for the pieces that travel.
  recvs[me].copy_(sends[me].shape() == recvs[me].shape()
                      ? sends[me]
                      : kernels::reshape(sends[me], recvs[me].shape()));
  // The lambda keeps the copied inputs, staged outputs and MPI's arguments until MPI is done.
  work->then([args, sends, recvs, outs = outputs](const std::vector<MPI_Status>&) mutable {
    for (size_t r = 0; r < outs.size(); ++r) {
      if (!recvs[r].is_same(outs[r])) outs[r].copy_(recvs[r]);
    }
  });
  return work;
}

}  // namespace tessera::mpi
