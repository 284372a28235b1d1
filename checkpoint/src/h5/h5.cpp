#include "h5.h"

#include <sys/stat.h>

#include <bit>
#include <cstring>

#include "tessera/comm/mpi_interop.h"
#include "tessera/core/error.h"

namespace tessera::ckpt::h5 {

namespace {

// The MPI call guard, re-entrant on one thread: an identifier closed inside a wrapper that holds
// it (a dataspace going out of scope) must not wait for itself.
class MpiLock {
 public:
  MpiLock() {
    if (depth_++ == 0) guard_.emplace();
  }
  ~MpiLock() { --depth_; }
  MpiLock(const MpiLock&) = delete;
  MpiLock& operator=(const MpiLock&) = delete;

 private:
  static thread_local int depth_;
  std::optional<MpiCallGuard> guard_;
};
thread_local int MpiLock::depth_ = 0;

herr_t collect_error(unsigned n, const H5E_error2_t* e, void* client) {
  auto* text = static_cast<std::string*>(client);
  if (n > 0) *text += "; ";
  *text += std::string(e->func_name ? e->func_name : "?") + "(): " + (e->desc ? e->desc : "");
  return 0;
}

std::string error_stack() {
  std::string text;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect_error, &text);
  H5Eclear2(H5E_DEFAULT);
  return text;
}

std::vector<hsize_t> dims_of(const Shape& s) {
  return std::vector<hsize_t>(s.begin(), s.end());
}

Id simple_space(const Shape& shape) {
  if (shape.empty()) return Id(H5Screate(H5S_SCALAR), H5Sclose);
  auto dims = dims_of(shape);
  return Id(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
}

// The memory and file dataspaces of one block transfer.
struct Spaces {
  Id memory, file;
};

Spaces block_spaces(const Id& dataset, const Shape& offset, const Shape& shape, bool active,
                    const std::string& what) {
  Spaces s;
  s.file = Id(H5Dget_space(dataset.get()), H5Sclose);
  check(s.file.get(), what + ": H5Dget_space");
  if (active && shape_numel(shape) == 0) active = false;
  if (!active) {
    const hsize_t one = 1;
    s.memory = Id(H5Screate_simple(1, &one, nullptr), H5Sclose);
    check(H5Sselect_none(s.memory.get()), what + ": H5Sselect_none");
    check(H5Sselect_none(s.file.get()), what + ": H5Sselect_none");
    return s;
  }
  s.memory = simple_space(shape);
  check(s.memory.get(), what + ": H5Screate");
  if (!shape.empty()) {
    auto start = dims_of(offset), count = dims_of(shape);
    check(H5Sselect_hyperslab(s.file.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(),
                              nullptr),
          what + ": H5Sselect_hyperslab");
  }
  return s;
}

Id transfer_list(Transfer transfer, const std::string& what) {
  Id dxpl(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
  check(dxpl.get(), what + ": H5Pcreate");
  if (transfer == Transfer::Collective)
    check(H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_COLLECTIVE), what + ": H5Pset_dxpl_mpio");
  return dxpl;
}

Id open_attr(const Id& obj, const std::string& name) {
  Id a(H5Aopen(obj.get(), name.c_str(), H5P_DEFAULT), H5Aclose);
  check(a.get(), "opening attribute '" + name + "'");
  return a;
}

void write_scalar_attr(const Id& obj, const std::string& name, hid_t file_type, hid_t mem_type,
                       const void* value) {
  Id space(H5Screate(H5S_SCALAR), H5Sclose);
  Id a(H5Acreate2(obj.get(), name.c_str(), file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT),
       H5Aclose);
  check(a.get(), "creating attribute '" + name + "'");
  check(H5Awrite(a.get(), mem_type, value), "writing attribute '" + name + "'");
  a.close("closing attribute '" + name + "'");
}

// How many values attribute `a` holds: 1 for a scalar, more for an array (one another tool
// wrote: h5py stores a list as one), 0 for an empty one.
int64_t attr_values(const Id& a, const std::string& name) {
  Id space(H5Aget_space(a.get()), H5Sclose);
  check(space.get(), "H5Aget_space of attribute '" + name + "'");
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  check(n, "counting the values of attribute '" + name + "'");
  return int64_t(n);
}

// Reads into one value: an attribute of several would write past it.
void check_one_value(const Id& a, const std::string& name) {
  const int64_t n = attr_values(a, name);
  TESSERA_CHECK(n == 1, "attribute '", name, "' holds ", n, " values, not one");
}

template <class T>
T read_scalar_attr(const Id& obj, const std::string& name, hid_t mem_type) {
  Id a = open_attr(obj, name);
  check_one_value(a, name);
  T v{};
  check(H5Aread(a.get(), mem_type, &v), "reading attribute '" + name + "'");
  return v;
}

Id string_type(size_t size) {
  Id t(H5Tcopy(H5T_C_S1), H5Tclose);
  check(H5Tset_size(t.get(), size), "H5Tset_size");
  check(H5Tset_cset(t.get(), H5T_CSET_UTF8), "H5Tset_cset");
  return t;
}

Id file_access(Driver driver, MPI_Comm comm, const std::string& what) {
  Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  check(fapl.get(), what + ": H5Pcreate");
  // The 1.8 object formats carry checksums on all metadata, so damaged headers are detected.
  check(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST),
        what + ": H5Pset_libver_bounds");
  if (driver == Driver::MpiIo) {
    check(H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL), what + ": H5Pset_fapl_mpio");
    check(H5Pset_coll_metadata_write(fapl.get(), true), what + ": H5Pset_coll_metadata_write");
  }
  return fapl;
}

}  // namespace

