// Fuzz test of the safetensors reader: corrupted variants of valid files, from a fixed seed; each
// is read with its tensors exactly as the header places them, or refused with tessera::Error
// naming the file, nothing else. Part of the test_safetensors binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/bit_pattern.h"
#include "tessera/checkpoint/safetensors.h"
#include "tessera/core/factory.h"
#include "unit/safetensors_test_util.h"

namespace tessera {
namespace {

using namespace safetensors_test;
using testing::pattern_bytes;
using testing::pattern_tensor;

// ---------------------------------------------------------------------------------------------
// Fuzz: corrupted variants of valid files, from a fixed seed (every run reads the same files).

// A few valid files of different shapes: one Tessera wrote with every dtype, views, a scalar and
// empty tensors; one written by hand with data out of name order, null metadata and padding;
// a single bool tensor; nothing at all.
std::vector<std::pair<std::string, Bytes>> fuzz_bases() {
  std::vector<std::pair<std::string, Bytes>> out;
  const std::string dir = scratch("fuzz_bases");
  std::map<std::string, Tensor> tensors;
  uint64_t seed = 7;
  for (DType dt : kDTypes)
    tensors[std::string("w.") + format_name(dt)] = pattern_tensor({2, 3}, dt, seed++);
  tensors["scalar"] = full({}, 3.0, DType::Float64);
  tensors["empty"] = empty({0, 4}, DType::Int32);
  tensors["t"] = pattern_tensor({3, 2}, DType::BFloat16, 1).as_strided({2, 3}, {1, 2}, 0);
  save_safetensors(dir + "/tessera.safetensors", tensors, {{"format", "pt"}});
  out.emplace_back("tessera", read_file(dir + "/tessera.safetensors"));

  Bytes data = pattern_bytes(DType::Int64, 1, 2);
  const Bytes f32 = pattern_bytes(DType::Float32, 2, 3);
  data.insert(data.end(), f32.begin(), f32.end());
  out.emplace_back("by hand", assemble(R"({"__metadata__":null,"z":{"dtype":"I64","shape":[2],)"
                                       R"("data_offsets":[0,16]},"a":{"shape":[3,1],)"
                                       R"("data_offsets":[16,28],"dtype":"F32"}}    )",
                                       data));
  out.emplace_back("bool", assemble(header({entry("b", "BOOL", "[2,2]", "[0,4]")}),
                                    pattern_bytes(DType::Bool, 3, 4)));
  out.emplace_back("nothing", assemble("{}      "));
  return out;
}

class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : rng_(seed) {}

  // Below n, from the raw generator: std's distributions differ between standard libraries.
  uint64_t below(uint64_t n) { return n ? rng_() % n : 0; }
  bool chance(int percent) { return below(100) < uint64_t(percent); }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[below(v.size())];
  }

  // One corrupted variant of `file` (a valid file) and what was done to it.
  Bytes mutate(const Bytes& file, std::string& what) {
    switch (below(9)) {
      case 0:
        return flip_bytes(file, what);
      case 1:
        what = "truncated";
        return Bytes(file.begin(), file.begin() + std::ptrdiff_t(below(file.size())));
      case 2:
        return set_header_length(file, what);
      case 3:
        return append(file, what);
      case 4:
      case 5:
        return edit_json(file, what);
      case 6:
        return edit_text(file, what);
      case 7: {
        Bytes once = mutate(file, what);
        std::string second;
        Bytes twice = once.size() >= 8 ? mutate_any(once, second) : once;
        what += " + " + second;
        return twice;
      }
      default:
        return edit_json_keeping_it_valid(file, what);
    }
  }

 private:
  // Mutations that work on any bytes, valid or not.
  Bytes mutate_any(const Bytes& file, std::string& what) {
    switch (below(4)) {
      case 0:
        return flip_bytes(file, what);
      case 1:
        what = "truncated";
        return Bytes(file.begin(), file.begin() + std::ptrdiff_t(below(file.size())));
      case 2:
        return set_header_length(file, what);
      default:
        return append(file, what);
    }
  }

