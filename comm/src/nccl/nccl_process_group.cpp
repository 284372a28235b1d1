// The NCCL backend: a ProcessGroup over CUDA tensors whose operations run on a stream of their
// own through one NCCL communicator per group (nccl_channel.h says how they are ordered). Its
// communicator is made over a CPU group with the same members: that group's rank 0 asks NCCL for
// a unique id and broadcasts it, and every member joins with it. The checks every backend shares
// (arguments, debug signatures, counts, the timeout watchdog) are CheckedProcessGroup's.
#include "nccl_process_group.h"

#include <algorithm>
#include <cstring>
#include <exception>

#include "../call_info.h"
#include "nccl_channel.h"
#include "tessera/comm/backend.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/views.h"

namespace tessera::detail {

namespace {

NcclType nccl_type(DType dt) {
  switch (dt) {
    case DType::Float32:
      return NcclType::Float32;
    case DType::Float64:
      return NcclType::Float64;
    case DType::BFloat16:
      return NcclType::BFloat16;
    case DType::Float16:
      return NcclType::Float16;
    case DType::Int64:
      return NcclType::Int64;
    case DType::Int32:
      return NcclType::Int32;
    case DType::Bool:
      return NcclType::Uint8;  // one byte, 0 or 1: max is "or", min is "and"
  }
  return NcclType::Uint8;
}

// How NCCL reduces `op` on `dt`, and whether the group divides by the size afterwards.
struct Reduction {
  NcclOp op = NcclOp::Sum;
  bool divide_after = false;
};
Reduction reduction(ReduceOp op, DType dt) {
  if (dt == DType::Bool)
    return {op == ReduceOp::Sum || op == ReduceOp::Max ? NcclOp::Max : NcclOp::Min, false};
  switch (op) {
    case ReduceOp::Sum:
      return {NcclOp::Sum, false};
    case ReduceOp::Product:
      return {NcclOp::Prod, false};
    case ReduceOp::Max:
      return {NcclOp::Max, false};
    case ReduceOp::Min:
      return {NcclOp::Min, false};
    case ReduceOp::Avg:
      // Floats: the sum divided by the size, rounded as the CPU group rounds it. Integers:
      // NCCL's own average, the sum divided with truncation, as the CPU group's.
      return is_floating(dt) ? Reduction{NcclOp::Sum, true} : Reduction{NcclOp::Avg, false};
  }
  return {};
}

// The buffers of one operation: contiguous stand-ins for tensors NCCL cannot use as they are,
// the copies that carry results back into the caller's tensors, and what the work keeps alive.
struct Buffers {
  std::vector<Tensor> keep;
  std::vector<std::pair<Tensor, Tensor>> back;  // (caller's tensor, contiguous result)

  // NCCL reads it.
  const void* in(const Tensor& t) {
    Tensor c = t.contiguous();
    keep.push_back(c);
    return c.raw_data();
  }
  // NCCL writes all of it (`keep_values`: and reads it first, for in-place operations).
  void* out(Tensor& t, bool keep_values = false) {
    if (t.is_contiguous()) {
      keep.push_back(t);
      return t.raw_data();
    }
    Tensor c = keep_values ? t.contiguous() : empty(t.shape(), {t.dtype(), t.device()});
    keep.push_back(c);
    back.emplace_back(t, c);
    return c.raw_data();
  }
  void copy_back() {
    for (auto& [t, c] : back)
      t.detach().copy_(c);
  }
};

size_t count_of(const Tensor& t) {
  return size_t(t.numel());
}

class NcclProcessGroup final : public ProcessGroup {
 public:
  NcclProcessGroup(ProcessGroupPtr host, NcclChannelPtr channel)
      : ProcessGroup(host->rank(), host->size(), host->world_ranks(), host->name()),
        host_(std::move(host)),
        ch_(std::move(channel)) {}

  WorkPtr all_reduce(Tensor& t, ReduceOp op) override {
    CallInfo call = tensor_call(OpKind::AllReduce, t.dtype(), t.shape());
    call.reduce = op;
    check_device(call, t, "the tensor");
    const Reduction r = reduction(op, t.dtype());
    Buffers b;
    void* buf = b.out(t, true);
    Tensor result = b.keep.back();
    return run(
        call, b,
        [&] {
          if (t.numel() > 0)
            lib().all_reduce(buf, buf, count_of(t), type(t), r.op, comm(), stream());
        },
        r.divide_after ? divide_by_size(result) : nullptr);
  }

  WorkPtr all_gather_into_tensor(Tensor& out, const Tensor& in) override {
    CallInfo call = tensor_call(OpKind::AllGatherIntoTensor, in.dtype(), in.shape());
    call.out_shape = out.shape();
    check_device(call, out, "the output");
    check_device(call, in, "the input");
    Buffers b;
    const void* src = b.in(in);
    void* dst = b.out(out);
    return run(call, b, [&] {
      if (in.numel() > 0) lib().all_gather(src, dst, count_of(in), type(in), comm(), stream());
    });
  }