std::unique_lock<std::recursive_mutex> h5_session() {
  static std::recursive_mutex m;
  std::unique_lock<std::recursive_mutex> lock(m);
  static bool quiet = [] {
    MpiLock g;
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    return true;
  }();
  (void)quiet;
  return lock;
}

Id& Id::operator=(Id&& o) noexcept {
  if (this != &o) {
    this->~Id();
    id_ = o.id_;
    closer_ = o.closer_;
    o.id_ = H5I_INVALID_HID;
  }
  return *this;
}

Id::~Id() {
  if (id_ >= 0 && closer_ != nullptr) {
    MpiLock g;
    closer_(id_);
  }
  id_ = H5I_INVALID_HID;
}

void Id::close(const std::string& what) {
  if (id_ < 0) return;
  MpiLock g;
  const hid_t id = id_;
  id_ = H5I_INVALID_HID;
  check(closer_ != nullptr ? closer_(id) : 0, what);
}

void check(int64_t rc, const std::string& what) {
  if (rc >= 0) return;
  const std::string stack = error_stack();
  TESSERA_FAIL(what, " failed", stack.empty() ? "" : " (HDF5: " + stack + ")");
}

// The memory types below are the file's little-endian ones, so HDF5 converts nothing: on a
// big-endian host the bytes would be written under a little-endian label.
static_assert(std::endian::native == std::endian::little,
              "checkpoint HDF5 I/O assumes a little-endian host");

Id type_of(DType dt) {
  MpiLock g;
  auto copy = [](hid_t t) { return Id(H5Tcopy(t), H5Tclose); };
  auto half = [&](size_t epos, size_t esize, size_t msize, size_t bias) {
    Id t = copy(H5T_IEEE_F32LE);
    check(H5Tset_fields(t.get(), 15, epos, esize, 0, msize), "H5Tset_fields");
    check(H5Tset_offset(t.get(), 0), "H5Tset_offset");
    check(H5Tset_precision(t.get(), 16), "H5Tset_precision");
    check(H5Tset_size(t.get(), 2), "H5Tset_size");
    check(H5Tset_ebias(t.get(), bias), "H5Tset_ebias");
    return t;
  };
  switch (dt) {
    case DType::Float32:
      return copy(H5T_IEEE_F32LE);
    case DType::Float64:
      return copy(H5T_IEEE_F64LE);
    case DType::Int64:
      return copy(H5T_STD_I64LE);
    case DType::Int32:
      return copy(H5T_STD_I32LE);
    case DType::BFloat16:
      return half(7, 8, 7, 127);
    case DType::Float16:
      return half(10, 5, 10, 15);
    case DType::Bool: {
      Id t(H5Tenum_create(H5T_NATIVE_INT8), H5Tclose);
      const int8_t f = 0, v = 1;
      check(H5Tenum_insert(t.get(), "FALSE", &f), "H5Tenum_insert");
      check(H5Tenum_insert(t.get(), "TRUE", &v), "H5Tenum_insert");
      return t;
    }
  }
  TESSERA_FAIL("checkpoint: no HDF5 type for dtype ", int(dt));
}

