// The MPI group itself: creation and split, argument checks shared by all operations, and the
// rooted and point-to-point operations. The reducing and gathering collectives are in
// mpi_collectives.cpp.
#include "mpi_process_group.h"

#include "../op_counts.h"

#include <atomic>
#include <numeric>

#include "buffers.h"
#include "mpi_state.h"
#include "mpi_types.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"

namespace tessera::mpi {

namespace {

// A number naming the new group on every member, for departures.h: its rank 0's world rank and
// how many groups that rank had made before (collective over `comm`).
uint64_t agree_group_id(MPI_Comm comm, const std::string& context) {
  static std::atomic<uint32_t> made{0};
  int world_rank = 0;
  auto guard = lock();
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  uint64_t id = (uint64_t(uint32_t(world_rank)) << 32) | made.fetch_add(1);
  check(MPI_Bcast(&id, 1, MPI_UINT64_T, 0, comm), "MPI_Bcast", context);
  return id;
}

}  // namespace

std::shared_ptr<MpiProcessGroup> MpiProcessGroup::create(MPI_Comm comm, std::string name) {
  const std::string context = "creating process group '" + name + "'";
  MPI_Comm debug = MPI_COMM_NULL;
  std::vector<int> world_ranks;
  int tag_ub = 32767;
  {
    auto guard = lock();
    // Errors come back as codes so they become tessera::Errors naming the call.
    check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", context);
    // Debuggers and MPI tools show this name; MPI caps its length.
    MPI_Comm_set_name(comm, name.substr(0, MPI_MAX_OBJECT_NAME - 1).c_str());
    check(MPI_Comm_dup(comm, &debug), "MPI_Comm_dup", context);

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
  const uint64_t id = agree_group_id(comm, context);
  auto c = std::make_shared<const Communicator>(comm, name, id, world_ranks);
  auto d = std::make_shared<const Communicator>(debug, name, id, world_ranks);
  return std::shared_ptr<MpiProcessGroup>(
      new MpiProcessGroup(std::move(c), std::move(d), std::move(world_ranks), tag_ub));
}

MpiProcessGroup::MpiProcessGroup(CommunicatorPtr comm, CommunicatorPtr debug_comm,
                                 std::vector<int> world_ranks, int tag_ub)
    : ProcessGroup(comm->rank, comm->size, std::move(world_ranks), comm->group_name),
      comm_(std::move(comm)),
      debug_comm_(std::move(debug_comm)),
      tag_ub_(tag_ub) {}

std::string MpiProcessGroup::where(const char* op) const {
  return std::string(op) + " on group '" + name() + "' (rank " + std::to_string(rank()) + " of " +
         std::to_string(size()) + ")";
}

void MpiProcessGroup::enter(const char* op) const {
  detail::count_comm_op(op);
  require_usable(op);
}

int64_t MpiProcessGroup::start_collective(Signature sig) const {
  sig.call.seq = comm_->started->fetch_add(1);
  if (debug_collectives()) check_signatures(*debug_comm_, sig);
  return sig.call.seq;
}

std::shared_ptr<MpiWork> MpiProcessGroup::make_work(CallInfo call) const {
  return std::make_shared<MpiWork>(comm_, std::move(call));
}

void MpiProcessGroup::check_tensor(const Tensor& t, const char* op, const char* what) const {
  TESSERA_CHECK(t.defined(), where(op), ": ", what, " is an undefined tensor");
  TESSERA_CHECK(t.device().is_cpu(), where(op), ": ", what, " ", t.str(),
                " is not on the CPU; the MPI group communicates CPU tensors (there is no GPU "
                "communication yet: copy the tensor to the CPU first)");
}

void MpiProcessGroup::check_root(int root, const char* op, const char* what) const {
  TESSERA_CHECK(root >= 0 && root < size(), where(op), ": ", what, " ", root,
                " is not a rank of the group (valid: 0..", size() - 1, ")");
}

void MpiProcessGroup::check_list(const std::vector<Tensor>& list, DType dtype, const char* op,
                                 const char* what) const {
  TESSERA_CHECK(int64_t(list.size()) == size(), where(op), ": ", what, " has ", list.size(),
                " tensors but the group has ", size(), " ranks (one tensor per rank)");
  for (size_t r = 0; r < list.size(); ++r) {
    const std::string name = std::string(what) + "[" + std::to_string(r) + "]";
    check_tensor(list[r], op, name.c_str());
    TESSERA_CHECK(list[r].dtype() == dtype, where(op), ": ", name, " has dtype ",
                  dtype_name(list[r].dtype()), " but the operation's dtype is ", dtype_name(dtype));
  }
}

void MpiProcessGroup::check_reduce(ReduceOp reduce, DType dtype, const char* op) const {
  TESSERA_CHECK(!(dtype == DType::Bool && reduce == ReduceOp::Avg), where(op),
                ": reduce op avg is undefined for bool tensors (use sum for 'any', min for 'all')");
}

std::shared_ptr<ProcessGroup> MpiProcessGroup::split(int color, int key, const std::string& name) {
  constexpr const char* kOp = "split";
  enter(kOp);
  TESSERA_CHECK(!name.empty(), where(kOp), ": the new group needs a name");
  CallInfo call;
  call.op = OpKind::Split;
  call.seq = start_collective({call, {}, {}, 0});
  // MPI_Comm_split blocks with no timeout; a barrier that does time out first makes sure every
  // rank has arrived, so the split itself cannot hang.
  {
    std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
    std::vector<MPI_Status> st;
    {
      auto guard = lock();
      check(MPI_Ibarrier(comm_->comm, req.data()), "MPI_Ibarrier", where(kOp));
    }
    wait_all(req, st, [&] { return describe(call, *comm_); }, {comm_.get(), call.seq});
  }
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
  check_tensor(t, kOp, "the tensor");
  check_root(root, kOp, "root");
  CallInfo call = tensor_call(OpKind::Broadcast, t.dtype(), t.shape());
  call.root = root;
  call.seq = start_collective({call, {}, {}, t.numel()});
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
    work->then([t, buf](const std::vector<MPI_Status>&) mutable { t.copy_(buf); });
  }
  work->keep_alive(std::move(buf));
  return work;
}

WorkPtr MpiProcessGroup::scatter(Tensor& out, const std::vector<Tensor>& inputs, int root) {
  constexpr const char* kOp = "scatter";
  enter(kOp);
  check_tensor(out, kOp, "the output");
  check_root(root, kOp, "root");
  const DType dt = out.dtype();
  const bool is_root = rank() == root;
  Signature sig;
  if (is_root) {
    check_list(inputs, dt, kOp, "inputs");
    TESSERA_CHECK(inputs[size_t(root)].numel() == out.numel(), where(kOp), ": inputs[", root,
                  "] (the root's own piece) has shape ", shape_str(inputs[size_t(root)].shape()),
                  " but the output has shape ", shape_str(out.shape()));
    for (const Tensor& in : inputs)
      sig.send_counts.push_back(in.numel());
  } else {
    TESSERA_CHECK(inputs.empty(), where(kOp), ": only the root (rank ", root,
                  ") passes inputs, but this rank passed ", inputs.size(), " tensors");
  }
  sig.call = tensor_call(OpKind::Scatter, dt, out.shape());
  sig.call.root = root;
  sig.numel = out.numel();
  sig.call.seq = start_collective(sig);

  const int count = to_count(out.numel(), kOp);
  auto send = std::make_shared<FlatList>();
  if (is_root) *send = flat_send(inputs, dt, false, kOp);
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
  auto work = make_work(sig.call);
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
    if (staged) out.copy_(recv);
  });
  return work;
}

WorkPtr MpiProcessGroup::send(const Tensor& t, int dst, int tag) {
  constexpr const char* kOp = "send";
  enter(kOp);
  check_tensor(t, kOp, "the tensor");
  check_root(dst, kOp, "destination");
  TESSERA_CHECK(tag >= 0 && tag <= tag_ub_, where(kOp), ": tag ", tag, " is outside MPI's 0..",
                tag_ub_);
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
  check_tensor(t, kOp, "the tensor");
  check_root(src, kOp, "source");
  TESSERA_CHECK(tag >= 0 && tag <= tag_ub_, where(kOp), ": tag ", tag, " is outside MPI's 0..",
                tag_ub_);
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
    if (staged) t.copy_(buf);
  });
  return work;
}

WorkPtr MpiProcessGroup::barrier() {
  constexpr const char* kOp = "barrier";
  enter(kOp);
  CallInfo call;
  call.op = OpKind::Barrier;
  call.seq = start_collective({call, {}, {}, 0});
  auto work = make_work(call);
  {
    auto guard = lock();
    check(MPI_Ibarrier(comm_->comm, work->new_request()), "MPI_Ibarrier", where(kOp));
  }
  return work;
}

}  // namespace tessera::mpi