  Bytes flip_bytes(Bytes f, std::string& what) {
    const uint64_t header_end = std::min<uint64_t>(8 + get_u64(f, 0), f.size());
    const uint64_t k = 1 + below(4);
    what = "flipped " + std::to_string(k) + " bytes";
    for (uint64_t i = 0; i < k; ++i) {
      // Mostly in the length and header, where the structure is.
      const uint64_t at = chance(70) ? below(header_end) : below(f.size());
      if (chance(50))
        f[at] ^= static_cast<unsigned char>(1u << below(8));
      else
        f[at] = static_cast<unsigned char>(below(256));
    }
    return f;
  }

  Bytes set_header_length(Bytes f, std::string& what) {
    const uint64_t n = get_u64(f, 0), size = f.size();
    const std::vector<uint64_t> lengths = {0,
                                           1,
                                           2,
                                           n - 1,
                                           n + 1,
                                           n + 8,
                                           size - 8,
                                           size - 7,
                                           size,
                                           100'000'000,
                                           100'000'001,
                                           uint64_t(1) << 32,
                                           uint64_t(1) << 63,
                                           ~uint64_t(0),
                                           ~uint64_t(0) - 7,
                                           rng_(),
                                           below(size + 16)};
    const uint64_t v = pick(lengths);
    what = "header length " + std::to_string(v);
    put_u64(f, 0, v);
    return f;
  }

  Bytes append(Bytes f, std::string& what) {
    const uint64_t k = 1 + below(16);
    what = "appended " + std::to_string(k) + " bytes";
    for (uint64_t i = 0; i < k; ++i)
      f.push_back(chance(50) ? ' ' : static_cast<unsigned char>(below(256)));
    return f;
  }

  static std::string header_text(const Bytes& f) {
    const uint64_t n = get_u64(f, 0);
    return std::string(f.begin() + 8, f.begin() + 8 + std::ptrdiff_t(n));
  }
  static Bytes data_of(const Bytes& f) { return Bytes(f.begin() + 8 + get_u64(f, 0), f.end()); }

  // The header rebuilt from `text`, padded in one of the ways writers (or broken ones) pad.
  Bytes rebuild(std::string text, const Bytes& data) {
    switch (below(4)) {
      case 0:
        text.append((8 - text.size() % 8) % 8, ' ');
        break;
      case 1:
        text.append(below(9), "\t\n\r "[below(4)]);
        break;
      case 2:
        if (chance(20)) text.append(1 + below(3), '\0');
        break;
      default:
        break;
    }
    return assemble(text, data);
  }

  json interesting_number(uint64_t near) {
    const std::vector<json> v = {json(0),
                                 json(1),
                                 json(near - 1),
                                 json(near + 1),
                                 json(near + 2),
                                 json(near + 4),
                                 json(near + 8),
                                 json(near * 2),
                                 json(uint64_t(1) << 31),
                                 json(uint64_t(1) << 32),
                                 json(uint64_t(1) << 53),
                                 json(uint64_t(1) << 62),
                                 json(uint64_t(std::numeric_limits<int64_t>::max())),
                                 json(uint64_t(1) << 63),
                                 json(~uint64_t(0)),
                                 json(~uint64_t(0) - 3),
                                 json(-1),
                                 json(std::numeric_limits<int64_t>::min()),
                                 json(1.5),
                                 json(4.0),
                                 json(1e308),
                                 json("4"),
                                 json(nullptr),
                                 json(true),
                                 json::array(),
                                 json::object()};
    return pick(v);
  }

  json interesting_value() {
    const std::vector<json> v = {json(nullptr),       json(0),          json(-3),
                                 json("x"),           json::array(),    json::object(),
                                 json::array({1, 2}), json({{"a", 1}}), json({{"dtype", "F32"}})};
    return pick(v);
  }

  static std::vector<std::string> tensor_names(const json& h) {
    std::vector<std::string> out;
    for (const auto& [k, v] : h.items())
      if (k != "__metadata__") out.push_back(k);
    return out;
  }