Id create_file(const std::string& path, MPI_Comm comm) {
  MpiLock g;
  const std::string what = "creating checkpoint file '" + path + "'";
  Id fapl = file_access(Driver::MpiIo, comm, what);
  Id f(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
  check(f.get(), what);
  return f;
}

Id open_file(const std::string& path, Driver driver, MPI_Comm comm) {
  struct stat st {};
  TESSERA_CHECK(::stat(path.c_str(), &st) == 0, "checkpoint '", path,
                "' does not exist: ", std::strerror(errno));
  TESSERA_CHECK(S_ISREG(st.st_mode), "checkpoint '", path, "' is not a regular file");
  MpiLock g;
  const std::string what = "opening checkpoint '" + path + "'";
  Id fapl = file_access(driver, comm, what);
  Id f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
  if (!f.valid()) {
    const std::string stack = error_stack();
    TESSERA_FAIL("checkpoint '", path, "' cannot be opened as an HDF5 file (", st.st_size,
                 " bytes): it is damaged, truncated or not a checkpoint (HDF5: ", stack, ")");
  }
  return f;
}

void flush_file(const Id& file, const std::string& what) {
  MpiLock g;
  check(H5Fflush(file.get(), H5F_SCOPE_GLOBAL), what + ": H5Fflush");
}

bool link_exists(const Id& loc, const std::string& path) {
  MpiLock g;
  // Each component in turn: H5Lexists fails (rather than answering no) below a missing group.
  if (path == "/") return true;
  size_t pos = path.rfind('/', 0) == 0 ? 1 : 0;
  while (true) {
    const size_t slash = path.find('/', pos);
    const std::string prefix = path.substr(0, slash);
    const htri_t e = H5Lexists(loc.get(), prefix.c_str(), H5P_DEFAULT);
    if (e <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return false;
    }
    if (slash == std::string::npos) return true;
    H5O_info_t info;
    if (H5Oget_info_by_name2(loc.get(), prefix.c_str(), &info, H5O_INFO_BASIC, H5P_DEFAULT) < 0 ||
        info.type != H5O_TYPE_GROUP) {
      H5Eclear2(H5E_DEFAULT);
      return false;
    }
    pos = slash + 1;
  }
}

bool is_dataset(const Id& loc, const std::string& path) {
  if (!link_exists(loc, path)) return false;
  MpiLock g;
  H5O_info_t info;
  check(H5Oget_info_by_name2(loc.get(), path.c_str(), &info, H5O_INFO_BASIC, H5P_DEFAULT),
        "inspecting '" + path + "'");
  return info.type == H5O_TYPE_DATASET;
}

Id open_group(const Id& loc, const std::string& path) {
  MpiLock g;
  Id grp(H5Gopen2(loc.get(), path.c_str(), H5P_DEFAULT), H5Gclose);
  check(grp.get(), "opening group '" + path + "'");
  return grp;
}

Id create_group(const Id& loc, const std::string& path) {
  MpiLock g;
  Id lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  check(H5Pset_create_intermediate_group(lcpl.get(), 1), "H5Pset_create_intermediate_group");
  Id grp(H5Gcreate2(loc.get(), path.c_str(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
  check(grp.get(), "creating group '" + path + "'");
  return grp;
}

Id create_dataset(const Id& loc, const std::string& path, DType dtype, const Shape& shape) {
  MpiLock g;
  const std::string what = "creating dataset '" + path + "'";
  Id lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  check(H5Pset_create_intermediate_group(lcpl.get(), 1), what);
  Id dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  check(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS), what + ": H5Pset_layout");
  check(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY), what + ": H5Pset_alloc_time");
  check(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), what + ": H5Pset_fill_time");
  Id type = type_of(dtype);
  Id space = simple_space(shape);
  check(space.get(), what + ": H5Screate");
  Id ds(H5Dcreate2(loc.get(), path.c_str(), type.get(), space.get(), lcpl.get(), dcpl.get(),
                   H5P_DEFAULT),
        H5Dclose);
  check(ds.get(), what);
  return ds;
}

Id open_dataset(const Id& loc, const std::string& path) {
  MpiLock g;
  Id ds(H5Dopen2(loc.get(), path.c_str(), H5P_DEFAULT), H5Dclose);
  check(ds.get(), "opening dataset '" + path + "'");
  return ds;
}

int64_t dataset_file_offset(const Id& file, const Id& dataset) {
  MpiLock g;
  Id dcpl(H5Dget_create_plist(dataset.get()), H5Pclose);
  check(dcpl.get(), "H5Dget_create_plist");
  if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS) return -1;
  const haddr_t at = H5Dget_offset(dataset.get());
  if (at == HADDR_UNDEF) return -1;
  // HDF5 addresses count from the end of the user block.
  Id fcpl(H5Fget_create_plist(file.get()), H5Pclose);
  check(fcpl.get(), "H5Fget_create_plist");
  hsize_t user_block = 0;
  check(H5Pget_userblock(fcpl.get(), &user_block), "H5Pget_userblock");
  return int64_t(at + user_block);
}

