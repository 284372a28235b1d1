#pragma once
// The HDF5 calls of the checkpoint layer, behind small RAII types (internal to checkpoint/).
//
// HDF5 is used from at most one thread at a time (this library is not built thread-safe): every
// entry point of checkpoint/ that touches a file holds h5_session() for its whole duration. Every
// call that may reach MPI-IO also holds tessera's MPI call guard, taken per call, so that
// tessera's own collectives (and an asynchronous save's writer thread) interleave with it.
// A failing call throws a tessera::Error with HDF5's own error stack in the message.
#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tessera/core/dtype.h"
#include "tessera/core/shape.h"

namespace tessera::ckpt::h5 {

// Serialises every use of HDF5 in the process; also turns HDF5's automatic error printing off.
std::unique_lock<std::recursive_mutex> h5_session();

// One HDF5 identifier, closed by the function of its kind when the owner goes away.
class Id {
 public:
  using Closer = herr_t (*)(hid_t);
  Id() = default;
  Id(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Id(Id&& o) noexcept : id_(o.id_), closer_(o.closer_) { o.id_ = H5I_INVALID_HID; }
  Id& operator=(Id&& o) noexcept;
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  ~Id();
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes now and reports a failure (a destructor can only swallow it).
  void close(const std::string& what);

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

// Throws an Error made of `what` and the text of HDF5's current error stack when rc < 0.
void check(int64_t rc, const std::string& what);

// --- types ---
// The file type of a dtype (little-endian; bfloat16 and float16 as HDF5 floats of 16 bits, read
// by h5py as float32 and float16; bool as h5py's enum of int8). The memory type is the same.
Id type_of(DType dt);

// --- files ---
enum class Driver { Local, MpiIo };
// Creates (truncating) or opens read-only. MpiIo is collective over `comm`.
Id create_file(const std::string& path, MPI_Comm comm);
Id open_file(const std::string& path, Driver driver, MPI_Comm comm = MPI_COMM_NULL);
// Flushes HDF5's buffers and, for an MPI-IO file, MPI_File_sync's it (collective).
void flush_file(const Id& file, const std::string& what);

// --- objects ---
bool link_exists(const Id& loc, const std::string& path);
bool is_dataset(const Id& loc, const std::string& path);
Id open_group(const Id& loc, const std::string& path);
// Creates the group and every missing group above it.
Id create_group(const Id& loc, const std::string& path);
// A contiguous dataset allocated at creation with no fill (every byte is written once).
Id create_dataset(const Id& loc, const std::string& path, DType dtype, const Shape& shape);
Id open_dataset(const Id& loc, const std::string& path);
Shape dataset_shape(const Id& dataset);
// Where a contiguous dataset of `file` has its elements (row-major, in the dataset's type) as a
// byte offset into the file, user block included; -1 when its storage is not one allocated block.
int64_t dataset_file_offset(const Id& file, const Id& dataset);
// Names of the members of a group (sorted by name).
std::vector<std::string> group_members(const Id& group);

// --- raw blocks ---
// Writes/reads the block [offset, offset + shape) of `dataset` (the entry `key`, named by an
// error), with `data` holding it densely (row-major). A write with `active` false takes part in
// a collective transfer with no data; reads are independent.
enum class Transfer { Independent, Collective };
void write_block(const Id& dataset, DType dtype, const Shape& offset, const Shape& shape,
                 const void* data, bool active, Transfer transfer, const std::string& key);
void read_block(const Id& dataset, DType dtype, const Shape& offset, const Shape& shape, void* data,
                const std::string& key);
// Unsigned 64-bit 1-D datasets (the checksum table).
Id create_u64_dataset(const Id& loc, const std::string& path, int64_t n);
void write_u64(const Id& dataset, const std::vector<uint64_t>& values, bool active);
std::vector<uint64_t> read_u64(const Id& dataset);

// --- attributes (metadata: every rank writes the same value, collectively under MPI-IO) ---
bool attr_exists(const Id& obj, const std::string& name);
// Several: an attribute of more (or fewer) than one value, of any type (an array another tool
// added); the read_attr_* functions refuse it.
enum class AttrKind { Int, Float, String, Other, Several };
AttrKind attr_kind(const Id& obj, const std::string& name);
void write_attr(const Id& obj, const std::string& name, int64_t value);
void write_attr(const Id& obj, const std::string& name, double value);
void write_attr(const Id& obj, const std::string& name, const std::string& value);
void write_attr_u64(const Id& obj, const std::string& name, uint64_t value);
int64_t read_attr_int(const Id& obj, const std::string& name);
uint64_t read_attr_u64(const Id& obj, const std::string& name);
double read_attr_double(const Id& obj, const std::string& name);
std::string read_attr_string(const Id& obj, const std::string& name);
// Names of the attributes of an object.
std::vector<std::string> attr_names(const Id& obj);

}  // namespace tessera::ckpt::h5
