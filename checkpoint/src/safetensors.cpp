#include "tessera/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

#include "durable.h"
#include "tessera/core/factory.h"

namespace tessera {

// Tensors are written and read as raw host bytes; the format is little-endian.
static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian host");

namespace {

// The reference implementation refuses larger headers (100 MB, decimal), so a file with a larger
// one would be readable by Tessera alone.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypes[] = {
    {DType::Float32, "F32"}, {DType::Float64, "F64"}, {DType::BFloat16, "BF16"},
    {DType::Float16, "F16"}, {DType::Int64, "I64"},   {DType::Int32, "I32"},
    {DType::Bool, "BOOL"},
};

const char* name_of(DType dt) {
  for (const auto& d : kDTypes)
    if (d.dtype == dt) return d.name;
  TESSERA_FAIL("safetensors: no name for dtype ", dtype_name(dt));
}

struct Header {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

// Names come from the file: a hostile one must not turn an error message into megabytes.
std::string shown(const std::string& s) {
  constexpr size_t kMax = 120;
  return "'" + (s.size() <= kMax ? s : s.substr(0, kMax) + "...") + "'";
}

[[noreturn]] void bad(const std::string& file, const std::string& what) {
  TESSERA_FAIL("safetensors file '", file, "' is malformed: ", what);
}

uint64_t get_u64(const nlohmann::json& v, const std::string& file, const std::string& what) {
  if (!v.is_number_unsigned()) bad(file, what + " is not a non-negative integer");
  return v.get<uint64_t>();
}

Header parse_entry(const std::string& name, const nlohmann::json& v, const std::string& file) {
  const std::string where = "tensor " + shown(name);
  if (name.empty()) bad(file, "a tensor has an empty name");
  if (!v.is_object()) bad(file, where + " is not an object");
  for (const auto& [k, x] : v.items()) {
    (void)x;
    if (k != "dtype" && k != "shape" && k != "data_offsets")
      bad(file, where + " has an unknown field " + shown(k));
  }
  for (const char* k : {"dtype", "shape", "data_offsets"})
    if (!v.contains(k)) bad(file, where + " lacks \"" + k + "\"");
  Header h;
  h.name = name;
  if (!v["dtype"].is_string()) bad(file, where + ": dtype is not a string");
  const std::string dt = v["dtype"].get<std::string>();
  const auto* found = std::find_if(std::begin(kDTypes), std::end(kDTypes),
                                   [&](const DTypeName& d) { return dt == d.name; });
  if (found == std::end(kDTypes))
    TESSERA_FAIL("safetensors file '", file, "': ", where, " has dtype ", shown(dt),
                 ", which Tessera does not support (F32, F64, BF16, F16, I64, I32, BOOL)");
  h.dtype = found->dtype;
  if (!v["shape"].is_array()) bad(file, where + ": shape is not an array");
  // Tessera's strides are products of the dims (zeros counted as ones), so those must fit in
  // int64 even when a zero dim makes the tensor empty.
  constexpr uint64_t kMaxIndex = uint64_t(std::numeric_limits<int64_t>::max());
  uint64_t extent = 1;
  bool empty_dim = false;
  for (const auto& d : v["shape"]) {
    const uint64_t n = get_u64(d, file, where + ": a dim of shape");
    if (n > kMaxIndex || (n > 1 && extent > kMaxIndex / n))
      bad(file, where + ": the product of the dims of its shape overflows a 64-bit index (dim " +
                    std::to_string(h.shape.size()) + " is " + std::to_string(n) + ")");
    extent *= std::max<uint64_t>(n, 1);
    empty_dim = empty_dim || n == 0;
    h.shape.push_back(int64_t(n));
  }
  const auto& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2) bad(file, where + ": data_offsets is not [begin, end]");
  h.begin = get_u64(off[0], file, where + ": data_offsets[0]");
  h.end = get_u64(off[1], file, where + ": data_offsets[1]");
  if (h.end < h.begin)
    bad(file, where + ": data_offsets [" + std::to_string(h.begin) + ", " + std::to_string(h.end) +
                  "] end before they begin");
  const uint64_t numel = empty_dim ? 0 : extent;
  const uint64_t es = element_size(h.dtype);
  const std::string needs = numel > std::numeric_limits<uint64_t>::max() / es
                                ? "2^64 or more"
                                : std::to_string(numel * es);
  if (numel > std::numeric_limits<uint64_t>::max() / es || numel * es != h.end - h.begin)
    bad(file, where + ": shape " + shape_str(h.shape) + " of " + dt + " needs " + needs +
                  " bytes but data_offsets span " + std::to_string(h.end - h.begin));
  return h;
}

// A valid header nests three deep: the object of tensors, a tensor's object, its shape array.
constexpr int kMaxDepth = 3;

// Checks the JSON's structure while nlohmann builds it: the library silently keeps the last of
// duplicate keys (a file that means two things), and a header of nested brackets would cost far
// more memory than its bytes before any later check could reject it.
class StructureCheck {
 public:
  explicit StructureCheck(const std::string& file) : file_(file) {}