Shape dataset_shape(const Id& dataset) {
  MpiLock g;
  Id space(H5Dget_space(dataset.get()), H5Sclose);
  check(space.get(), "H5Dget_space");
  const int rank = H5Sget_simple_extent_ndims(space.get());
  check(rank, "H5Sget_simple_extent_ndims");
  std::vector<hsize_t> dims(size_t(rank), 0);
  if (rank > 0) check(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr), "dims");
  return Shape(dims.begin(), dims.end());
}

std::vector<std::string> group_members(const Id& group) {
  MpiLock g;
  std::vector<std::string> names;
  auto cb = [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
    static_cast<std::vector<std::string>*>(out)->push_back(name);
    return 0;
  };
  check(H5Literate(group.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr, cb, &names),
        "listing a group");
  return names;
}

void write_block(const Id& dataset, DType dtype, const Shape& offset, const Shape& shape,
                 const void* data, bool active, Transfer transfer, const std::string& key) {
  MpiLock g;
  const std::string what = "writing '" + key + "' at " + shape_str(offset);
  Spaces s = block_spaces(dataset, offset, shape, active, what);
  Id type = type_of(dtype);
  Id dxpl = transfer_list(transfer, what);
  static const char dummy = 0;
  check(H5Dwrite(dataset.get(), type.get(), s.memory.get(), s.file.get(), dxpl.get(),
                 data != nullptr ? data : &dummy),
        what);
}

void read_block(const Id& dataset, DType dtype, const Shape& offset, const Shape& shape, void* data,
                const std::string& key) {
  MpiLock g;
  const std::string what = "reading '" + key + "' at " + shape_str(offset);
  Spaces s = block_spaces(dataset, offset, shape, /*active=*/true, what);
  Id type = type_of(dtype);
  Id dxpl = transfer_list(Transfer::Independent, what);
  check(H5Dread(dataset.get(), type.get(), s.memory.get(), s.file.get(), dxpl.get(), data), what);
}

Id create_u64_dataset(const Id& loc, const std::string& path, int64_t n) {
  MpiLock g;
  const std::string what = "creating dataset '" + path + "'";
  Id lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  check(H5Pset_create_intermediate_group(lcpl.get(), 1), what);
  Id dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  check(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY), what);
  Id space = simple_space(Shape{n});
  Id ds(H5Dcreate2(loc.get(), path.c_str(), H5T_STD_U64LE, space.get(), lcpl.get(), dcpl.get(),
                   H5P_DEFAULT),
        H5Dclose);
  check(ds.get(), what);
  return ds;
}

void write_u64(const Id& dataset, const std::vector<uint64_t>& values, bool active) {
  MpiLock g;
  Spaces s = block_spaces(dataset, Shape{0}, Shape{int64_t(values.size())}, active, "u64 write");
  Id dxpl = transfer_list(Transfer::Collective, "u64 write");
  static const uint64_t dummy = 0;
  check(H5Dwrite(dataset.get(), H5T_NATIVE_UINT64, s.memory.get(), s.file.get(), dxpl.get(),
                 values.empty() ? &dummy : values.data()),
        "writing the checksum table");
}

