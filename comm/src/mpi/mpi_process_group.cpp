// The MPI group itself: creation and split, argument checks shared by all operations, and the
// rooted and point-to-point operations. The reducing and gathering collectives are in
// mpi_collectives.cpp.
#include "mpi_process_group.h"

#include <numeric>

#include "buffers.h"
#include "mpi_state.h"
#include "mpi_types.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"

namespace tessera::mpi {

std::shared_ptr<MpiProcessGroup> MpiProcessGroup::create(MPI_Comm comm, std::string name) {
  const std::string context = "creating process group '" + name + "'";
  std::vector<int> world_ranks;
  int tag_ub = 32767;
  {
    auto guard = lock();
    // Errors come back as codes so they become tessera::Errors naming the call.
    check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", context);
    // Debuggers and MPI tools show this name; MPI caps its length.
    MPI_Comm_set_name(comm, name.substr(0, MPI_MAX_OBJECT_NAME - 1).c_str());

    int size = 0;
    MPI_Comm_size(comm, &size);
    MPI_Group group = MPI_GROUP_NULL;
    MPI_Group world = MPI_GROUP_NULL;
    MPI_Comm_group(comm, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> ranks(size_t(size), 0);
    std::iota(ranks.begin(), ranks.end(), 0);
    world_ranks.assign(size_t(size), 0);
    check(MPI_Group_translate_ranks(group, size, ranks.data(), world, world_ranks.data()),
          "MPI_Group_translate_ranks", context);
    MPI_Group_free(&group);
    MPI_Group_free(&world);

    void* attr = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(comm, MPI_TAG_UB, &attr, &flag);
    if (flag) tag_ub = *static_cast<int*>(attr);
  }
  auto c = std::make_shared<const Communicator>(comm, name);
  return std::shared_ptr<MpiProcessGroup>(
      new MpiProcessGroup(std::move(c), std::move(world_ranks), tag_ub));
}

MpiProcessGroup::MpiProcessGroup(CommunicatorPtr comm, std::vector<int> world_ranks, int tag_ub)
    : ProcessGroup(comm->rank, comm->size, std::move(world_ranks), comm->group_name),
      comm_(std::move(comm)),
      tag_ub_(tag_ub) {}

std::string MpiProcessGroup::where(const char* op) const {
  return std::string(op) + " on group '" + name() + "' (rank " + std::to_string(rank()) + " of " +
         std::to_string(size()) + ")";
}

void MpiProcessGroup::enter(const char* op) const {
  require_usable(op);
}

std::shared_ptr<MpiWork> MpiProcessGroup::make_work(CallInfo call) const {
  return std::make_shared<MpiWork>(comm_, std::move(call));
}

void MpiProcessGroup::check_cpu(const Tensor& t, const char* op, const char* what) const {
  TESSERA_CHECK(t.device().is_cpu(), where(op), ": ", what, " ", t.str(), " is on ",
                t.device().str(),
                "; the MPI group communicates CPU tensors (host_staged_group over it moves "
                "device tensors through host memory)");
}

void MpiProcessGroup::check_cpu(const std::vector<Tensor>& list, const char* op,
                                const char* what) const {
  for (size_t r = 0; r < list.size(); ++r)
    check_cpu(list[r], op, (std::string(what) + "[" + std::to_string(r) + "]").c_str());
}

void MpiProcessGroup::check_tag(int tag, const char* op) const {
  TESSERA_CHECK(tag >= 0 && tag <= tag_ub_, where(op), ": tag ", tag, " is outside MPI's 0..",
                tag_ub_);
}

std::shared_ptr<ProcessGroup> MpiProcessGroup::split(int color, int key, const std::string& name) {
  constexpr const char* kOp = "split";
  enter(kOp);
  MPI_Comm out = MPI_COMM_NULL;
  {
    auto guard = lock();
    check(MPI_Comm_split(comm_->comm, color < 0 ? MPI_UNDEFINED : color, key, &out),
          "MPI_Comm_split", where(kOp));
  }
  if (out == MPI_COMM_NULL) return nullptr;
  return create(out, name);
}

WorkPtr MpiProcessGroup::broadcast(Tensor& t, int root) {
  constexpr const char* kOp = "broadcast";
  enter(kOp);
  check_cpu(t, kOp, "the tensor");
  CallInfo call = tensor_call(OpKind::Broadcast, t.dtype(), t.shape());
  call.root = root;
  const int count = to_count(t.numel(), kOp);
  const bool staged = !t.is_contiguous();
  Tensor buf = !staged ? t : rank() == root ? t.clone() : empty(t.shape(), t.dtype());
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    check(MPI_Ibcast(buf.raw_data(), count, datatype(t.dtype()), root, comm_->comm,
                     work->new_request()),
          "MPI_Ibcast", where(kOp));
  }
  if (staged && rank() != root) {
    work->then([t, buf](const std::vector<MPI_Status>&) mutable { t.detach().copy_(buf); });
  }
  work->keep_alive(std::move(buf));
  return work;
}

WorkPtr MpiProcessGroup::scatter(Tensor& out, const std::vector<Tensor>& inputs, int root) {
  constexpr const char* kOp = "scatter";
  enter(kOp);
  check_cpu(out, kOp, "the output");
  check_cpu(inputs, kOp, "inputs");
  const DType dt = out.dtype();
  const bool is_root = rank() == root;
  CallInfo call = tensor_call(OpKind::Scatter, dt, out.shape());
  call.root = root;

  const int count = to_count(out.numel(), kOp);
  auto send = std::make_shared<FlatList>();
  if (is_root) *send = flat_send(inputs, dt, false, where(kOp).c_str());
  void* recv_ptr = nullptr;
  Tensor recv;
  const char* base = static_cast<const char*>(send->base);
  if (is_root && count > 0 && !send->staging.defined() && out.is_contiguous() &&
      out.raw_data() == base + int64_t(send->displs[size_t(root)]) * int64_t(out.element_size())) {
    // The root's own piece already is the output.
    recv_ptr = MPI_IN_PLACE;
  } else {
    const bool direct = out.is_contiguous() && !any_overlap({byte_range(out)}, send->ranges);
    recv = direct ? out : empty(out.shape(), dt);
    recv_ptr = recv.raw_data();
  }
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    check(MPI_Iscatterv(send->base, is_root ? send->counts.data() : nullptr,
                        is_root ? send->displs.data() : nullptr, datatype(dt), recv_ptr, count,
                        datatype(dt), root, comm_->comm, work->new_request()),
          "MPI_Iscatterv", where(kOp));
  }
  const bool staged = recv.defined() && !recv.is_same(out);
  // MPI reads the count and displacement arrays until completion, so the work owns them.
  work->then([send, recv, out, staged](const std::vector<MPI_Status>&) mutable {
    if (staged) out.detach().copy_(recv);
  });
  return work;
}

