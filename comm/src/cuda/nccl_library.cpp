// NcclLibrary bound to libnccl and the CUDA runtime. libnccl is opened on first use, as core opens
// cuBLAS: a CUDA build then runs, CPU work included, on machines whose NCCL is missing or of
// another soname; only an NCCL group needs it, and says so when it is not there.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstring>
#include <string>
#include <type_traits>

#include "../nccl/nccl_library.h"
#include "tessera/core/device.h"
#include "tessera/core/error.h"

#if __has_include(<nccl.h>)
#include <nccl.h>
#define TESSERA_HAVE_NCCL_H 1
#endif

namespace tessera::detail {

#ifdef TESSERA_HAVE_NCCL_H
namespace {

void check_cuda(cudaError_t err, const char* call, int device) {
  TESSERA_CHECK(err == cudaSuccess, call, " on cuda:", device,
                " failed: ", cudaGetErrorString(err));
}

// The entry points, looked up by name in libnccl.so.2.
struct Entry {
  decltype(&::ncclGetVersion) get_version = nullptr;
  decltype(&::ncclGetErrorString) error_string = nullptr;
  decltype(&::ncclGetLastError) last_error = nullptr;
  decltype(&::ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&::ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&::ncclCommAbort) comm_abort = nullptr;
  decltype(&::ncclCommGetAsyncError) comm_async_error = nullptr;
  decltype(&::ncclGroupStart) group_start = nullptr;
  decltype(&::ncclGroupEnd) group_end = nullptr;
  decltype(&::ncclAllReduce) all_reduce = nullptr;
  decltype(&::ncclAllGather) all_gather = nullptr;
  decltype(&::ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&::ncclBroadcast) broadcast = nullptr;
  decltype(&::ncclReduce) reduce = nullptr;
  decltype(&::ncclSend) send = nullptr;
  decltype(&::ncclRecv) recv = nullptr;
};

constexpr const char* kSoname = "libnccl.so.2";

// Opens libnccl once; `why` is what went wrong ("" when every entry point was found).
struct Opened {
  Entry entry;
  std::string why;
  Opened() {
    void* lib = dlopen(kSoname, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* err = dlerror();
      why = std::string("cannot open ") + kSoname + ": " + (err ? err : "unknown error");
      return;
    }
    auto find = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && why.empty()) why = std::string(kSoname) + " has no " + name;
    };
    find(entry.get_version, "ncclGetVersion");
    find(entry.error_string, "ncclGetErrorString");
    find(entry.last_error, "ncclGetLastError");
    find(entry.get_unique_id, "ncclGetUniqueId");
    find(entry.comm_init_rank, "ncclCommInitRank");
    find(entry.comm_abort, "ncclCommAbort");
    find(entry.comm_async_error, "ncclCommGetAsyncError");
    find(entry.group_start, "ncclGroupStart");
    find(entry.group_end, "ncclGroupEnd");
    find(entry.all_reduce, "ncclAllReduce");
    find(entry.all_gather, "ncclAllGather");
    find(entry.reduce_scatter, "ncclReduceScatter");
    find(entry.broadcast, "ncclBroadcast");
    find(entry.reduce, "ncclReduce");
    find(entry.send, "ncclSend");
    find(entry.recv, "ncclRecv");
  }
};

const Opened& opened() {
  static const Opened* o = new Opened;  // never closed: communicators may outlive statics
  return *o;
}

ncclDataType_t to_nccl(NcclType t) {
  switch (t) {
    case NcclType::Uint8:
      return ncclUint8;
    case NcclType::Int32:
      return ncclInt32;
    case NcclType::Int64:
      return ncclInt64;
    case NcclType::Float16:
      return ncclFloat16;
    case NcclType::Float32:
      return ncclFloat32;
    case NcclType::Float64:
      return ncclFloat64;
    case NcclType::BFloat16:
      return ncclBfloat16;
  }
  return ncclUint8;
}

ncclRedOp_t to_nccl(NcclOp op) {
  switch (op) {
    case NcclOp::Sum:
      return ncclSum;
    case NcclOp::Prod:
      return ncclProd;
    case NcclOp::Max:
      return ncclMax;
    case NcclOp::Min:
      return ncclMin;
    case NcclOp::Avg:
      return ncclAvg;
  }
  return ncclSum;
}

ncclComm_t comm_of(NcclLibrary::Comm c) {
  return static_cast<ncclComm_t>(c);
}
cudaStream_t stream_of(NcclLibrary::Stream s) {
  return static_cast<cudaStream_t>(s);
}

class SystemNccl final : public NcclLibrary {
 public:
  explicit SystemNccl(const Entry& e) : e_(e) {}

  std::string name() const override {
    int v = 0;
    e_.get_version(&v);
    return "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
           std::to_string(v % 100);
  }