std::vector<uint64_t> read_u64(const Id& dataset) {
  const Shape shape = dataset_shape(dataset);
  MpiLock g;
  TESSERA_CHECK(shape.size() == 1, "checkpoint: the checksum table is not 1-D but ",
                shape_str(shape));
  std::vector<uint64_t> out(static_cast<size_t>(shape[0]), 0);
  if (out.empty()) return out;
  check(H5Dread(dataset.get(), H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()),
        "reading the checksum table");
  return out;
}

bool attr_exists(const Id& obj, const std::string& name) {
  MpiLock g;
  const htri_t e = H5Aexists(obj.get(), name.c_str());
  check(e, "looking for attribute '" + name + "'");
  return e > 0;
}

AttrKind attr_kind(const Id& obj, const std::string& name) {
  MpiLock g;
  Id a = open_attr(obj, name);
  if (attr_values(a, name) != 1) return AttrKind::Several;
  Id t(H5Aget_type(a.get()), H5Tclose);
  check(t.get(), "H5Aget_type");
  switch (H5Tget_class(t.get())) {
    case H5T_INTEGER:
      return AttrKind::Int;
    case H5T_FLOAT:
      return AttrKind::Float;
    case H5T_STRING:
      return AttrKind::String;
    default:
      return AttrKind::Other;
  }
}

void write_attr(const Id& obj, const std::string& name, int64_t value) {
  MpiLock g;
  write_scalar_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value);
}

void write_attr(const Id& obj, const std::string& name, double value) {
  MpiLock g;
  write_scalar_attr(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &value);
}

void write_attr_u64(const Id& obj, const std::string& name, uint64_t value) {
  MpiLock g;
  write_scalar_attr(obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &value);
}

void write_attr(const Id& obj, const std::string& name, const std::string& value) {
  MpiLock g;
  // Variable length, UTF-8: h5py reads it as a str.
  Id t = string_type(H5T_VARIABLE);
  const char* p = value.c_str();
  write_scalar_attr(obj, name, t.get(), t.get(), &p);
}

int64_t read_attr_int(const Id& obj, const std::string& name) {
  MpiLock g;
  return read_scalar_attr<int64_t>(obj, name, H5T_NATIVE_INT64);
}

uint64_t read_attr_u64(const Id& obj, const std::string& name) {
  MpiLock g;
  return read_scalar_attr<uint64_t>(obj, name, H5T_NATIVE_UINT64);
}

double read_attr_double(const Id& obj, const std::string& name) {
  MpiLock g;
  return read_scalar_attr<double>(obj, name, H5T_NATIVE_DOUBLE);
}

std::string read_attr_string(const Id& obj, const std::string& name) {
  MpiLock g;
  Id a = open_attr(obj, name);
  check_one_value(a, name);
  Id t(H5Aget_type(a.get()), H5Tclose);
  check(t.get(), "H5Aget_type");
  TESSERA_CHECK(H5Tget_class(t.get()) == H5T_STRING, "attribute '", name, "' is not a string");
  if (H5Tis_variable_str(t.get()) > 0) {
    char* s = nullptr;
    Id mt = string_type(H5T_VARIABLE);
    check(H5Aread(a.get(), mt.get(), &s), "reading attribute '" + name + "'");
    std::string out = s ? s : "";
    Id space(H5Aget_space(a.get()), H5Sclose);
    H5Dvlen_reclaim(mt.get(), space.get(), H5P_DEFAULT, &s);
    return out;
  }
  const size_t size = H5Tget_size(t.get());
  std::string buf(size, '\0');
  check(H5Aread(a.get(), t.get(), buf.data()), "reading attribute '" + name + "'");
  const size_t end = buf.find('\0');
  if (end != std::string::npos) buf.resize(end);
  return buf;
}

std::vector<std::string> attr_names(const Id& obj) {
  MpiLock g;
  std::vector<std::string> names;
  auto cb = [](hid_t, const char* name, const H5A_info_t*, void* out) -> herr_t {
    static_cast<std::vector<std::string>*>(out)->push_back(name);
    return 0;
  };
  hsize_t idx = 0;
  check(H5Aiterate2(obj.get(), H5_INDEX_NAME, H5_ITER_INC, &idx, cb, &names), "listing attributes");
  return names;
}

}  // namespace tessera::ckpt::h5