  Bytes edit_json(const Bytes& file, std::string& what) {
    json h = json::parse(header_text(file));
    Bytes data = data_of(file);
    const std::vector<std::string> names = tensor_names(h);
    const std::vector<std::string> fields = {"dtype", "shape", "data_offsets"};
    if (names.empty() || chance(8)) {
      const std::vector<json> metas = {json(nullptr),      json::array(),
                                       json("x"),          json({{"k", 1}}),
                                       json({{"k", "v"}}), json({{"k", {{"n", "m"}}}}),
                                       json::object()};
      h["__metadata__"] = pick(metas);
      what = "__metadata__ = " + h["__metadata__"].dump();
      return rebuild(h.dump(), data);
    }
    const std::string name = pick(names);
    json& t = h[name];
    switch (below(14)) {
      case 0:
      case 1: {
        const size_t i = below(2);
        t["data_offsets"][i] = interesting_number(t["data_offsets"][i].get<uint64_t>());
        what = name + ".data_offsets[" + std::to_string(i) + "] = " + t["data_offsets"][i].dump();
        break;
      }
      case 2:
      case 3: {
        if (t["shape"].empty()) {
          t["shape"].push_back(interesting_number(1));
        } else {
          const size_t i = below(t["shape"].size());
          t["shape"][i] = interesting_number(t["shape"][i].get<uint64_t>());
        }
        what = name + ".shape = " + t["shape"].dump();
        break;
      }
      case 4: {
        if (!t["shape"].empty() && chance(50))
          t["shape"].erase(below(t["shape"].size()));
        else
          t["shape"].insert(t["shape"].begin() + std::ptrdiff_t(below(t["shape"].size() + 1)),
                            json(below(3)));
        what = name + ".shape = " + t["shape"].dump();
        break;
      }
      case 5: {
        const std::vector<std::string> dts = {"F32", "F64", "BF16",    "F16", "I64", "I32", "BOOL",
                                              "U8",  "I8",  "F8_E4M3", "C64", "",    "f32"};
        t["dtype"] = chance(90) ? json(pick(dts)) : interesting_value();
        what = name + ".dtype = " + t["dtype"].dump();
        break;
      }
      case 6: {
        const std::string f = pick(fields);
        t.erase(f);
        what = name + " without " + f;
        break;
      }
      case 7:
        t["extra"] = interesting_value();
        what = name + " with an extra field";
        break;
      case 8: {
        const std::string other = pick(names), f = pick(fields);
        std::swap(h[name][f], h[other][f]);
        what = "swapped " + f + " of " + name + " and " + other;
        break;
      }
      case 9: {
        const std::vector<std::string> to = {"", "__metadata__", pick(names), "\xc3\xa9",
                                             std::string(5000, 'n')};
        const std::string n = pick(to);
        json moved = t;
        h.erase(name);
        h[n] = moved;
        what = "renamed " + name + " to '" + n.substr(0, 20) + "'";
        break;
      }
      case 10:
        h.erase(name);
        what = "removed " + name;
        break;
      case 11:
        h[name + ".copy"] = t;
        what = "copied " + name;
        break;
      case 12:
        t = interesting_value();
        what = name + " = " + t.dump();
        break;
      default: {
        const std::string f = pick(fields);
        t[f] = interesting_value();
        what = name + "." + f + " = " + t[f].dump();
        break;
      }
    }
    if (chance(10)) {
      data.resize(below(data.size() + 8));
      what += ", data resized to " + std::to_string(data.size());
    }
    return rebuild(h.dump(), data);
  }

  // Edits a reader should accept: the same bytes under another shape of the same count, or
  // another dtype of the same width, or tensors listed in another order.
  Bytes edit_json_keeping_it_valid(const Bytes& file, std::string& what) {
    json h = json::parse(header_text(file));
    const std::vector<std::string> names = tensor_names(h);
    if (names.empty()) return edit_text(file, what);
    json& t = h[pick(names)];
    const std::map<std::string, std::string> same_width = {
        {"F32", "I32"},  {"I32", "F32"},  {"F64", "I64"},  {"I64", "F64"},
        {"F16", "BF16"}, {"BF16", "F16"}, {"BOOL", "BOOL"}};
    switch (below(3)) {
      case 0: {
        uint64_t numel = 1;
        for (const auto& d : t["shape"])
          numel *= d.get<uint64_t>();
        t["shape"] =
            chance(50) ? json::array({numel}) : json::array({uint64_t(1), numel, uint64_t(1)});
        what = "reshaped to " + t["shape"].dump();
        break;
      }
      case 1:
        t["dtype"] = same_width.at(t["dtype"].get<std::string>());
        what = "dtype changed to " + t["dtype"].dump();
        break;
      default: {
        // nlohmann's objects are sorted; write the header by hand in reverse order.
        std::vector<std::string> entries;
        for (const auto& [k, v] : h.items())
          entries.push_back(json(k).dump() + ":" + v.dump());
        std::string text = "{";
        for (auto it = entries.rbegin(); it != entries.rend(); ++it)
          text += (text.size() > 1 ? "," : "") + *it;
        what = "entries reversed";
        return rebuild(text + "}", data_of(file));
      }
    }
    return rebuild(h.dump(), data_of(file));
  }

