#pragma once
// What the NCCL group asks of NCCL and of the device's streams (internal to comm/), so that the
// group's own logic runs wherever the calls are bound: a CUDA build binds them to libnccl (opened
// on first use) and the CUDA runtime (cuda/nccl_library.cpp); a machine without a GPU binds them
// to an emulation over MPI on a stand-in device's host memory (emulated_nccl.cpp), which is how
// the CPU suite tests the bootstrap, the mapping of each collective onto NCCL calls, the
// ordering by events, errors and aborts.
//
// The calls mirror NCCL's: operations are enqueued on a stream and return at once; those issued
// between group_start() and group_end() run as one (how NCCL pairs sends with receives). Every
// call throws a tessera::Error naming the library call and the library's own text on failure;
// the group adds which operation, group, rank and device it was for.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace tessera::detail {

// ncclUniqueId: made by one rank, handed to every member to make a communicator with.
struct NcclId {
  std::array<char, 128> bytes{};
};
enum class NcclType : uint8_t { Uint8, Int32, Int64, Float16, Float32, Float64, BFloat16 };
// Avg is NCCL's own (integers: the sum divided with truncation); the group uses it for integers
// only, since NCCL averages floats by scaling each term first, which rounds differently from
// the CPU group's sum divided by the size.
enum class NcclOp : uint8_t { Sum, Prod, Max, Min, Avg };

class NcclLibrary {
 public:
  using Comm = void*;
  using Stream = void*;
  using Event = void*;

  virtual ~NcclLibrary() = default;
  // "NCCL 2.28.3", for messages.
  virtual std::string name() const = 0;

  // --- devices and streams
  // Makes `device` the calling thread's current device: events are made, and the compute stream
  // is, on the current device.
  virtual void set_device(int device) = 0;
  // Names the physical device behind `device` (its UUID): equal for two processes on one GPU.
  virtual std::string device_uuid(int device) = 0;
  // The stream Tessera's kernels and copies on `device` run on.
  virtual Stream compute_stream(int device) = 0;
  // A stream of its own that does not synchronise with the compute stream implicitly.
  virtual Stream create_stream(int device) = 0;
  virtual void destroy_stream(Stream stream) = 0;
  // A new event, recorded on `stream` now.
  virtual Event record_event(Stream stream) = 0;
  virtual bool event_done(Event event) = 0;
  virtual void destroy_event(Event event) = 0;
  // Work enqueued on `stream` from now on starts after `event`.
  virtual void stream_wait(Stream stream, Event event) = 0;

  // --- communicators
  virtual NcclId unique_id() = 0;
  // Collective over the `nranks` processes passing the same id, each with its own `rank`.
  virtual Comm init_rank(int device, int nranks, const NcclId& id, int rank) = 0;
  // Frees a communicator with nothing pending, without waiting for the other ranks: NCCL's own
  // destroy is collective within a node, and ranks that free their groups in different orders
  // would hang in it (so the system library aborts the idle communicator, as PyTorch does).
  virtual void destroy(Comm comm) = 0;
  // Stops the communicator's pending operations, whatever state they are in.
  virtual void abort(Comm comm) = 0;
  // "" while the communicator is healthy, else what failed in the background.
  virtual std::string async_error(Comm comm) = 0;

  // --- operations, enqueued on `stream`; counts are elements
  virtual void group_start() = 0;
  virtual void group_end() = 0;
  virtual void all_reduce(const void* in, void* out, size_t count, NcclType type, NcclOp op,
                          Comm comm, Stream stream) = 0;
  // `count` elements per rank.
  virtual void all_gather(const void* in, void* out, size_t count, NcclType type, Comm comm,
                          Stream stream) = 0;
  // `count` elements per rank (the output's).
  virtual void reduce_scatter(const void* in, void* out, size_t count, NcclType type, NcclOp op,
                              Comm comm, Stream stream) = 0;
  // `in` is read on the root only; every rank's `out` receives.
  virtual void broadcast(const void* in, void* out, size_t count, NcclType type, int root,
                         Comm comm, Stream stream) = 0;
  // `out` is written on the root only (others may pass nullptr).
  virtual void reduce(const void* in, void* out, size_t count, NcclType type, NcclOp op, int root,
                      Comm comm, Stream stream) = 0;
  virtual void send(const void* buf, size_t count, NcclType type, int peer, Comm comm,
                    Stream stream) = 0;
  virtual void recv(void* buf, size_t count, NcclType type, int peer, Comm comm, Stream stream) = 0;
};

// The library NCCL groups use: the one installed by set_nccl_library, else libnccl with the
// CUDA runtime. Throws, saying why, where neither is there (a build without CUDA, a machine
// without libnccl.so.2).
NcclLibrary& nccl_library();
// Installs `library` for groups made from now on (nullptr restores libnccl); returns the
// previous one. Groups keep the library they were made with.
NcclLibrary* set_nccl_library(NcclLibrary* library);
// Why libnccl cannot be used here, "" when it can; and the library bound to it (an error saying
// why where it cannot be). Defined by cuda/nccl_library.cpp, or by nccl_library.cpp in a build
// that cannot bind libnccl (no CUDA, no nccl.h), where the answer is always why not.
std::string system_nccl_unavailable();
NcclLibrary& system_nccl_library();

}  // namespace tessera::detail
