// NcclLibrary over MPI on host copies of a stand-in device's memory (see emulated_nccl.h).
#include "tessera/comm/detail/emulated_nccl.h"

#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <vector>

#include "../mpi/mpi_state.h"
#include "nccl_library.h"
#include "tessera/core/error.h"
#include "tessera/core/half.h"

namespace tessera::detail {

// Named, not anonymous: EmulatedNccl::Library, a class with linkage, holds these.
namespace emulated_nccl {

size_t nccl_type_size(NcclType t) {
  switch (t) {
    case NcclType::Uint8:
      return 1;
    case NcclType::Int32:
      return 4;
    case NcclType::Int64:
      return 8;
    case NcclType::Float16:
    case NcclType::BFloat16:
      return 2;
    case NcclType::Float32:
      return 4;
    case NcclType::Float64:
      return 8;
  }
  return 1;
}

template <class F>
void with_nccl_type(NcclType t, F&& f) {
  switch (t) {
    case NcclType::Uint8:
      return f.template operator()<uint8_t, uint8_t>();
    case NcclType::Int32:
      return f.template operator()<int32_t, int32_t>();
    case NcclType::Int64:
      return f.template operator()<int64_t, int64_t>();
    case NcclType::Float16:
      return f.template operator()<Float16, float>();
    case NcclType::BFloat16:
      return f.template operator()<BFloat16, float>();
    case NcclType::Float32:
      return f.template operator()<float, float>();
    case NcclType::Float64:
      return f.template operator()<double, double>();
  }
}

// out[i] = op over the n terms terms[k * stride + i], combined in rank order.
void reduce_terms(void* out, const char* terms, size_t stride_bytes, int n, size_t count,
                  NcclType type, NcclOp op) {
  with_nccl_type(type, [&]<class T, class C>() {
    T* o = static_cast<T*>(out);
    for (size_t i = 0; i < count; ++i) {
      C acc = C(reinterpret_cast<const T*>(terms)[i]);
      for (int k = 1; k < n; ++k) {
        const C v = C(reinterpret_cast<const T*>(terms + k * stride_bytes)[i]);
        switch (op) {
          case NcclOp::Sum:
          case NcclOp::Avg:
            acc = C(T(acc + v));
            break;
          case NcclOp::Prod:
            acc = C(T(acc * v));
            break;
          case NcclOp::Max:
            acc = v > acc ? v : acc;
            break;
          case NcclOp::Min:
            acc = v < acc ? v : acc;
            break;
        }
      }
      if (op == NcclOp::Avg) acc = C(acc / C(n));
      o[i] = T(acc);
    }
  });
}

struct EmulatedComm {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  std::string error;
  bool aborted = false;
};

// What one call (or one group of calls) left pending: MPI's requests, the host buffers they
// use, and the steps that move results into device memory once they complete.
struct PendingCalls {
  std::vector<MPI_Request> requests;
  std::vector<std::shared_ptr<std::vector<char>>> buffers;
  std::vector<std::function<void()>> after;
};

struct QueuedStream {
  std::deque<PendingCalls> queue;
  uint64_t issued = 0;
  uint64_t finished = 0;
};

struct QueuedEvent {
  QueuedStream* stream = nullptr;  // null: recorded on the compute stream, which never waits
  uint64_t target = 0;
};

MPI_Comm mpi_comm_of(void* c) {
  return static_cast<EmulatedComm*>(c)->comm;
}

}  // namespace emulated_nccl

using namespace emulated_nccl;

class EmulatedNccl::Library final : public NcclLibrary {
 public:
  explicit Library(EmulatedMemory* memory) : memory_(memory) {
    auto guard = mpi::lock();
    mpi::check(MPI_Comm_dup(MPI_COMM_WORLD, &boot_), "MPI_Comm_dup", "emulated NCCL");
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  }
  ~Library() override {
    if (!mpi::active()) return;
    auto guard = mpi::lock();
    MPI_Comm_free(&boot_);
  }

  std::string name() const override { return "emulated NCCL (MPI on host memory)"; }