  Bytes edit_text(const Bytes& file, std::string& what) {
    std::string text = header_text(file);
    const Bytes data = data_of(file);
    const std::vector<std::string> tokens = {"{",
                                             "}",
                                             "[",
                                             "]",
                                             "\"",
                                             ",",
                                             ":",
                                             "0",
                                             "-",
                                             ".",
                                             "e",
                                             "\\",
                                             "\\u",
                                             "\\ud800",
                                             "\xff",
                                             std::string(1, '\0'),
                                             "null",
                                             "1e999",
                                             "18446744073709551616",
                                             "-0",
                                             "00",
                                             "0x10",
                                             "NaN",
                                             "Infinity",
                                             "\"__metadata__\"",
                                             "\"dtype\"",
                                             "\xc3\xa9",
                                             " "};
    switch (below(6)) {
      case 0: {
        const size_t at = below(text.size()), len = 1 + below(8);
        text.erase(at, len);
        what = "erased text at " + std::to_string(at);
        break;
      }
      case 1: {
        const size_t at = below(text.size() + 1);
        const std::string tok = pick(tokens);
        text.insert(at, tok);
        what = "inserted a token at " + std::to_string(at);
        break;
      }
      case 2: {
        if (!text.empty()) text[below(text.size())] = pick(tokens)[0];
        what = "replaced a character";
        break;
      }
      case 3: {
        // Duplicate keys cannot be made through nlohmann's objects: repeat an entry's text.
        const json h = json::parse(text);
        if (h.empty()) {
          text = R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"a":1})";
        } else {
          auto it = h.begin();
          std::advance(it, std::ptrdiff_t(below(h.size())));
          text.insert(1, json(it.key()).dump() + ":" + it.value().dump() + ",");
        }
        what = "a key repeated";
        break;
      }
      case 4: {
        const size_t depth = pick(std::vector<size_t>{3, 4, 64, 5000, 200'000});
        text = "{\"a\":" + std::string(depth, '[') + std::string(depth, ']') + "}";
        what = "nested " + std::to_string(depth) + " deep";
        break;
      }
      default: {
        // A number in the text that nlohmann cannot hold as an integer, or a malformed one.
        const size_t at = text.find_first_of("0123456789");
        if (at != std::string::npos) {
          const size_t end = text.find_first_not_of("0123456789", at);
          text.replace(at, end - at, pick(tokens));
        }
        what = "a number replaced";
        break;
      }
    }
    return rebuild(text, data);
  }

  std::mt19937_64 rng_;
};

// Each check of the reader, by a phrase of its message.
const std::vector<std::string> kErrorKinds = {
    "shorter than the 8-byte header length",
    "exceeds the format's limit",
    "runs past the end of the file",
    "does not start with '{'",
    "a NUL byte at offset",
    "is not valid JSON",
    "nests deeper than",
    "appears twice in the header",
    "twice",
    "a tensor has an empty name",
    "__metadata__ is not an object",
    "is not an object",
    "has an unknown field",
    "lacks \"",
    "dtype is not a string",
    "which Tessera does not support",
    "shape is not an array",
    "a dim of shape is not a non-negative integer",
    "overflows a 64-bit index",
    "data_offsets is not [begin, end]",
    "] is not a non-negative integer",
    "end before they begin",
    "needs",
    "starts at byte",
    "the tensors cover",
    "__metadata__ value of",
    "that is neither 0 nor 1",
};

struct FuzzStats {
  int accepted = 0, rejected = 0, failures = 0;
  std::map<std::string, int> kinds;  // rejections by the first kind their message shows
};