  std::string device_uuid(int device) override {
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties", device);
    static const char* kHex = "0123456789abcdef";
    std::string s = "GPU-";
    for (unsigned char b : prop.uuid.bytes) {
      s += kHex[b >> 4];
      s += kHex[b & 15];
    }
    return s;
  }
  void set_device(int device) override {
    check_cuda(cudaSetDevice(device), "cudaSetDevice", device);
  }
  // Tessera's kernels and copies run on the legacy default stream.
  Stream compute_stream(int) override { return nullptr; }
  Stream create_stream(int device) override {
    check_cuda(cudaSetDevice(device), "cudaSetDevice", device);
    cudaStream_t s = nullptr;
    check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
               device);
    return s;
  }
  void destroy_stream(Stream stream) override {
    // At teardown: nothing left to tell, and no error left behind for the next check to find.
    if (cudaStreamDestroy(stream_of(stream)) != cudaSuccess) (void)cudaGetLastError();
  }
  Event record_event(Stream stream) override {
    cudaEvent_t ev = nullptr;
    check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate", device());
    check_cuda(cudaEventRecord(ev, stream_of(stream)), "cudaEventRecord", device());
    return ev;
  }
  bool event_done(Event event) override {
    cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (err == cudaErrorNotReady) {
      // The runtime keeps it as the thread's last error, which the next kernel launch's check
      // would report as its own failure.
      (void)cudaGetLastError();
      return false;
    }
    check_cuda(err, "cudaEventQuery", device());
    return true;
  }
  void destroy_event(Event event) override {
    if (cudaEventDestroy(static_cast<cudaEvent_t>(event)) != cudaSuccess) (void)cudaGetLastError();
  }
  void stream_wait(Stream stream, Event event) override {
    check_cuda(cudaStreamWaitEvent(stream_of(stream), static_cast<cudaEvent_t>(event), 0),
               "cudaStreamWaitEvent", device());
  }

  NcclId unique_id() override {
    ncclUniqueId id;
    check(e_.get_unique_id(&id), "ncclGetUniqueId", nullptr);
    static_assert(sizeof(id) == sizeof(NcclId::bytes));
    NcclId out;
    std::memcpy(out.bytes.data(), &id, sizeof(id));
    return out;
  }
  Comm init_rank(int device, int nranks, const NcclId& id, int rank) override {
    check_cuda(cudaSetDevice(device), "cudaSetDevice", device);
    ncclUniqueId nid;
    std::memcpy(&nid, id.bytes.data(), sizeof(nid));
    ncclComm_t comm = nullptr;
    check(e_.comm_init_rank(&comm, nranks, nid, rank), "ncclCommInitRank", nullptr);
    return comm;
  }
  void destroy(Comm comm) override { (void)e_.comm_abort(comm_of(comm)); }
  void abort(Comm comm) override { check(e_.comm_abort(comm_of(comm)), "ncclCommAbort", nullptr); }
  std::string async_error(Comm comm) override {
    ncclResult_t res = ncclSuccess;
    check(e_.comm_async_error(comm_of(comm), &res), "ncclCommGetAsyncError", comm);
    if (res == ncclSuccess || res == ncclInProgress) return "";
    return text(res, comm);
  }

  void group_start() override { check(e_.group_start(), "ncclGroupStart", nullptr); }
  void group_end() override { check(e_.group_end(), "ncclGroupEnd", nullptr); }
  void all_reduce(const void* in, void* out, size_t count, NcclType type, NcclOp op, Comm comm,
                  Stream stream) override {
    check(
        e_.all_reduce(in, out, count, to_nccl(type), to_nccl(op), comm_of(comm), stream_of(stream)),
        "ncclAllReduce", comm);
  }
  void all_gather(const void* in, void* out, size_t count, NcclType type, Comm comm,
                  Stream stream) override {
    check(e_.all_gather(in, out, count, to_nccl(type), comm_of(comm), stream_of(stream)),
          "ncclAllGather", comm);
  }
  void reduce_scatter(const void* in, void* out, size_t count, NcclType type, NcclOp op, Comm comm,
                      Stream stream) override {
    check(e_.reduce_scatter(in, out, count, to_nccl(type), to_nccl(op), comm_of(comm),
                            stream_of(stream)),
          "ncclReduceScatter", comm);
  }
  void broadcast(const void* in, void* out, size_t count, NcclType type, int root, Comm comm,
                 Stream stream) override {
    check(e_.broadcast(in, out, count, to_nccl(type), root, comm_of(comm), stream_of(stream)),
          "ncclBroadcast", comm);
  }
  void reduce(const void* in, void* out, size_t count, NcclType type, NcclOp op, int root,
              Comm comm, Stream stream) override {
    check(e_.reduce(in, out, count, to_nccl(type), to_nccl(op), root, comm_of(comm),
                    stream_of(stream)),
          "ncclReduce", comm);
  }
  void send(const void* buf, size_t count, NcclType type, int peer, Comm comm,
            Stream stream) override {
    check(e_.send(buf, count, to_nccl(type), peer, comm_of(comm), stream_of(stream)), "ncclSend",
          comm);
  }
  void recv(void* buf, size_t count, NcclType type, int peer, Comm comm, Stream stream) override {
    check(e_.recv(buf, count, to_nccl(type), peer, comm_of(comm), stream_of(stream)), "ncclRecv",
          comm);
  }

 private:
  static int device() {
    int d = 0;
    (void)cudaGetDevice(&d);
    return d;
  }
  std::string text(ncclResult_t res, Comm comm) const {
    std::string s = e_.error_string(res);
    const char* last = e_.last_error(comm_of(comm));
    if (last && *last) s += std::string(" (") + last + ")";
    return s;
  }
  void check(ncclResult_t res, const char* call, Comm comm) const {
    // A non-blocking communicator answers ncclInProgress; ours are blocking, so it is success.
    if (res == ncclSuccess || res == ncclInProgress) return;
    TESSERA_FAIL(call, " failed: ", text(res, comm));
  }

  Entry e_;
};

}  // namespace

std::string system_nccl_unavailable() {
  if (cuda_device_count() == 0) return "this process sees no GPU";
  return opened().why;
}

NcclLibrary& system_nccl_library() {
  const std::string why = system_nccl_unavailable();
  TESSERA_CHECK(why.empty(), "NCCL is not usable here: ", why);
  static SystemNccl* lib = new SystemNccl(opened().entry);
  return *lib;
}

#endif  // no nccl.h: nccl/nccl_library.cpp says so

}  // namespace tessera::detail