  // The stand-in device's kernels run on the host: nothing is current.
  void set_device(int) override {}
  std::string device_uuid(int device) override {
    const int owner = one_gpu_ ? 0 : world_rank_;
    return "stand-in-" + std::to_string(owner) + ":" + std::to_string(device);
  }
  NcclLibrary::Stream compute_stream(int) override { return nullptr; }
  NcclLibrary::Stream create_stream(int) override { return new QueuedStream; }
  void destroy_stream(NcclLibrary::Stream s) override { delete static_cast<QueuedStream*>(s); }
  NcclLibrary::Event record_event(NcclLibrary::Stream s) override {
    auto* st = static_cast<QueuedStream*>(s);
    return new QueuedEvent{st, st ? st->issued : 0};
  }
  bool event_done(NcclLibrary::Event e) override {
    auto* ev = static_cast<QueuedEvent*>(e);
    if (!ev->stream) return true;
    progress(*ev->stream);
    return ev->stream->finished >= ev->target;
  }
  void destroy_event(NcclLibrary::Event e) override { delete static_cast<QueuedEvent*>(e); }
  // The compute stream's work is done when it is issued (kernels run on the host at once).
  void stream_wait(NcclLibrary::Stream, NcclLibrary::Event) override {}

  // Names its maker and how many ids it made before: enough for the members to find each other.
  NcclId unique_id() override {
    NcclId id;
    const int64_t words[2] = {world_rank_, ids_made_++};
    std::memcpy(id.bytes.data(), words, sizeof words);
    return id;
  }
  NcclLibrary::Comm init_rank(int, int nranks, const NcclId& id, int rank) override;
  void destroy(NcclLibrary::Comm c) override {
    auto* comm = static_cast<EmulatedComm*>(c);
    if (mpi::active() && comm->comm != MPI_COMM_NULL) {
      auto guard = mpi::lock();
      MPI_Comm_free(&comm->comm);
    }
    delete comm;
  }
  // The job ends right after an abort; the communicator is only marked, never freed.
  void abort(NcclLibrary::Comm c) override {
    static_cast<EmulatedComm*>(c)->aborted = true;
    ++aborts_;
  }
  std::string async_error(NcclLibrary::Comm c) override {
    return static_cast<EmulatedComm*>(c)->error;
  }

  void group_start() override {
    TESSERA_CHECK(!in_group_, "ncclGroupStart: a group is open already (emulated NCCL)");
    in_group_ = true;
  }
  void group_end() override {
    TESSERA_CHECK(in_group_, "ncclGroupEnd without ncclGroupStart (emulated NCCL)");
    in_group_ = false;
    if (group_stream_) push(*group_stream_, std::move(group_));
    group_ = PendingCalls{};
    group_stream_ = nullptr;
  }

  void all_reduce(const void* in, void* out, size_t count, NcclType type, NcclOp op,
                  NcclLibrary::Comm c, NcclLibrary::Stream s) override {
    if (fails(c)) return;
    const size_t bytes = count * nccl_type_size(type);
    const int n = size_of(c);
    gather_then(s, c, in, bytes, [=, this](const char* all) {
      std::vector<char> result(bytes);
      reduce_terms(result.data(), all, bytes, n, count, type, op);
      to_device(out, result.data(), bytes);
    });
  }
  void all_gather(const void* in, void* out, size_t count, NcclType type, NcclLibrary::Comm c,
                  NcclLibrary::Stream s) override {
    if (fails(c)) return;
    const size_t bytes = count * nccl_type_size(type);
    const size_t total = bytes * size_t(size_of(c));
    gather_then(s, c, in, bytes, [=, this](const char* all) { to_device(out, all, total); });
  }
  // Every rank's whole input gathered, this rank's block reduced: simple, not lean.
  void reduce_scatter(const void* in, void* out, size_t count, NcclType type, NcclOp op,
                      NcclLibrary::Comm c, NcclLibrary::Stream s) override {
    if (fails(c)) return;
    const int n = size_of(c);
    const size_t block = count * nccl_type_size(type);
    const size_t whole = block * size_t(n);
    const size_t mine = size_t(rank_of(c)) * block;
    gather_then(s, c, in, whole, [=, this](const char* all) {
      std::vector<char> result(block);
      reduce_terms(result.data(), all + mine, whole, n, count, type, op);
      to_device(out, result.data(), block);
    });
  }
  void broadcast(const void* in, void* out, size_t count, NcclType type, int root,
                 NcclLibrary::Comm c, NcclLibrary::Stream s) override {
    if (fails(c)) return;
    const size_t bytes = count * nccl_type_size(type);
    auto buf = rank_of(c) == root ? host_copy(in, bytes) : buffer(bytes);
    issue(
        s, {buf},
        [&](std::vector<MPI_Request>& r) {
          r.emplace_back();
          return MPI_Ibcast(buf->data(), int(bytes), MPI_BYTE, root, mpi_comm_of(c), &r.back());
        },
        [=, this] { to_device(out, buf->data(), bytes); });
  }
  void reduce(const void* in, void* out, size_t count, NcclType type, NcclOp op, int root,
              NcclLibrary::Comm c, NcclLibrary::Stream s) override {
    if (fails(c)) return;
    const size_t bytes = count * nccl_type_size(type);
    const int n = size_of(c);
    const bool is_root = rank_of(c) == root;
    auto mine = host_copy(in, bytes);
    auto all = buffer(is_root ? bytes * size_t(n) : 0);
    issue(
        s, {mine, all},
        [&](std::vector<MPI_Request>& r) {
          r.emplace_back();
          return MPI_Igather(mine->data(), int(bytes), MPI_BYTE, all->data(), int(bytes), MPI_BYTE,
                             root, mpi_comm_of(c), &r.back());
        },
        [=, this] {
          if (!is_root) return;
          std::vector<char> result(bytes);
          reduce_terms(result.data(), all->data(), bytes, n, count, type, op);
          to_device(out, result.data(), bytes);
        });
  }
  void send(const void* buf, size_t count, NcclType type, int peer, NcclLibrary::Comm c,
            NcclLibrary::Stream s) override {
    if (fails(c)) return;
    const size_t bytes = count * nccl_type_size(type);
    auto mine = host_copy(buf, bytes);
    issue(
        s, {mine},
        [&](std::vector<MPI_Request>& r) {
          r.emplace_back();
          return MPI_Isend(mine->data(), int(bytes), MPI_BYTE, peer, 0, mpi_comm_of(c), &r.back());
        },
        nullptr);
  }
  void recv(void* buf, size_t count, NcclType type, int peer, NcclLibrary::Comm c,
            NcclLibrary::Stream s) override {
    if (fails(c)) return;
    const size_t bytes = count * nccl_type_size(type);
    auto got = buffer(bytes);
    issue(
        s, {got},
        [&](std::vector<MPI_Request>& r) {
          r.emplace_back();
          return MPI_Irecv(got->data(), int(bytes), MPI_BYTE, peer, 0, mpi_comm_of(c), &r.back());
        },
        [=, this] { to_device(buf, got->data(), bytes); });
  }