// The property: the reader accepts the file with tensors exactly as the header places them, or
// throws tessera::Error naming the file; nothing else.
void check_variant(const Bytes& file, const std::string& label, FuzzStats& stats) {
  auto fail = [&](const std::string& why) {
    if (++stats.failures <= 10) ADD_FAILURE() << label << ": " << why;
  };
  SafetensorsFile f;
  try {
    f = parse_safetensors(file.data(), file.size(), label);
  } catch (const Error& e) {
    ++stats.rejected;
    const std::string what = e.what();
    for (const std::string& kind : kErrorKinds)
      if (what.find(kind) != std::string::npos) {
        ++stats.kinds[kind];
        break;
      }
    if (what.find("safetensors file '" + label + "'") == std::string::npos)
      fail("the error does not name the file: " + what);
    return;
  } catch (const std::exception& e) {
    return fail(std::string("threw something other than tessera::Error: ") + e.what());
  } catch (...) {
    return fail("threw something other than an exception");
  }
  ++stats.accepted;
  const uint64_t n = get_u64(file, 0);
  const auto header_begin = file.begin() + 8, header_end = header_begin + std::ptrdiff_t(n);
  // nlohmann (which checks this) ends its input at a NUL; JSON holds none.
  if (std::find(header_begin, header_end, 0) != header_end) return fail("a NUL in the header");
  const json h = json::parse(header_begin, header_end);
  if (f.tensors.size() + (h.contains("__metadata__") ? 1 : 0) != h.size())
    return fail("tensors lost or invented");
  for (const auto& [name, t] : f.tensors) {
    const json& e = h.at(name);
    const uint64_t begin = e.at("data_offsets")[0], end = e.at("data_offsets")[1];
    const uint64_t nbytes = uint64_t(t.numel()) * element_size(t.dtype());
    if (!t.is_contiguous() || t.storage().nbytes() != nbytes || nbytes != end - begin ||
        json(t.shape()) != e.at("shape") || format_name(t.dtype()) != e.at("dtype"))
      return fail("tensor '" + name + "' does not match its header entry");
    if (nbytes && std::memcmp(t.raw_data(), file.data() + 8 + n + begin, nbytes) != 0)
      return fail("tensor '" + name + "' does not hold its bytes");
  }
}

TEST(SafetensorsFuzz, CorruptedFilesAreReadOrRefusedWithAnError) {
  const auto start = std::chrono::steady_clock::now();
  const auto bases = fuzz_bases();
  FuzzStats stats;
  int cases = 0;
  // Every truncation of every base: inside the length, the JSON, the padding, each tensor.
  for (const auto& [base_name, base] : bases) {
    check_variant(base, "base " + base_name, stats);
    for (size_t len = 0; len < base.size(); ++len, ++cases)
      check_variant(Bytes(base.begin(), base.begin() + std::ptrdiff_t(len)),
                    "fuzz " + base_name + " truncated to " + std::to_string(len), stats);
  }
  ASSERT_EQ(stats.rejected, cases) << "a truncated file was accepted";
  ASSERT_EQ(stats.accepted, int(bases.size()));
  Fuzzer fuzz(0x5afe7e45);
  constexpr int kRandomCases = 8000;
  for (int i = 0; i < kRandomCases; ++i, ++cases) {
    const auto& [base_name, base] = bases[size_t(i) % bases.size()];
    std::string what;
    const Bytes file = fuzz.mutate(base, what);
    check_variant(file, "fuzz #" + std::to_string(i) + " (" + base_name + ": " + what + ")", stats);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int read = stats.accepted - int(bases.size());
  std::cout << "[ fuzz     ] " << cases << " corrupted files: " << read << " read, "
            << stats.rejected << " refused, in " << seconds << " s\n";
  EXPECT_GE(cases, 5000);
  EXPECT_EQ(stats.failures, 0);
  // Both outcomes are exercised: the generator is not just making garbage.
  EXPECT_GT(read, kRandomCases / 20);
  EXPECT_GT(stats.rejected, kRandomCases / 2);
  // And every check of the reader is reached, not just the first few.
  for (const std::string& kind : kErrorKinds)
    EXPECT_GT(stats.kinds[kind], 0) << "no corrupted file was refused with '" << kind << "'";
}

}  // namespace
}  // namespace tessera