WorkPtr MpiProcessGroup::send(const Tensor& t, int dst, int tag) {
  constexpr const char* kOp = "send";
  enter(kOp);
  check_cpu(t, kOp, "the tensor");
  check_tag(tag, kOp);
  const int count = to_count(t.numel(), kOp);
  Tensor buf = t.contiguous();
  CallInfo call = tensor_call(OpKind::Send, t.dtype(), t.shape());
  call.peer = dst;
  call.tag = tag;
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    check(MPI_Isend(buf.raw_data(), count, datatype(t.dtype()), dst, tag, comm_->comm,
                    work->new_request()),
          "MPI_Isend", where(kOp));
  }
  work->keep_alive(std::move(buf));
  return work;
}

WorkPtr MpiProcessGroup::recv(Tensor& t, int src, int tag) {
  constexpr const char* kOp = "recv";
  enter(kOp);
  check_cpu(t, kOp, "the tensor");
  check_tag(tag, kOp);
  const int count = to_count(t.numel(), kOp);
  const bool staged = !t.is_contiguous();
  Tensor buf = staged ? empty(t.shape(), t.dtype()) : t;
  CallInfo call = tensor_call(OpKind::Recv, t.dtype(), t.shape());
  call.peer = src;
  call.tag = tag;
  auto work = make_work(std::move(call));
  {
    auto guard = lock();
    check(MPI_Irecv(buf.raw_data(), count, datatype(t.dtype()), src, tag, comm_->comm,
                    work->new_request()),
          "MPI_Irecv", where(kOp));
  }
  work->then([t, buf, staged, count, src, tag,
              what = where(kOp)](const std::vector<MPI_Status>& st) mutable {
    int got = 0;
    {
      auto guard = lock();
      MPI_Get_count(&st[0], datatype(t.dtype()), &got);
    }
    // A longer message fails as truncated inside MPI; a shorter one would leave stale values.
    TESSERA_CHECK(got == count, what, ": received ", got, " elements from rank ", src, " (tag ",
                  tag, ") but the tensor ", shape_str(t.shape()), " holds ", count);
    if (staged) t.detach().copy_(buf);
  });
  return work;
}

WorkPtr MpiProcessGroup::barrier() {
  constexpr const char* kOp = "barrier";
  enter(kOp);
  CallInfo call;
  call.op = OpKind::Barrier;
  auto work = make_work(call);
  {
    auto guard = lock();
    check(MPI_Ibarrier(comm_->comm, work->new_request()), "MPI_Ibarrier", where(kOp));
  }
  return work;
}

}  // namespace tessera::mpi