  // Shapes may differ by rank: one broadcast per rank, rooted there, issued together. Pieces of
  // one size are gathered by one all-gather into a buffer, copied out to the caller's pieces
  // (which may be strided views of one tensor, as DTensor's gathers along inner dims pass).
  WorkPtr all_gather(std::vector<Tensor>& outputs, const Tensor& in) override {
    CallInfo call = tensor_call(OpKind::AllGather, in.dtype(), in.shape());
    call.pieces = int64_t(outputs.size());
    check_device(call, in, "the input");
    check_list(call, outputs, "outputs");
    Buffers b;
    const void* src = b.in(in);
    const int64_t count = in.numel();
    bool even = count > 0;
    for (const Tensor& o : outputs)
      even = even && o.numel() == count;
    if (even) {
      Tensor all = empty({int64_t(outputs.size()) * count}, {in.dtype(), in.device()});
      void* dst = b.out(all);
      for (size_t r = 0; r < outputs.size(); ++r)
        b.back.emplace_back(outputs[r],
                            kernels::reshape(kernels::narrow(all, 0, int64_t(r) * count, count),
                                             outputs[r].shape()));
      return run(call, b,
                 [&] { lib().all_gather(src, dst, size_t(count), type(in), comm(), stream()); });
    }
    std::vector<void*> dst;
    for (Tensor& o : outputs)
      dst.push_back(b.out(o));
    return run(call, b, [&] {
      grouped([&] {
        for (int r = 0; r < size(); ++r)
          if (outputs[r].numel() > 0)
            lib().broadcast(src, dst[r], count_of(outputs[r]), type(in), r, comm(), stream());
      });
    });
  }

  WorkPtr reduce_scatter_tensor(Tensor& out, const Tensor& in, ReduceOp op) override {
    CallInfo call = tensor_call(OpKind::ReduceScatterTensor, in.dtype(), in.shape());
    call.reduce = op;
    call.out_shape = out.shape();
    check_device(call, out, "the output");
    check_device(call, in, "the input");
    const Reduction r = reduction(op, in.dtype());
    Buffers b;
    const void* src = b.in(in);
    void* dst = b.out(out);
    Tensor result = b.keep.back();
    return run(
        call, b,
        [&] {
          if (out.numel() > 0)
            lib().reduce_scatter(src, dst, count_of(out), type(in), r.op, comm(), stream());
        },
        r.divide_after ? divide_by_size(result) : nullptr);
  }

  // Shapes may differ by rank: one reduction per rank, rooted there, issued together.
  WorkPtr reduce_scatter(Tensor& out, const std::vector<Tensor>& inputs, ReduceOp op) override {
    CallInfo call = tensor_call(OpKind::ReduceScatter, out.dtype(), out.shape());
    call.reduce = op;
    call.pieces = int64_t(inputs.size());
    check_device(call, out, "the output");
    check_list(call, inputs, "inputs");
    const Reduction r = reduction(op, out.dtype());
    Buffers b;
    std::vector<const void*> src;
    for (const Tensor& t : inputs)
      src.push_back(b.in(t));
    void* dst = b.out(out);
    Tensor result = b.keep.back();
    return run(
        call, b,
        [&] {
          grouped([&] {
            for (int q = 0; q < size(); ++q)
              if (inputs[q].numel() > 0)
                lib().reduce(src[q], q == rank() ? dst : nullptr, count_of(inputs[q]), type(out),
                             r.op, q, comm(), stream());
          });
        },
        r.divide_after ? divide_by_size(result) : nullptr);
  }

  WorkPtr all_to_all(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs) override {
    CallInfo call =
        tensor_call(OpKind::AllToAll, inputs.empty() ? DType::Float32 : inputs[0].dtype(), {});
    call.pieces = int64_t(inputs.size());
    check_list(call, inputs, "inputs");
    check_list(call, outputs, "outputs");
    Buffers b;
    std::vector<const void*> src;
    std::vector<void*> dst;
    for (const Tensor& t : inputs)
      src.push_back(b.in(t));
    for (Tensor& t : outputs)
      dst.push_back(b.out(t));
    return run(call, b, [&] {
      grouped([&] {
        for (int q = 0; q < size(); ++q) {
          if (inputs[q].numel() > 0)
            lib().send(src[q], count_of(inputs[q]), type(inputs[q]), q, comm(), stream());
          if (outputs[q].numel() > 0)
            lib().recv(dst[q], count_of(outputs[q]), type(outputs[q]), q, comm(), stream());
        }
      });
    });
  }