  std::string fail_next_;
  std::atomic<bool> one_gpu_{false};
  std::atomic<int64_t> aborts_{0};
  std::atomic<int64_t> calls_{0};

 private:
  using Buffer = std::shared_ptr<std::vector<char>>;

  static int rank_of(NcclLibrary::Comm c) { return static_cast<EmulatedComm*>(c)->rank; }
  static int size_of(NcclLibrary::Comm c) { return static_cast<EmulatedComm*>(c)->size; }
  static Buffer buffer(size_t bytes) { return std::make_shared<std::vector<char>>(bytes); }

  // A call that fail_next() marked: its communicator reports the error, nothing moves.
  bool fails(NcclLibrary::Comm c) {
    ++calls_;
    auto* comm = static_cast<EmulatedComm*>(c);
    TESSERA_CHECK(!comm->aborted, "emulated NCCL: a call on an aborted communicator");
    if (fail_next_.empty()) return false;
    comm->error = std::move(fail_next_);
    fail_next_.clear();
    return true;
  }

  // The device bytes at `p`, read now: the inputs' kernels ran when they were queued.
  Buffer host_copy(const void* p, size_t bytes) {
    Buffer b = buffer(bytes);
    if (bytes == 0) return b;
    memory_->open();
    std::memcpy(b->data(), p, bytes);
    memory_->close();
    return b;
  }
  void to_device(void* p, const char* src, size_t bytes) {
    if (bytes == 0) return;
    memory_->open();
    std::memcpy(p, src, bytes);
    memory_->close();
  }

  // Gathers `bytes` of every member's `in` (read now) and runs `after` on the members' bytes
  // side by side once they have arrived.
  void gather_then(NcclLibrary::Stream s, NcclLibrary::Comm c, const void* in, size_t bytes,
                   std::function<void(const char*)> after) {
    Buffer mine = host_copy(in, bytes);
    Buffer all = buffer(bytes * size_t(size_of(c)));
    issue(
        s, {mine, all},
        [&](std::vector<MPI_Request>& r) {
          r.emplace_back();
          return MPI_Iallgather(mine->data(), int(bytes), MPI_BYTE, all->data(), int(bytes),
                                MPI_BYTE, mpi_comm_of(c), &r.back());
        },
        [all, after = std::move(after)] { after(all->data()); });
  }

