#include "tessera/checkpoint/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <vector>

#include "tessera/core/factory.h"

namespace tessera {

namespace {

// The Python package refuses larger headers too.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

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

[[noreturn]] void bad(const std::string& file, const std::string& what) {
  TESSERA_FAIL("safetensors file '", file, "' is malformed: ", what);
}

uint64_t get_u64(const nlohmann::json& v, const std::string& file, const std::string& what) {
  if (!v.is_number_unsigned()) bad(file, what + " is not a non-negative integer");
  return v.get<uint64_t>();
}

Header parse_entry(const std::string& name, const nlohmann::json& v, const std::string& file) {
  const std::string where = "tensor '" + name + "'";
  if (!v.is_object()) bad(file, where + " is not an object");
  for (const auto& [k, x] : v.items()) {
    (void)x;
    if (k != "dtype" && k != "shape" && k != "data_offsets")
      bad(file, where + " has an unknown field '" + k + "'");
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
    TESSERA_FAIL("safetensors file '", file, "': ", where, " has dtype ", dt,
                 ", which Tessera does not support (F32, F64, BF16, F16, I64, I32, BOOL)");
  h.dtype = found->dtype;
  if (!v["shape"].is_array()) bad(file, where + ": shape is not an array");
  uint64_t numel = 1;
  for (const auto& d : v["shape"]) {
    const uint64_t n = get_u64(d, file, where + ": a dim of shape");
    if (n > uint64_t(std::numeric_limits<int64_t>::max()) ||
        (n != 0 && numel > uint64_t(std::numeric_limits<int64_t>::max()) / n))
      bad(file, where + ": shape overflows");
    numel *= n;
    h.shape.push_back(int64_t(n));
  }
  const auto& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2) bad(file, where + ": data_offsets is not [begin, end]");
  h.begin = get_u64(off[0], file, where + ": data_offsets[0]");
  h.end = get_u64(off[1], file, where + ": data_offsets[1]");
  if (h.end < h.begin) bad(file, where + ": data_offsets end before begin");
  const uint64_t es = element_size(h.dtype);
  if (numel > std::numeric_limits<uint64_t>::max() / es || numel * es != h.end - h.begin)
    bad(file, where + ": shape " + shape_str(h.shape) + " of " + dt + " needs " +
                  std::to_string(numel * es) + " bytes but data_offsets span " +
                  std::to_string(h.end - h.begin));
  return h;
}

}  // namespace

SafetensorsFile parse_safetensors(const void* data, size_t size, const std::string& file) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (size < 8) bad(file, std::to_string(size) + " bytes, shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | bytes[i];
  if (n > kMaxHeaderBytes) bad(file, "header length " + std::to_string(n) + " exceeds 100 MiB");
  if (n > size - 8)
    bad(file, "header length " + std::to_string(n) + " runs past the end of the file (" +
                  std::to_string(size) + " bytes)");
  const char* text = reinterpret_cast<const char*>(bytes + 8);
  if (n == 0 || text[0] != '{') bad(file, "the header is not a JSON object");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, text + n);
  } catch (const nlohmann::json::exception& e) {
    bad(file, std::string("the header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) bad(file, "the header is not a JSON object");
  SafetensorsFile out;
  std::vector<Header> entries;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (v.is_null()) continue;
      if (!v.is_object()) bad(file, "__metadata__ is not an object");
      for (const auto& [k, x] : v.items()) {
        if (!x.is_string()) bad(file, "__metadata__ value of '" + k + "' is not a string");
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
      bad(file, "tensor '" + h.name + "' starts at byte " + std::to_string(h.begin) +
                    " but the previous one ends at " + std::to_string(at) +
                    " (data must be contiguous, without gaps or overlaps)");
    at = h.end;
  }
  if (at != buffer)
    bad(file, "the tensors cover " + std::to_string(at) + " bytes but the data section holds " +
                  std::to_string(buffer));
  const unsigned char* base = bytes + 8 + n;
  for (const Header& h : entries) {
    Tensor t = empty(h.shape, h.dtype);
    if (h.end > h.begin) std::memcpy(t.raw_data(), base + h.begin, size_t(h.end - h.begin));
    if (h.dtype == DType::Bool)
      for (uint64_t i = h.begin; i < h.end; ++i)
        if (base[i] > 1)
          bad(file, "tensor '" + h.name + "' holds a bool byte " + std::to_string(base[i]) +
                        " that is neither 0 nor 1");
    out.tensors[h.name] = t;
  }
  return out;
}

SafetensorsFile load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  TESSERA_CHECK(in.good(), "safetensors file '", path,
                "' cannot be opened: ", std::strerror(errno));
  const std::streamsize size = in.tellg();
  in.seekg(0);
  std::vector<char> buf(size_t(std::max<std::streamsize>(size, 0)));
  TESSERA_CHECK(in.read(buf.data(), size).good() || size == 0, "safetensors file '", path,
                "': reading ", size, " bytes failed");
  return parse_safetensors(buf.data(), buf.size(), path);
}

void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t at = 0;
  std::vector<Tensor> dense;
  for (const auto& [name, t] : tensors) {
    TESSERA_CHECK(name != "__metadata__", "save_safetensors: '__metadata__' is reserved");
    TESSERA_CHECK(t.defined(), "save_safetensors: tensor '", name, "' is undefined");
    TESSERA_CHECK(t.device().type == DeviceType::CPU, "save_safetensors: tensor '", name,
                  "' is on ", t.device().str(), "; move it to the CPU first");
    Tensor c = t.contiguous();
    const uint64_t nbytes = c.nbytes();
    header[name] = {
        {"dtype", name_of(c.dtype())}, {"shape", c.shape()}, {"data_offsets", {at, at + nbytes}}};
    at += nbytes;
    dense.push_back(c);
  }
  std::string text = header.dump();
  // Padded with spaces so that the data starts 8-byte aligned, as the Python package does.
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TESSERA_CHECK(out.good(), "save_safetensors: cannot create '", tmp,
                  "': ", std::strerror(errno));
    unsigned char len[8];
    for (int i = 0; i < 8; ++i)
      len[i] = static_cast<unsigned char>((uint64_t(text.size()) >> (8 * i)) & 0xff);
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(text.data(), std::streamsize(text.size()));
    for (const Tensor& c : dense)
      out.write(static_cast<const char*>(c.raw_data()), std::streamsize(c.nbytes()));
    out.flush();
    TESSERA_CHECK(out.good(), "save_safetensors: writing '", tmp,
                  "' failed: ", std::strerror(errno));
  }
  TESSERA_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "save_safetensors: renaming '", tmp,
                "' to '", path, "': ", std::strerror(errno));
}

}  // namespace tessera