  WorkPtr broadcast(Tensor& t, int root) override {
    CallInfo call = tensor_call(OpKind::Broadcast, t.dtype(), t.shape());
    call.root = root;
    check_device(call, t, "the tensor");
    Buffers b;
    void* buf = b.out(t, rank() == root);
    return run(call, b, [&] {
      if (t.numel() > 0) lib().broadcast(buf, buf, count_of(t), type(t), root, comm(), stream());
    });
  }

  WorkPtr scatter(Tensor& out, const std::vector<Tensor>& inputs, int root) override {
    CallInfo call = tensor_call(OpKind::Scatter, out.dtype(), out.shape());
    call.root = root;
    check_device(call, out, "the output");
    if (rank() == root) check_list(call, inputs, "inputs");
    Buffers b;
    std::vector<const void*> src;
    for (const Tensor& t : inputs)
      src.push_back(b.in(t));
    void* dst = b.out(out);
    return run(call, b, [&] {
      grouped([&] {
        if (rank() == root)
          for (int q = 0; q < size(); ++q)
            if (inputs[q].numel() > 0)
              lib().send(src[q], count_of(inputs[q]), type(inputs[q]), q, comm(), stream());
        if (out.numel() > 0) lib().recv(dst, count_of(out), type(out), root, comm(), stream());
      });
    });
  }

  // NCCL has no tags: sends and receives between two ranks match in the order they are issued.
  WorkPtr send(const Tensor& t, int dst, int tag) override {
    CallInfo call = tensor_call(OpKind::Send, t.dtype(), t.shape());
    call.peer = dst;
    call.tag = tag;
    check_device(call, t, "the tensor");
    Buffers b;
    const void* src = b.in(t);
    return run(call, b, [&] {
      if (t.numel() > 0) lib().send(src, count_of(t), type(t), dst, comm(), stream());
    });
  }
  WorkPtr recv(Tensor& t, int src, int tag) override {
    CallInfo call = tensor_call(OpKind::Recv, t.dtype(), t.shape());
    call.peer = src;
    call.tag = tag;
    check_device(call, t, "the tensor");
    Buffers b;
    void* dst = b.out(t);
    return run(call, b, [&] {
      if (t.numel() > 0) lib().recv(dst, count_of(t), type(t), src, comm(), stream());
    });
  }

  // An all-reduce of one element: complete when every member has issued it.
  WorkPtr barrier() override {
    CallInfo call;
    call.op = OpKind::Barrier;
    Tensor one = zeros({1}, {DType::Int32, ch_->device});
    Buffers b;
    void* buf = b.out(one);
    return run(call, b, [&] {
      lib().all_reduce(buf, buf, 1, NcclType::Int32, NcclOp::Sum, comm(), stream());
    });
  }

  ProcessGroupPtr split(int color, int key, const std::string& name) override {
    ProcessGroupPtr host = host_->split(color, key, name);
    if (!host) return nullptr;
    return nccl_group(std::move(host), ch_->device, ch_->lib);
  }

 private:
  NcclLibrary& lib() const { return ch_->lib; }
  NcclLibrary::Comm comm() const { return ch_->comm; }
  NcclLibrary::Stream stream() const { return ch_->stream; }
  static NcclType type(const Tensor& t) { return nccl_type(t.dtype()); }

  std::string where(const CallInfo& call) const { return to_string(call) + " on " + ch_->where(); }

  void check_device(const CallInfo& call, const Tensor& t, const char* what) const {
    TESSERA_CHECK(t.device() == ch_->device, where(call), ": ", what, " is on ", t.device().str(),
                  "; an NCCL group moves tensors on ", ch_->device.str(),
                  " only (CPU tensors go through world_group())");
  }
  void check_list(const CallInfo& call, const std::vector<Tensor>& list, const char* what) const {
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string name = std::string(what) + "[" + std::to_string(i) + "]";
      check_device(call, list[i], name.c_str());
    }
  }

  // The operations `issue` enqueues, issued as one (send/receive pairs need it).
  void grouped(const std::function<void()>& issue) const {
    lib().group_start();
    try {
      issue();
    } catch (...) {
      try {
        lib().group_end();
      } catch (...) {  // the first failure is the one to report
      }
      throw;
    }
    lib().group_end();
  }

  // Average's second half for floats, on the compute stream once the sum has landed.
  std::function<void()> divide_by_size(Tensor result) const {
    const double n = double(size());
    return [result, n]() mutable {
      result.detach().copy_(kernels::binary_scalar(kernels::BinaryOp::Div, result, n));
    };
  }