  // Starts the MPI calls `start` makes and queues them with `after` on stream `s` (on the open
  // group, if any, to be queued at group_end).
  void issue(NcclLibrary::Stream s, std::vector<Buffer> buffers,
             const std::function<int(std::vector<MPI_Request>&)>& start,
             std::function<void()> after) {
    auto* stream = static_cast<QueuedStream*>(s);
    PendingCalls single;
    PendingCalls& p = in_group_ ? group_ : single;
    {
      auto guard = mpi::lock();
      mpi::check(start(p.requests), "a non-blocking MPI call", "emulated NCCL");
    }
    for (Buffer& b : buffers)
      p.buffers.push_back(std::move(b));
    if (after) p.after.push_back(std::move(after));
    if (in_group_) {
      TESSERA_CHECK(!group_stream_ || group_stream_ == stream,
                    "emulated NCCL: one group of calls on two streams");
      group_stream_ = stream;
    } else {
      push(*stream, std::move(single));
    }
  }
  static void push(QueuedStream& s, PendingCalls p) {
    s.queue.push_back(std::move(p));
    ++s.issued;
  }
  // Completes the stream's operations in order, as far as MPI has carried them.
  void progress(QueuedStream& s) {
    while (!s.queue.empty()) {
      PendingCalls& p = s.queue.front();
      int done = 0;
      {
        auto guard = mpi::lock();
        mpi::check(
            MPI_Testall(int(p.requests.size()), p.requests.data(), &done, MPI_STATUSES_IGNORE),
            "MPI_Testall", "emulated NCCL");
      }
      if (!done) return;
      for (auto& f : p.after)
        f();
      s.queue.pop_front();
      ++s.finished;
    }
  }

  EmulatedMemory* memory_;
  MPI_Comm boot_ = MPI_COMM_NULL;
  int world_rank_ = 0;
  int64_t ids_made_ = 0;
  bool in_group_ = false;
  PendingCalls group_;
  QueuedStream* group_stream_ = nullptr;
};

// The members find each other through the id's maker: each tells it their world rank, it
// answers with every member's, and they make a communicator over exactly those.
NcclLibrary::Comm EmulatedNccl::Library::init_rank(int, int nranks, const NcclId& id, int rank) {
  int64_t words[2];
  std::memcpy(words, id.bytes.data(), sizeof words);
  const int maker = int(words[0]);
  const int tag = 100 + int(words[1] % 10000) * 2;
  std::vector<int> world(size_t(nranks), -1);
  auto guard = mpi::lock();
  if (world_rank_ == maker) {
    world[size_t(rank)] = world_rank_;
    for (int k = 1; k < nranks; ++k) {
      int msg[2];
      mpi::check(MPI_Recv(msg, 2, MPI_INT, MPI_ANY_SOURCE, tag, boot_, MPI_STATUS_IGNORE),
                 "MPI_Recv", "emulated ncclCommInitRank");
      world[size_t(msg[0])] = msg[1];
    }
    for (int r = 0; r < nranks; ++r)
      if (world[size_t(r)] != world_rank_)
        mpi::check(MPI_Send(world.data(), nranks, MPI_INT, world[size_t(r)], tag + 1, boot_),
                   "MPI_Send", "emulated ncclCommInitRank");
  } else {
    const int msg[2] = {rank, world_rank_};
    mpi::check(MPI_Send(msg, 2, MPI_INT, maker, tag, boot_), "MPI_Send",
               "emulated ncclCommInitRank");
    mpi::check(MPI_Recv(world.data(), nranks, MPI_INT, maker, tag + 1, boot_, MPI_STATUS_IGNORE),
               "MPI_Recv", "emulated ncclCommInitRank");
  }
  MPI_Group all = MPI_GROUP_NULL, members = MPI_GROUP_NULL;
  MPI_Comm_group(boot_, &all);
  MPI_Group_incl(all, nranks, world.data(), &members);
  auto* comm = new EmulatedComm;
  comm->rank = rank;
  comm->size = nranks;
  const int rc = MPI_Comm_create_group(boot_, members, tag, &comm->comm);
  MPI_Group_free(&members);
  MPI_Group_free(&all);
  if (rc != MPI_SUCCESS) delete comm;
  mpi::check(rc, "MPI_Comm_create_group", "emulated ncclCommInitRank");
  return comm;
}

EmulatedNccl::EmulatedNccl(EmulatedMemory* memory) : lib_(std::make_unique<Library>(memory)) {
  TESSERA_CHECK(set_nccl_library(lib_.get()) == nullptr,
                "EmulatedNccl: another NCCL library is installed already");
}

EmulatedNccl::~EmulatedNccl() {
  set_nccl_library(nullptr);
}

void EmulatedNccl::fail_next(const std::string& error) {
  lib_->fail_next_ = error;
}
void EmulatedNccl::pretend_one_gpu(bool shared) {
  lib_->one_gpu_ = shared;
}
int64_t EmulatedNccl::aborts() const {
  return lib_->aborts_.load();
}
int64_t EmulatedNccl::calls() const {
  return lib_->calls_.load();
}

}  // namespace tessera::detail