  bool operator()(int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    switch (event) {
      case E::object_start:
      case E::array_start:
        if (depth >= kMaxDepth)
          bad(file_, "the header nests deeper than " + std::to_string(kMaxDepth) +
                         " levels, which no safetensors header does");
        if (event == E::object_start) keys_.emplace_back();
        break;
      case E::object_end:
        keys_.pop_back();
        break;
      case E::key: {
        const std::string& k = parsed.get_ref<const std::string&>();
        if (depth == 1) top_key_ = k;
        if (!keys_.back().insert(k).second) {
          if (depth == 1) bad(file_, "the name " + shown(k) + " appears twice in the header");
          bad(file_, shown(top_key_) + " has the key " + shown(k) + " twice");
        }
        break;
      }
      default:
        break;
    }
    return true;
  }

 private:
  const std::string& file_;
  std::vector<std::set<std::string>> keys_;
  std::string top_key_;
};

nlohmann::json parse_header(const char* text, uint64_t n, const std::string& file) {
  // nlohmann ends its input at a NUL byte, so "{}\0anything" would pass; JSON has no raw NULs.
  if (const void* nul = std::memchr(text, 0, n))
    bad(file, "the header is not valid JSON: a NUL byte at offset " +
                  std::to_string(static_cast<const char*>(nul) - text));
  StructureCheck check(file);
  try {
    return nlohmann::json::parse(text, text + n, std::ref(check));
  } catch (const nlohmann::json::exception& e) {
    // nlohmann quotes the offending token, which may be most of the header.
    std::string what = e.what();
    if (what.size() > 300) what = what.substr(0, 300) + "...";
    bad(file, "the header is not valid JSON: " + what);
  }
}

bool valid_utf8(const std::string& s) {
  try {
    (void)nlohmann::json(s).dump();
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

// Writes `pieces` to a temporary file of this call's own beside `path` (two writers of one path
// never share one), flushes it, renames it over `path` and flushes the directory: `path` holds
// the previous file or the whole new one, also after a crash of the machine.
void write_durably(const std::string& path,
                   const std::vector<std::pair<const void*, size_t>>& pieces) {
  static std::atomic<uint64_t> serial{0};
  const std::string tmp =
      path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(serial++);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  TESSERA_CHECK(fd >= 0, "save_safetensors: cannot create '", tmp, "': ", std::strerror(errno));
  const auto fail = [&](const char* what, int err) {
    ::close(fd);
    ::unlink(tmp.c_str());
    TESSERA_FAIL("save_safetensors: ", what, " '", tmp, "' failed: ", std::strerror(err));
  };
  for (const auto& [data, size] : pieces) {
    const char* p = static_cast<const char*>(data);
    for (size_t done = 0; done < size;) {
      const ssize_t w = ::write(fd, p + done, size - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail("writing", w < 0 ? errno : EIO);
      done += size_t(w);
    }
  }
  if (::fsync(fd) != 0) fail("flushing", errno);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    TESSERA_FAIL("save_safetensors: closing '", tmp, "' failed: ", std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    TESSERA_FAIL("save_safetensors: renaming '", tmp, "' to '", path, "': ", std::strerror(err));
  }
  ckpt::fsync_path(ckpt::parent_dir(path), /*directory=*/true);
}

}  // namespace

SafetensorsFile parse_safetensors(const void* data, size_t size, const std::string& file) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (size < 8) bad(file, std::to_string(size) + " bytes, shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | bytes[i];
  if (n > kMaxHeaderBytes)
    bad(file, "header length " + std::to_string(n) + " exceeds the format's limit of " +
                  std::to_string(kMaxHeaderBytes) + " bytes");
  if (n > size - 8)
    bad(file, "header length " + std::to_string(n) + " runs past the end of the file (" +
                  std::to_string(size) + " bytes)");
  const char* text = reinterpret_cast<const char*>(bytes + 8);
  if (n == 0 || text[0] != '{') bad(file, "the header does not start with '{'");
  const nlohmann::json header = parse_header(text, n, file);
  if (!header.is_object()) bad(file, "the header is not a JSON object");
  SafetensorsFile out;
  std::vector<Header> entries;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (v.is_null()) continue;
      if (!v.is_object()) bad(file, "__metadata__ is not an object");
      for (const auto& [k, x] : v.items()) {
        if (!x.is_string()) bad(file, "__metadata__ value of " + shown(k) + " is not a string");
        out.metadata[k] = x.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(name, v, file));
  }
  // The byte buffer must be exactly the tensors, one after another.
  const uint64_t buffer = size - 8 - n;
  std::sort(entries.begin(), entries.end(), [](const Header& a, const Header& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  for (const Header& h : entries) {
    if (h.begin != at)
      bad(file, "tensor " + shown(h.name) + " starts at byte " + std::to_string(h.begin) +
                    " but the previous one ends at " + std::to_string(at) +
                    " (data must be contiguous, without gaps or overlaps)");
    at = h.end;
  }
  if (at != buffer)
    bad(file, "the tensors cover " + std::to_string(at) + " bytes but the data section holds " +
                  std::to_string(buffer));
  const unsigned char* base = bytes + 8 + n;
  for (const Header& h : entries) {
    // Any other byte would be an invalid C++ bool once read.
    if (h.dtype == DType::Bool)
      for (uint64_t i = h.begin; i < h.end; ++i)
        if (base[i] > 1)
          bad(file, "tensor " + shown(h.name) + " holds a bool byte " + std::to_string(base[i]) +
                        " that is neither 0 nor 1");
    Tensor t = empty(h.shape, h.dtype);
    if (h.end > h.begin) std::memcpy(t.raw_data(), base + h.begin, size_t(h.end - h.begin));
    out.tensors[h.name] = t;
  }
  return out;
}

SafetensorsFile load_safetensors(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, "safetensors file '", path, "' cannot be opened: ", std::strerror(errno));
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_fd{fd};
  // The size comes from fstat, which is meaningless for a directory or a pipe.
  struct stat st {};
  TESSERA_CHECK(::fstat(fd, &st) == 0, "safetensors file '", path, "': ", std::strerror(errno));
  TESSERA_CHECK(S_ISREG(st.st_mode), "safetensors file '", path, "' is not a regular file");
  std::vector<unsigned char> buf(size_t(st.st_size));
  for (size_t got = 0; got < buf.size();) {
    const ssize_t r = ::read(fd, buf.data() + got, buf.size() - got);
    if (r < 0 && errno == EINTR) continue;
    TESSERA_CHECK(r > 0, "safetensors file '", path, "': reading failed after ", got, " of ",
                  buf.size(), " bytes: ", r == 0 ? "the file got shorter" : std::strerror(errno));
    got += size_t(r);
  }
  return parse_safetensors(buf.data(), buf.size(), path);
}

void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // Everything is checked before the file is created: what this writes, the reader accepts.
  for (const auto& [k, v] : metadata)
    TESSERA_CHECK(valid_utf8(k) && valid_utf8(v), "save_safetensors: metadata ", shown(k),
                  " is not valid UTF-8 (JSON strings are Unicode)");
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const auto& [name, t] : tensors) {
    TESSERA_CHECK(!name.empty(), "save_safetensors: a tensor has an empty name");
    TESSERA_CHECK(name != "__metadata__", "save_safetensors: '__metadata__' is reserved");
    TESSERA_CHECK(valid_utf8(name), "save_safetensors: the tensor name ", shown(name),
                  " is not valid UTF-8 (JSON strings are Unicode)");
    TESSERA_CHECK(t.defined(), "save_safetensors: tensor ", shown(name), " is undefined");
  }
  // The data in order of element size, largest first, then of name (as the Python package
  // writes it): after the 8-byte-aligned start every tensor begins at a multiple of its element
  // size, so readers that map the file can use each tensor in place.
  std::vector<std::pair<std::string, Tensor>> order(tensors.begin(), tensors.end());
  std::stable_sort(order.begin(), order.end(), [](const auto& x, const auto& y) {
    return element_size(x.second.dtype()) > element_size(y.second.dtype());
  });
  uint64_t at = 0;
  std::vector<Tensor> dense;
  for (const auto& [name, t] : order) {
    // As safetensors' save_file, a device tensor is copied to the host to be written.
    // Tensor copies within one dtype move bits: NaN payloads survive.
    Tensor c = t.to(Device::cpu()).contiguous();
    const uint64_t nbytes = c.nbytes();
    header[name] = {
        {"dtype", name_of(c.dtype())}, {"shape", c.shape()}, {"data_offsets", {at, at + nbytes}}};
    at += nbytes;
    dense.push_back(c);
  }
  std::string text = header.dump();
  TESSERA_CHECK(text.size() <= kMaxHeaderBytes, "save_safetensors: '", path, "' would need a ",
                text.size(), "-byte header, more than the format's limit of ", kMaxHeaderBytes);
  // Padded with spaces so that the data starts 8-byte aligned, as the Python package does.
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<unsigned char>((uint64_t(text.size()) >> (8 * i)) & 0xff);
  std::vector<std::pair<const void*, size_t>> pieces = {{len, 8}, {text.data(), text.size()}};
  for (const Tensor& c : dense)
    pieces.emplace_back(c.raw_data(), c.nbytes());
  write_durably(path, pieces);
}

}  // namespace tessera