  // Orders `issue` after the compute stream's work so far, runs it, and returns the work that
  // completes with it and then runs `then` and the copies back into the caller's tensors.
  WorkPtr run(const CallInfo& call, Buffers& b, const std::function<void()>& issue,
              std::function<void()> then = nullptr) {
    NcclChannel& ch = *ch_;
    TESSERA_CHECK(!ch.aborted.load(), where(call),
                  ": the group's communicator was aborted; make a new group");
    bool issued = false;
    try {
      // The compute stream and the events are the current device's: make it the group's, which
      // another thread's (or a multi-GPU process's) current device need not be.
      ch.lib.set_device(ch.device.index);
      NcclLibrary::Event ready = ch.lib.record_event(ch.compute);
      ch.lib.stream_wait(ch.stream, ready);
      ch.lib.destroy_event(ready);
      issued = true;
      issue();
      NcclLibrary::Event done = ch.lib.record_event(ch.stream);
      auto finish = [then = std::move(then), back = std::move(b.back)]() mutable {
        if (then) then();
        for (auto& [t, c] : back)
          t.detach().copy_(c);
      };
      return std::make_shared<NcclWork>(ch_, to_string(call), done, std::move(b.keep),
                                        std::move(finish));
    } catch (const std::exception& e) {
      // Operations may be in flight on the buffers about to be freed: stop them first.
      if (issued) ch.abort();
      TESSERA_FAIL(where(call), ": ", e.what(),
                   issued ? " (the communicator was aborted; make a new group)" : "");
    }
  }

  ProcessGroupPtr host_;
  NcclChannelPtr ch_;
};

// The device UUIDs of every member, in group-rank order, gathered over `host`.
std::vector<std::string> member_devices(ProcessGroup& host, const std::string& mine) {
  constexpr int64_t kWords = 8;  // 64 bytes: a UUID's text fits
  TESSERA_CHECK(mine.size() < size_t(kWords * 8), "NCCL group: device id '", mine, "' too long");
  std::vector<int64_t> words(kWords, 0);
  std::memcpy(words.data(), mine.data(), mine.size());
  Tensor local = from_vector<int64_t>(words, {kWords});
  Tensor all = empty({host.size() * kWords}, DType::Int64);
  host.all_gather_into_tensor(all, local)->wait();
  std::vector<int64_t> got = all.to_vector<int64_t>();
  std::vector<std::string> ids;
  for (int r = 0; r < host.size(); ++r) {
    const char* p = reinterpret_cast<const char*>(got.data() + r * kWords);
    ids.emplace_back(p, strnlen(p, size_t(kWords * 8)));
  }
  return ids;
}

}  // namespace

ProcessGroupPtr nccl_group(ProcessGroupPtr host, Device device, NcclLibrary& lib) {
  TESSERA_CHECK(host != nullptr, "nccl_group: no CPU group given to bootstrap over");
  TESSERA_CHECK(device.is_cuda(), "nccl_group: NCCL moves CUDA tensors, not ", device.str());
  auto ch = std::make_shared<NcclChannel>(lib, device, host->name(), host->rank(), host->size());
  const std::string where = "making the NCCL communicator of " + ch->where();
  // Every member learns of a shared GPU, so all of them refuse together instead of hanging.
  const std::vector<std::string> devices = member_devices(*host, lib.device_uuid(device.index));
  for (int a = 0; a < host->size(); ++a)
    for (int b = a + 1; b < host->size(); ++b)
      TESSERA_CHECK(devices[a] != devices[b], where, ": ranks ", a, " and ", b, " both drive GPU ",
                    devices[a],
                    ", and NCCL needs a GPU per rank. Give each rank its own device "
                    "(set_current_device) or carry CUDA tensors through host memory: "
                    "register_backend(DeviceType::CUDA, \"mpi\", host_staged_backend())");
  Tensor id = zeros({int64_t(sizeof(NcclId::bytes) / 8)}, DType::Int64);
  if (host->rank() == 0) {
    NcclId made = lib.unique_id();
    std::memcpy(id.raw_data(), made.bytes.data(), made.bytes.size());
  }
  host->broadcast(id, 0)->wait();
  NcclId shared;
  std::memcpy(shared.bytes.data(), id.raw_data(), shared.bytes.size());
  try {
    ch->comm = lib.init_rank(device.index, host->size(), shared, host->rank());
    ch->stream = lib.create_stream(device.index);
    ch->compute = lib.compute_stream(device.index);
  } catch (const std::exception& e) {
    TESSERA_FAIL(where, ": ", e.what());
  }
  return std::make_shared<NcclProcessGroup>(std::move(host), std::move(ch));
}

}  // namespace tessera::detail

namespace tessera {

std::string nccl_unavailable() {
  // An installed library (the emulation in tests) is usable by definition.
  try {
    (void)detail::nccl_library();
    return "";
  } catch (const std::exception&) {
    return detail::system_nccl_unavailable();
  }
}

BackendFactory nccl_backend() {
  return [] {
    detail::NcclLibrary& lib = detail::nccl_library();
    return detail::nccl_group(world_group(), current_device(DeviceType::CUDA), lib);
  };
}

}  // namespace tessera
