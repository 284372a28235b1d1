#include "checked_process_group.h"

#include <atomic>

#include "departures.h"
#include "op_counts.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"

namespace tessera::detail {

namespace {

Shape scale_dim0(Shape s, int64_t factor) {
  s[0] *= factor;
  return s;
}

// A number naming the group on every member, for departures.h: its rank 0's world rank and how
// many groups that rank had made before (collective over the group, through `debug`).
uint64_t agree_group_id(ProcessGroup& debug, const GroupInfo& info) {
  static std::atomic<uint32_t> made{0};
  const uint64_t mine = (uint64_t(uint32_t(world_rank())) << 32) | made.fetch_add(1);
  Tensor id = from_vector<int64_t>({int64_t(mine)}, {1});
  CallInfo call = tensor_call(OpKind::Broadcast, DType::Int64, {1});
  call.root = 0;
  WorkPtr work = debug.broadcast(id, 0);
  watched_wait(
      *work, [&] { return "agreeing on an id for " + describe(call, info); }, info, -1);
  return uint64_t(id.item<int64_t>());
}

}  // namespace

std::shared_ptr<CheckedProcessGroup> CheckedProcessGroup::wrap(ProcessGroupPtr inner,
                                                               ProcessGroupPtr debug) {
  TESSERA_CHECK(inner && debug && debug->size() == inner->size() && debug->rank() == inner->rank(),
                "CheckedProcessGroup: the debug group must hold the same ranks as the group");
  auto info = std::make_shared<GroupInfo>();
  info->name = inner->name();
  info->rank = inner->rank();
  info->size = inner->size();
  info->world_ranks = inner->world_ranks();
  info->id = agree_group_id(*debug, *info);
  info->started = register_group(info->id);
  return std::shared_ptr<CheckedProcessGroup>(
      new CheckedProcessGroup(std::move(inner), std::move(debug), std::move(info)));
}

CheckedProcessGroup::CheckedProcessGroup(ProcessGroupPtr inner, ProcessGroupPtr debug,
                                         GroupInfoPtr info)
    : ProcessGroup(inner->rank(), inner->size(), inner->world_ranks(), inner->name()),
      inner_(std::move(inner)),
      debug_(std::move(debug)),
      info_(std::move(info)) {}

std::string CheckedProcessGroup::where(const char* op) const {
  return std::string(op) + " on group '" + name() + "' (rank " + std::to_string(rank()) + " of " +
         std::to_string(size()) + ")";
}

void CheckedProcessGroup::enter(const char* op) const {
  count_comm_op(op);
}

CallInfo CheckedProcessGroup::start_collective(Signature sig) const {
  sig.call.seq = info_->started->fetch_add(1);
  if (debug_collectives()) {
    const std::string what = "debug check before " + describe(sig.call, *info_);
    check_signatures(*debug_, name(), sig, [&](const WorkPtr& w, const CallInfo& call) {
      watched_wait(
          *w, [&] { return what; }, *info_, call.seq);
    });
  }
  return sig.call;
}

template <class Start>
WorkPtr CheckedProcessGroup::issue(CallInfo call, Start&& start) const {
  WorkPtr work;
  try {
    work = start();
  } catch (...) {
    // The backend refused it before it started (its own limits: a device, a count): it does not
    // count as started, or a departure notice would tell the peers waiting in it that this rank
    // had joined.
    if (call.seq >= 0) info_->started->fetch_sub(1);
    throw;
  }
  return std::make_shared<WatchedWork>(std::move(work), std::move(call), info_);
}

void CheckedProcessGroup::check_tensor(const Tensor& t, const char* op, const char* what) const {
  TESSERA_CHECK(t.defined(), where(op), ": ", what, " is an undefined tensor");
}

void CheckedProcessGroup::check_root(int root, const char* op, const char* what) const {
  TESSERA_CHECK(root >= 0 && root < size(), where(op), ": ", what, " ", root,
                " is not a rank of the group (valid: 0..", size() - 1, ")");
}

void CheckedProcessGroup::check_list(const std::vector<Tensor>& list, DType dtype, const char* op,
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

void CheckedProcessGroup::check_reduce(ReduceOp reduce, DType dtype, const char* op) const {
  TESSERA_CHECK(!(dtype == DType::Bool && reduce == ReduceOp::Avg), where(op),
                ": reduce op avg is undefined for bool tensors (use sum for 'any', min for 'all')");
}

WorkPtr CheckedProcessGroup::all_reduce(Tensor& t, ReduceOp op) {
  constexpr const char* kOp = "all_reduce";
  enter(kOp);
  check_tensor(t, kOp, "the tensor");
  check_reduce(op, t.dtype(), kOp);
  CallInfo call = tensor_call(OpKind::AllReduce, t.dtype(), t.shape());
  call.reduce = op;
  call = start_collective({call, {}, {}, t.numel(), {}});
  return issue(std::move(call), [&] { return inner_->all_reduce(t, op); });
}

WorkPtr CheckedProcessGroup::all_gather_into_tensor(Tensor& out, const Tensor& in) {
  constexpr const char* kOp = "all_gather_into_tensor";
  enter(kOp);
  check_tensor(out, kOp, "the output");
  check_tensor(in, kOp, "the input");
  TESSERA_CHECK(out.dtype() == in.dtype(), where(kOp), ": output dtype ", dtype_name(out.dtype()),
                " differs from input dtype ", dtype_name(in.dtype()));
  TESSERA_CHECK(in.dim() >= 1, where(kOp),
                ": the input is 0-d; gather scalars as shape [1] into shape [", size(), "]");
  const Shape expected = scale_dim0(in.shape(), size());
  TESSERA_CHECK(out.shape() == expected, where(kOp), ": output shape ", shape_str(out.shape()),
                " must be ", shape_str(expected), " (", size(), " x input shape ",
                shape_str(in.shape()), " on dim 0)");
  CallInfo call = tensor_call(OpKind::AllGatherIntoTensor, in.dtype(), in.shape());
  call.out_shape = out.shape();
  call = start_collective({call, {}, {}, in.numel(), {}});
  return issue(std::move(call), [&] { return inner_->all_gather_into_tensor(out, in); });
}

WorkPtr CheckedProcessGroup::all_gather(std::vector<Tensor>& outputs, const Tensor& in) {
  constexpr const char* kOp = "all_gather";
  enter(kOp);
  check_tensor(in, kOp, "the input");
  check_list(outputs, in.dtype(), kOp, "outputs");
  const Tensor& own = outputs[size_t(rank())];
  TESSERA_CHECK(own.numel() == in.numel(), where(kOp), ": outputs[", rank(),
                "] (this rank's own slot) has shape ", shape_str(own.shape()),
                " but the input has shape ", shape_str(in.shape()));
  Signature sig;
  sig.call = tensor_call(OpKind::AllGather, in.dtype(), in.shape());
  sig.call.pieces = int64_t(outputs.size());
  sig.numel = in.numel();
  for (const Tensor& o : outputs)
    sig.recv_counts.push_back(o.numel());
  CallInfo call = start_collective(std::move(sig));
  return issue(std::move(call), [&] { return inner_->all_gather(outputs, in); });
}

WorkPtr CheckedProcessGroup::all_gather_runs(Tensor& out, const Tensor& in,
                                             const std::vector<std::vector<GatherRun>>& runs) {
  constexpr const char* kOp = "all_gather_runs";
  enter(kOp);
  check_tensor(out, kOp, "the output");
  check_tensor(in, kOp, "the input");
  check_gather_runs(*this, out, in, runs);
  CallInfo call = tensor_call(OpKind::AllGatherRuns, in.dtype(), in.shape());
  call.out_shape = out.shape();
  auto total = [](const std::vector<GatherRun>& rs) {
    int64_t n = 0;
    for (const GatherRun& r : rs)
      n += r.length;
    return n;
  };
  Signature sig{call, {}, {}, in.numel(), {}};
  sig.send_counts.assign(size_t(size()), total(runs[size_t(rank())]));
  for (const auto& r : runs) {
    sig.recv_counts.push_back(total(r));
    sig.list_hashes.push_back(runs_hash(r));
  }
  call = start_collective(std::move(sig));
  return issue(std::move(call), [&] { return inner_->all_gather_runs(out, in, runs); });
}

WorkPtr CheckedProcessGroup::reduce_scatter_tensor(Tensor& out, const Tensor& in, ReduceOp op) {
  constexpr const char* kOp = "reduce_scatter_tensor";
  enter(kOp);
  check_tensor(out, kOp, "the output");
  check_tensor(in, kOp, "the input");
  check_reduce(op, in.dtype(), kOp);
  TESSERA_CHECK(out.dtype() == in.dtype(), where(kOp), ": output dtype ", dtype_name(out.dtype()),
                " differs from input dtype ", dtype_name(in.dtype()));
  TESSERA_CHECK(out.dim() >= 1, where(kOp),
                ": the output is 0-d; reduce-scatter into shape [1] from shape [", size(), "]");
  const Shape expected = scale_dim0(out.shape(), size());
  TESSERA_CHECK(in.shape() == expected, where(kOp), ": input shape ", shape_str(in.shape()),
                " must be ", shape_str(expected), " (", size(), " x output shape ",
                shape_str(out.shape()), " on dim 0)");
  CallInfo call = tensor_call(OpKind::ReduceScatterTensor, in.dtype(), in.shape());
  call.reduce = op;
  call.out_shape = out.shape();
  call = start_collective({call, {}, {}, in.numel(), {}});
  return issue(std::move(call), [&] { return inner_->reduce_scatter_tensor(out, in, op); });
}

WorkPtr CheckedProcessGroup::reduce_scatter(Tensor& out, const std::vector<Tensor>& inputs,
                                            ReduceOp op) {
  constexpr const char* kOp = "reduce_scatter";
  enter(kOp);
  check_tensor(out, kOp, "the output");
  check_reduce(op, out.dtype(), kOp);
  check_list(inputs, out.dtype(), kOp, "inputs");
  const Tensor& own = inputs[size_t(rank())];
  TESSERA_CHECK(own.numel() == out.numel(), where(kOp), ": inputs[", rank(),
                "] (this rank's block) has shape ", shape_str(own.shape()),
                " but the output has shape ", shape_str(out.shape()));
  Signature sig;
  sig.call = tensor_call(OpKind::ReduceScatter, out.dtype(), out.shape());
  sig.call.reduce = op;
  sig.call.pieces = int64_t(inputs.size());
  sig.numel = out.numel();
  for (const Tensor& in : inputs)
    sig.send_counts.push_back(in.numel());
  CallInfo call = start_collective(std::move(sig));
  return issue(std::move(call), [&] { return inner_->reduce_scatter(out, inputs, op); });
}

WorkPtr CheckedProcessGroup::all_to_all(std::vector<Tensor>& outputs,
                                        const std::vector<Tensor>& inputs) {
  constexpr const char* kOp = "all_to_all";
  enter(kOp);
  TESSERA_CHECK(!inputs.empty() && inputs[0].defined(), where(kOp),
                ": inputs must hold one defined tensor per rank (got ", inputs.size(), ")");
  const DType dt = inputs[0].dtype();
  check_list(inputs, dt, kOp, "inputs");
  check_list(outputs, dt, kOp, "outputs");
  const size_t me = size_t(rank());
  TESSERA_CHECK(inputs[me].numel() == outputs[me].numel(), where(kOp), ": inputs[", me,
                "] has shape ", shape_str(inputs[me].shape()), " but outputs[", me,
                "] (what this rank sends itself) has shape ", shape_str(outputs[me].shape()));
  Signature sig;
  sig.call = tensor_call(OpKind::AllToAll, dt, inputs[me].shape());
  sig.call.pieces = int64_t(inputs.size());
  sig.numel = inputs[me].numel();
  for (size_t r = 0; r < inputs.size(); ++r) {
    sig.send_counts.push_back(inputs[r].numel());
    sig.recv_counts.push_back(outputs[r].numel());
  }
  CallInfo call = start_collective(std::move(sig));
  return issue(std::move(call), [&] { return inner_->all_to_all(outputs, inputs); });
}

WorkPtr CheckedProcessGroup::broadcast(Tensor& t, int root) {
  constexpr const char* kOp = "broadcast";
  enter(kOp);
  check_tensor(t, kOp, "the tensor");
  check_root(root, kOp, "root");
  CallInfo call = tensor_call(OpKind::Broadcast, t.dtype(), t.shape());
  call.root = root;
  call = start_collective({call, {}, {}, t.numel(), {}});
  return issue(std::move(call), [&] { return inner_->broadcast(t, root); });
}

WorkPtr CheckedProcessGroup::scatter(Tensor& out, const std::vector<Tensor>& inputs, int root) {
  constexpr const char* kOp = "scatter";
  enter(kOp);
  check_tensor(out, kOp, "the output");
  check_root(root, kOp, "root");
  Signature sig;
  if (rank() == root) {
    check_list(inputs, out.dtype(), kOp, "inputs");
    TESSERA_CHECK(inputs[size_t(root)].numel() == out.numel(), where(kOp), ": inputs[", root,
                  "] (the root's own piece) has shape ", shape_str(inputs[size_t(root)].shape()),
                  " but the output has shape ", shape_str(out.shape()));
    for (const Tensor& in : inputs)
      sig.send_counts.push_back(in.numel());
  } else {
    TESSERA_CHECK(inputs.empty(), where(kOp), ": only the root (rank ", root,
                  ") passes inputs, but this rank passed ", inputs.size(), " tensors");
  }
  sig.call = tensor_call(OpKind::Scatter, out.dtype(), out.shape());
  sig.call.root = root;
  sig.numel = out.numel();
  CallInfo call = start_collective(std::move(sig));
  return issue(std::move(call), [&] { return inner_->scatter(out, inputs, root); });
}

WorkPtr CheckedProcessGroup::send(const Tensor& t, int dst, int tag) {
  constexpr const char* kOp = "send";
  enter(kOp);
  check_tensor(t, kOp, "the tensor");
  check_root(dst, kOp, "destination");
  CallInfo call = tensor_call(OpKind::Send, t.dtype(), t.shape());
  call.peer = dst;
  call.tag = tag;
  return issue(std::move(call), [&] { return inner_->send(t, dst, tag); });
}

WorkPtr CheckedProcessGroup::recv(Tensor& t, int src, int tag) {
  constexpr const char* kOp = "recv";
  enter(kOp);
  check_tensor(t, kOp, "the tensor");
  check_root(src, kOp, "source");
  CallInfo call = tensor_call(OpKind::Recv, t.dtype(), t.shape());
  call.peer = src;
  call.tag = tag;
  return issue(std::move(call), [&] { return inner_->recv(t, src, tag); });
}

WorkPtr CheckedProcessGroup::barrier() {
  constexpr const char* kOp = "barrier";
  enter(kOp);
  CallInfo call;
  call.op = OpKind::Barrier;
  call = start_collective({call, {}, {}, 0, {}});
  return issue(std::move(call), [&] { return inner_->barrier(); });
}

std::shared_ptr<ProcessGroup> CheckedProcessGroup::split(int color, int key,
                                                         const std::string& name) {
  constexpr const char* kOp = "split";
  enter(kOp);
  TESSERA_CHECK(!name.empty(), where(kOp), ": the new group needs a name");
  CallInfo call;
  call.op = OpKind::Split;
  call = start_collective({call, {}, {}, 0, {}});
  // A backend's split may block with no timeout (MPI_Comm_split); a watched barrier first makes
  // sure every rank has arrived, so the split itself cannot hang.
  watched_wait(
      *inner_->barrier(), [&] { return describe(call, *info_); }, *info_, call.seq);
  // The debug group first: its split involves every rank of the group and fails on none. A
  // backend's split may throw on the members of one new group only (NCCL's bootstrap runs among
  // them), and had it come first, the other ranks would wait in this one for ranks that left.
  ProcessGroupPtr debug = debug_->split(color, key, name);
  ProcessGroupPtr inner = inner_->split(color, key, name);
  if (!inner) return nullptr;
  return wrap(std::move(inner), std::move(debug));
}

}  // namespace tessera::detail
