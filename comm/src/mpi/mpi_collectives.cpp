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
    if (!buf.is_same(out)) out.detach().copy_(buf);
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
  to_count(out.numel(), kOp);
  // The slots of a contiguous output; FSDP's shard is a view of its own slot, which then needs
  // no copy at all.
  Tensor recv = out.is_contiguous() ? out : empty(out.shape(), out.dtype());
  const Tensor flat = kernels::reshape(recv, {recv.numel()});
  std::vector<Tensor> slots;
  for (int r = 0; r < size(); ++r)
    slots.push_back(kernels::narrow(flat, 0, int64_t(r) * in.numel(), in.numel()));
  auto work = start_exchange(kOp, std::move(call), std::vector<Tensor>(size_t(size()), in), slots);
  if (!recv.is_same(out)) {
    work->then([recv, out](const std::vector<MPI_Status>&) mutable { out.detach().copy_(recv); });
  }
  return work;
}

WorkPtr MpiProcessGroup::all_gather(std::vector<Tensor>& outputs, const Tensor& in) {
  constexpr const char* kOp = "all_gather";
  enter(kOp);
  check_cpu(in, kOp, "the input");
  check_cpu(outputs, kOp, "outputs");
  CallInfo call = tensor_call(OpKind::AllGather, in.dtype(), in.shape());
  call.pieces = int64_t(outputs.size());
  return start_exchange(kOp, std::move(call), std::vector<Tensor>(size_t(size()), in), outputs);
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

  auto send = std::make_shared<FlatList>(flat_send(inputs, out.dtype(), true, where(kOp).c_str()));
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
  CallInfo call = tensor_call(OpKind::AllToAll, inputs[0].dtype(), inputs[size_t(rank())].shape());
  call.pieces = int64_t(inputs.size());
  return start_exchange(kOp, std::move(call), inputs, outputs);
}

std::shared_ptr<MpiWork> MpiProcessGroup::start_exchange(const char* op, CallInfo call,
                                                         const std::vector<Tensor>& inputs,
                                                         const std::vector<Tensor>& outputs) const {
  const DType dt = inputs[0].dtype();
  const size_t n = inputs.size(), me = size_t(rank());
  // Pieces go to MPI where they lie, described by datatypes, rather than packed into one
  // buffer: the strided pieces of a reshard (a column block of each row) would otherwise cost a
  // full extra copy. This rank's own piece is copied by us after the exchange: through MPI it
  // would be packed and unpacked, and copied while the others travel it delays them (a rank busy
  // copying does not answer its peer's single-copy handshake; Open MPI's MPI_Iallgather, which
  // does that, took 1.4-1.6x its blocking all-gather at 1 MiB on 2 ranks).
  std::vector<ByteRange> out_ranges;
  for (size_t r = 0; r < n; ++r) {
    to_count(inputs[r].numel(), op);
    to_count(outputs[r].numel(), op);
    out_ranges.push_back(byte_range(outputs[r]));
  }
  // Byte ranges first (cheap); interleaved views of one tensor (its column blocks) overlap there
  // without sharing elements, which the exact pairwise test tells apart.
  auto shares_with_others = [&](const Tensor& t, size_t skip) {
    const ByteRange range = byte_range(t);
    for (size_t r = 0; r < n; ++r) {
      if (r != skip && overlaps(range, out_ranges[r]) && share_memory(t, outputs[r])) return true;
    }
    return false;
  };
  // Outputs that share memory are written in rank order, the last piece winning, which MPI
  // cannot promise: they are received into fresh tensors, as are outputs MPI cannot write where
  // they lie.
  bool stage_outputs = false;
  if (pieces_overlap(out_ranges)) {
    for (size_t r = 0; r < n && !stage_outputs; ++r)
      stage_outputs = shares_with_others(outputs[r], r);
  }
  std::vector<Tensor> sends = inputs, recvs = outputs;
  for (size_t r = 0; r < n; ++r) {
    if (r > 0 && inputs[r].is_same(inputs[r - 1])) {
      sends[r] = sends[r - 1];  // an all-gather's one input, decided (and copied) once
    } else {
      bool negative = false;
      for (int64_t d = 0; d < inputs[r].dim(); ++d)
        negative = negative || (inputs[r].stride(d) < 0 && inputs[r].size(d) > 1);
      // An input must not share memory with what MPI writes (every other rank's output); the
      // one copied to this rank's own output after the exchange must be that output or apart
      // from it.
      const bool copied_after = inputs[r].is_same(inputs[me]);
      const bool shared = shares_with_others(inputs[r], me) ||
                          (copied_after && share_memory(inputs[r], outputs[me]) &&
                           !same_elements(inputs[r], outputs[me]));
      if (negative || shared) sends[r] = inputs[r].clone();
    }
    if (stage_outputs || !writable_in_place(outputs[r])) recvs[r] = empty(outputs[r].shape(), dt);
  }

  auto args = std::make_shared<AllToAllW>(n);
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    for (size_t r = 0; r < n; ++r) {
      if (r == me) continue;
      if (sends[r].numel() > 0) {
        args->send_types[r] = r > 0 && sends[r].is_same(sends[r - 1]) && args->send_counts[r - 1]
                                  ? args->send_types[r - 1]
                                  : args->types.add(sends[r]);
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
          "MPI_Ialltoallw", where(op));
  }
  // The lambda keeps the copied inputs, staged outputs and MPI's arguments until MPI is done.
  work->then([args, sends, recvs, me, outs = outputs](const std::vector<MPI_Status>&) mutable {
    if (!same_elements(sends[me], recvs[me]))
      recvs[me].detach().copy_(sends[me].shape() == recvs[me].shape()
                                   ? sends[me]
                                   : kernels::reshape(sends[me], recvs[me].shape()));
    for (size_t r = 0; r < outs.size(); ++r) {
      if (!recvs[r].is_same(outs[r])) outs[r].detach().copy_(recvs[r]);
    }
  });
  return work;
}

}  // namespace tessera::mpi
