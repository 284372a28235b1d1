// The safetensors reader and writer: round trips of every dtype and layout, one test per kind of
// malformed file (the error names the file and the problem), a fuzz test of corrupted files (each
// is read or refused with tessera::Error, nothing else), and both directions against Hugging
// Face's reference package (tests/python/check_safetensors.py).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/bit_pattern.h"
#include "common/shell_quote.h"
#include "tessera/checkpoint/safetensors.h"
#include "tessera/core/factory.h"
#include "tessera/testing/expect_error.h"

namespace tessera {
namespace {

using testing::expect_error;
using testing::pattern_bytes;
using testing::pattern_tensor;
using testing::raw_bytes;
using Bytes = std::vector<unsigned char>;
using json = nlohmann::json;

constexpr DType kDTypes[] = {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16,
                             DType::Int64,   DType::Int32,   DType::Bool};

// The format's names, written out here rather than taken from the code under test.
const char* format_name(DType dt) {
  switch (dt) {
    case DType::Float32:
      return "F32";
    case DType::Float64:
      return "F64";
    case DType::BFloat16:
      return "BF16";
    case DType::Float16:
      return "F16";
    case DType::Int64:
      return "I64";
    case DType::Int32:
      return "I32";
    case DType::Bool:
      return "BOOL";
  }
  return "?";
}

// A fresh directory per test: ctest runs the tests of this file in parallel processes.
std::string scratch(const std::string& name) {
  const std::string dir = std::string(TESSERA_TEST_SCRATCH) + "/safetensors/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

void put_u64(Bytes& b, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i)
    b[at + size_t(i)] = static_cast<unsigned char>(v >> (8 * i));
}

uint64_t get_u64(const Bytes& b, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i)
    v = (v << 8) | b[at + size_t(i)];
  return v;
}

// A file from header text and data, with the header's true length.
Bytes assemble(const std::string& header, const Bytes& data = {}) {
  Bytes out(8 + header.size() + data.size());
  put_u64(out, 0, header.size());
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + std::ptrdiff_t(header.size()));
  return out;
}

// The header of a file as JSON, parsed independently of the reader under test.
json header_of(const Bytes& file) {
  const uint64_t n = get_u64(file, 0);
  return json::parse(file.begin() + 8, file.begin() + 8 + std::ptrdiff_t(n));
}

std::vector<std::string> names_of(const std::map<std::string, Tensor>& m) {
  std::vector<std::string> out;
  for (const auto& [k, v] : m)
    out.push_back(k);
  return out;
}

void expect_tensor(const Tensor& got, DType dt, const Shape& shape, const Bytes& bytes,
                   const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  EXPECT_EQ(got.dtype(), dt) << what;
  EXPECT_EQ(got.shape(), shape) << what;
  EXPECT_TRUE(got.is_contiguous()) << what;
  EXPECT_TRUE(raw_bytes(got) == bytes) << what << ": bytes differ";
}

// ---------------------------------------------------------------------------------------------
// Round trips

TEST(Safetensors, RoundTripsEveryDTypeBitForBit) {
  const std::string path = scratch("every_dtype") + "/t.safetensors";
  const std::vector<Shape> shapes = {{2, 3}, {7}, {1, 2, 1, 3}, {33, 5}};
  std::map<std::string, Tensor> tensors;
  uint64_t seed = 1;
  for (DType dt : kDTypes)
    for (const Shape& s : shapes)
      tensors[std::string(format_name(dt)) + "." + shape_str(s)] = pattern_tensor(s, dt, seed++);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "12"}};
  save_safetensors(path, tensors, metadata);

  // The file as the format describes it and the Python package writes it: tensors packed from
  // offset 0 in order of element size, largest first, then of name, so that each begins at a
  // multiple of its element size; data 8-byte aligned.
  const Bytes file = read_file(path);
  const uint64_t n = get_u64(file, 0);
  EXPECT_EQ(n % 8, 0u);
  const json h = header_of(file);
  EXPECT_EQ(h.at("__metadata__"), json(metadata));
  uint64_t at = 0;
  seed = 1;
  for (DType dt : kDTypes)
    for (const Shape& s : shapes) {
      const std::string name = std::string(format_name(dt)) + "." + shape_str(s);
      SCOPED_TRACE(name);
      const json& e = h.at(name);
      EXPECT_EQ(e.at("dtype"), format_name(dt));
      EXPECT_EQ(e.at("shape"), json(s));
      const Bytes want = pattern_bytes(dt, seed++, shape_numel(s));
      const uint64_t begin = e.at("data_offsets")[0], end = e.at("data_offsets")[1];
      ASSERT_EQ(end - begin, want.size());
      EXPECT_TRUE(
          std::equal(want.begin(), want.end(), file.begin() + std::ptrdiff_t(8 + n + begin)));
    }
  std::vector<std::pair<std::string, Tensor>> order(tensors.begin(), tensors.end());
  std::stable_sort(order.begin(), order.end(), [](const auto& x, const auto& y) {
    return element_size(x.second.dtype()) > element_size(y.second.dtype());
  });
  for (const auto& [name, t] : order) {
    EXPECT_EQ(h.at(name).at("data_offsets")[0].get<uint64_t>(), at) << name;
    EXPECT_EQ((8 + n + at) % element_size(t.dtype()), 0u) << name << " is not aligned";
    at += t.nbytes();
  }
  EXPECT_EQ(file.size(), 8 + n + at);
  // The write went through a temporary file of its own, gone now.
  size_t files = 0;
  for ([[maybe_unused]] const auto& f :
       std::filesystem::directory_iterator(std::filesystem::path(path).parent_path()))
    ++files;
  EXPECT_EQ(files, 1u);

  const SafetensorsFile back = load_safetensors(path);
  EXPECT_EQ(back.metadata, metadata);
  ASSERT_EQ(names_of(back.tensors), names_of(tensors));
  for (const auto& [name, t] : tensors)
    expect_tensor(back.tensors.at(name), t.dtype(), t.shape(), raw_bytes(t), name);
}

TEST(Safetensors, RoundTripsEmptyTensors) {
  const std::string path = scratch("empty") + "/t.safetensors";
  const std::vector<Shape> shapes = {{0}, {3, 0}, {0, 5, 2}, {2, 0, 0}};
  std::map<std::string, Tensor> tensors;
  for (DType dt : kDTypes)
    for (const Shape& s : shapes)
      tensors[std::string(format_name(dt)) + shape_str(s)] = empty(s, dt);
  tensors["between"] = pattern_tensor({3}, DType::Float32, 9);  // empty ones on either side
  save_safetensors(path, tensors);
  const json h = header_of(read_file(path));
  EXPECT_FALSE(h.contains("__metadata__"));
  for (const auto& [name, t] : tensors)
    if (t.numel() == 0) {
      EXPECT_EQ(h.at(name).at("data_offsets")[0], h.at(name).at("data_offsets")[1]) << name;
    }
  const SafetensorsFile back = load_safetensors(path);
  ASSERT_EQ(names_of(back.tensors), names_of(tensors));
  for (const auto& [name, t] : tensors)
    expect_tensor(back.tensors.at(name), t.dtype(), t.shape(), raw_bytes(t), name);
}

TEST(Safetensors, RoundTripsZeroDimTensors) {
  const std::string path = scratch("zero_dim") + "/t.safetensors";
  std::map<std::string, Tensor> tensors;
  for (DType dt : kDTypes)
    tensors[format_name(dt)] = full({}, dt == DType::Bool ? 1.0 : -2.5, dt);
  save_safetensors(path, tensors);
  const json h = header_of(read_file(path));
  const SafetensorsFile back = load_safetensors(path);
  for (const auto& [name, t] : tensors) {
    EXPECT_EQ(h.at(name).at("shape"), json::array()) << name;
    const Tensor& b = back.tensors.at(name);
    EXPECT_EQ(b.dim(), 0) << name;
    EXPECT_EQ(b.numel(), 1) << name;
    expect_tensor(b, t.dtype(), {}, raw_bytes(t), name);
  }
}

// Views are written as their logical (row-major) values; the expected bytes come from index
// arithmetic on the base's pattern, not from Tessera's own copy.
TEST(Safetensors, WritesNonContiguousTensorsInLogicalOrder) {
  const std::string path = scratch("non_contiguous") + "/t.safetensors";
  struct View {
    const char* name;
    Shape sizes, strides;
    int64_t offset;
  };
  // The base is [4, 6] row-major.
  const std::vector<View> views = {
      {"transposed", {6, 4}, {1, 6}, 0},   {"block", {2, 3}, {6, 1}, 8},
      {"every_other", {2, 3}, {12, 2}, 1}, {"broadcast_rows", {3, 6}, {0, 1}, 6},
      {"column", {4, 1}, {6, 1}, 5},       {"reversed_dims", {2, 3, 4}, {1, 2, 6}, 0},
  };
  std::map<std::string, Tensor> tensors;
  std::map<std::string, Bytes> want;
  uint64_t seed = 100;
  for (DType dt : kDTypes) {
    const Tensor base = pattern_tensor({4, 6}, dt, seed);
    const Bytes base_bytes = pattern_bytes(dt, seed++, 24);
    const size_t es = element_size(dt);
    for (const View& v : views) {
      const std::string name = std::string(format_name(dt)) + "." + v.name;
      tensors[name] = base.as_strided(v.sizes, v.strides, v.offset);
      ASSERT_FALSE(tensors[name].is_contiguous()) << name;
      Bytes& w = want[name];
      std::vector<int64_t> idx(v.sizes.size(), 0);
      for (int64_t i = 0; i < shape_numel(v.sizes); ++i) {
        int64_t at = v.offset;
        for (size_t d = 0; d < idx.size(); ++d)
          at += idx[d] * v.strides[d];
        w.insert(w.end(), base_bytes.begin() + at * int64_t(es),
                 base_bytes.begin() + (at + 1) * int64_t(es));
        for (size_t d = idx.size(); d-- > 0;) {
          if (++idx[d] < v.sizes[d]) break;
          idx[d] = 0;
        }
      }
    }
  }
  save_safetensors(path, tensors);
  const SafetensorsFile back = load_safetensors(path);
  ASSERT_EQ(names_of(back.tensors), names_of(tensors));
  for (const auto& [name, t] : tensors)
    expect_tensor(back.tensors.at(name), t.dtype(), t.shape(), want.at(name), name);
}

// Signalling NaNs and NaN payloads of every floating dtype survive, in views too (a strided
// copy through float32 would quiet or rewrite them).
TEST(Safetensors, KeepsNaNPayloadsOfViews) {
  const std::string path = scratch("nan_payloads") + "/t.safetensors";
  const std::vector<std::pair<DType, std::vector<uint64_t>>> patterns = {
      {DType::Float16, {0x7c01, 0x7d55, 0xfe01, 0x7fff, 0x0001, 0x8000}},
      {DType::BFloat16, {0x7f81, 0x7fc1, 0xffa5, 0x7fff, 0x0001, 0x8000}},
      {DType::Float32, {0x7f800001, 0x7fc12345, 0xff812345, 0x7fffffff, 0x00000001, 0x80000000}},
      {DType::Float64,
       {0x7ff0000000000001, 0x7ff8123456789abc, 0xfff0000000000abc, 0x7fffffffffffffff, 1,
        0x8000000000000000}}};
  std::map<std::string, Tensor> tensors;
  std::map<std::string, Bytes> want;
  for (const auto& [dt, bits] : patterns) {
    const size_t es = element_size(dt);
    Tensor base = empty({2, 3}, dt);
    Bytes bytes(6 * es), transposed(6 * es);
    for (size_t i = 0; i < 6; ++i)
      for (size_t k = 0; k < es; ++k)
        bytes[i * es + k] = static_cast<unsigned char>(bits[i] >> (8 * k));
    std::memcpy(base.raw_data(), bytes.data(), bytes.size());
    for (size_t r = 0; r < 3; ++r)  // the [3, 2] transpose
      for (size_t c = 0; c < 2; ++c)
        std::memcpy(&transposed[(r * 2 + c) * es], &bytes[(c * 3 + r) * es], es);
    tensors[std::string(format_name(dt))] = base;
    want[format_name(dt)] = bytes;
    tensors[std::string(format_name(dt)) + ".t"] = base.as_strided({3, 2}, {1, 3}, 0);
    want[std::string(format_name(dt)) + ".t"] = transposed;
  }
  save_safetensors(path, tensors);
  const SafetensorsFile back = load_safetensors(path);
  for (const auto& [name, t] : tensors)
    expect_tensor(back.tensors.at(name), t.dtype(), t.shape(), want.at(name), name);
}

TEST(Safetensors, KeepsMetadataAndUnusualNames) {
  const std::string dir = scratch("metadata");
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"unicode", "\xc3\xa9 \xe2\x9c\x93 \xe5\x90\x8d"},
      {"empty", ""},
      {"escapes", "a\"b\\c\n\t\x01"},
      {"", "empty key"}};
  std::map<std::string, Tensor> tensors;
  const std::vector<std::string> names = {"model.layers.0.self_attn.q_proj.weight",
                                          "\xc3\xa9/\xe5\x90\x8d\xe5\xad\x97",
                                          "with \"quotes\" and \\",
                                          "tab\tand\nnewline",
                                          " ",
                                          std::string(300, 'x'),
                                          std::string("nul\0inside", 10)};
  for (size_t i = 0; i < names.size(); ++i)
    tensors[names[i]] = pattern_tensor({int64_t(i) + 1}, DType::Int32, i);
  save_safetensors(dir + "/a.safetensors", tensors, metadata);
  const SafetensorsFile a = load_safetensors(dir + "/a.safetensors");
  EXPECT_EQ(a.metadata, metadata);
  ASSERT_EQ(names_of(a.tensors), names_of(tensors));
  for (const auto& [name, t] : tensors)
    expect_tensor(a.tensors.at(name), t.dtype(), t.shape(), raw_bytes(t), name);

  // Metadata alone, and nothing at all: the smallest file is "{}" padded to 8 bytes.
  save_safetensors(dir + "/b.safetensors", {}, metadata);
  const SafetensorsFile b = load_safetensors(dir + "/b.safetensors");
  EXPECT_TRUE(b.tensors.empty());
  EXPECT_EQ(b.metadata, metadata);
  save_safetensors(dir + "/c.safetensors", {});
  EXPECT_EQ(read_file(dir + "/c.safetensors"), assemble("{}      "));
  const SafetensorsFile c = load_safetensors(dir + "/c.safetensors");
  EXPECT_TRUE(c.tensors.empty());
  EXPECT_TRUE(c.metadata.empty());
  EXPECT_FALSE(std::filesystem::exists(dir + "/c.safetensors.tmp"));
}

// What other writers produce: data in another order than the names, trailing whitespace of any
// kind, "__metadata__": null, unicode escapes.
TEST(Safetensors, ReadsFilesTesseraWouldWriteDifferently) {
  const Bytes a = pattern_bytes(DType::Float16, 1, 3), b = pattern_bytes(DType::Int64, 2, 2);
  Bytes data = b;
  data.insert(data.end(), a.begin(), a.end());
  const std::string text =
      R"({"__metadata__":null,"\u00e9a":{"data_offsets":[16,22],"shape":[3],"dtype":"F16"},)"
      R"("b":{"dtype":"I64","shape":[2,1],"data_offsets":[0,16]},)"
      R"("z":{"dtype":"BOOL","shape":[0],"data_offsets":[22,22]}}  )"
      "\t\r\n ";
  const Bytes file = assemble(text, data);
  const SafetensorsFile f = parse_safetensors(file.data(), file.size(), "other.safetensors");
  EXPECT_TRUE(f.metadata.empty());
  ASSERT_EQ(f.tensors.size(), 3u);
  expect_tensor(f.tensors.at(std::string("\xc3\xa9") + "a"), DType::Float16, {3}, a, "a");
  expect_tensor(f.tensors.at("b"), DType::Int64, {2, 1}, b, "b");
  expect_tensor(f.tensors.at("z"), DType::Bool, {0}, {}, "z");
}

TEST(Safetensors, WriterRefusesWhatTheReaderWouldRefuse) {
  const std::string dir = scratch("writer_refuses");
  const std::string path = dir + "/t.safetensors";
  const Tensor t = pattern_tensor({2}, DType::Float32, 1);
  auto save = [](const std::string& to, const std::map<std::string, Tensor>& tensors,
                 const std::map<std::string, std::string>& metadata = {}) {
    return [=] { save_safetensors(to, tensors, metadata); };
  };
  expect_error(save(path, {{"", t}}), "a tensor has an empty name");
  expect_error(save(path, {{"__metadata__", t}}), "'__metadata__' is reserved");
  expect_error(save(path, {{"bad\xff", t}}), {"the tensor name 'bad", "is not valid UTF-8"});
  expect_error(save(path, {{"a", t}}, {{"k", "\xc3"}}), {"metadata 'k'", "not valid UTF-8"});
  expect_error(save(path, {{"a", Tensor()}}), "tensor 'a' is undefined");
  expect_error(save(dir + "/no/such/dir/t.safetensors", {{"a", t}}),
               {"cannot create", "no/such/dir/t.safetensors.tmp"});
  EXPECT_TRUE(std::filesystem::is_empty(dir));
}

TEST(Safetensors, LoadNamesFilesItCannotRead) {
  const std::string dir = scratch("cannot_read");
  expect_error([&] { load_safetensors(dir + "/missing.safetensors"); },
               {"'" + dir + "/missing.safetensors' cannot be opened", "No such file"});
  expect_error([&] { load_safetensors(dir); }, {"'" + dir + "'", "is not a regular file"});
  write_file(dir + "/short.safetensors", {1, 2, 3});
  expect_error(
      [&] { load_safetensors(dir + "/short.safetensors"); },
      {"'" + dir + "/short.safetensors' is malformed", "3 bytes, shorter than the 8-byte"});
}

// ---------------------------------------------------------------------------------------------
// Malformed files: one test per kind; each error names the file and the problem.

void expect_malformed(const Bytes& file, std::vector<std::string> needles) {
  needles.push_back("safetensors file 'bad.safetensors'");
  expect_error([&] { parse_safetensors(file.data(), file.size(), "bad.safetensors"); }, needles);
}

// Built by appending: GCC 12 misreports chains of string operator+ as overlapping copies.
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  std::string s = "\"";
  s.append(name).append("\":{\"dtype\":\"").append(dtype).append("\",\"shape\":");
  s.append(shape).append(",\"data_offsets\":").append(offsets).append("}");
  return s;
}

std::string header(std::initializer_list<std::string> entries) {
  std::string s = "{";
  for (const std::string& e : entries)
    s.append(s.size() > 1 ? "," : "").append(e);
  return s.append("}");
}

TEST(SafetensorsMalformed, ShorterThanTheHeaderLength) {
  for (size_t n = 0; n < 8; ++n)
    expect_malformed(Bytes(n, 0), {std::to_string(n) + " bytes, shorter than the 8-byte header"});
}

TEST(SafetensorsMalformed, HeaderLengthPastTheEndOfTheFile) {
  Bytes f = assemble("{}      ");
  put_u64(f, 0, 9);
  expect_malformed(f, {"header length 9 runs past the end of the file (16 bytes)"});
  put_u64(f, 0, 100'000'000);
  expect_malformed(f, {"header length 100000000 runs past the end"});
}

TEST(SafetensorsMalformed, HeaderLengthOverTheFormatsLimit) {
  Bytes f = assemble("{}      ");
  for (uint64_t n : {uint64_t(100'000'001), uint64_t(1) << 63, ~uint64_t(0)}) {
    put_u64(f, 0, n);
    expect_malformed(f, {"header length " + std::to_string(n) +
                         " exceeds the format's limit of 100000000 bytes"});
  }
}

TEST(SafetensorsMalformed, HeaderNotStartingWithABrace) {
  for (const char* h : {"", " {}", "[]", "\"x\"", "\xef\xbb\xbf{}"})
    expect_malformed(assemble(h), {"the header does not start with '{'"});
}

TEST(SafetensorsMalformed, HeaderNotValidJson) {
  for (const std::string& h :
       {std::string("{"), std::string("{\"a\":}"), std::string("{}\0\0", 4), std::string("{} x"),
        std::string("{\"\xff\":1}"), std::string(R"({"\ud800":1})"), std::string("{\"a\":1,}"),
        std::string("{} {}"), std::string("{\"a\":1e999}"), std::string("{'a':1}")})
    expect_malformed(assemble(h), {"the header is not valid JSON"});
  // An error quotes at most a few hundred characters of a huge bad token.
  const std::string huge = "{\"" + std::string(1 << 20, 'a');
  try {
    const Bytes file = assemble(huge);
    parse_safetensors(file.data(), file.size(), "bad.safetensors");
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_LT(std::string(e.what()).size(), 1000u);
  }
}

TEST(SafetensorsMalformed, DuplicateKeys) {
  const Bytes four(4, 0);
  const std::string a = entry("a", "F32", "[1]", "[0,4]");
  expect_malformed(assemble(header({a, a}), four), {"the name 'a' appears twice"});
  expect_malformed(assemble(R"({"__metadata__":{"k":"v"},"__metadata__":{"k":"v"}})"),
                   {"the name '__metadata__' appears twice"});
  expect_malformed(
      assemble(R"({"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}})", four),
      {"'a' has the key 'dtype' twice"});
  expect_malformed(assemble(R"({"__metadata__":{"k":"v","k":"w"}})"),
                   {"'__metadata__' has the key 'k' twice"});
}

TEST(SafetensorsMalformed, NestedDeeperThanAHeader) {
  expect_malformed(assemble(header({entry("a", "F32", "[[1]]", "[0,4]")}), Bytes(4, 0)),
                   {"the header nests deeper than 3 levels"});
  expect_malformed(assemble(R"({"__metadata__":{"k":{"x":{"y":"z"}}}})"), {"nests deeper"});
  // Far deeper than any recursion could survive, and cheap to refuse.
  const size_t depth = 1'000'000;
  expect_malformed(assemble("{\"a\":" + std::string(depth, '[') + std::string(depth, ']') + "}"),
                   {"nests deeper"});
}

TEST(SafetensorsMalformed, EmptyTensorName) {
  expect_malformed(assemble(header({entry("", "F32", "[1]", "[0,4]")}), Bytes(4, 0)),
                   {"a tensor has an empty name"});
}

TEST(SafetensorsMalformed, TensorEntryOfTheWrongForm) {
  const Bytes four(4, 0);
  expect_malformed(assemble(R"({"a":[1,2]})"), {"tensor 'a' is not an object"});
  expect_malformed(assemble(R"({"a":null})"), {"tensor 'a' is not an object"});
  expect_malformed(assemble(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", four),
                   {"tensor 'a' lacks \"shape\""});
  expect_malformed(assemble(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", four),
                   {"tensor 'a' lacks \"dtype\""});
  expect_malformed(assemble(R"({"a":{"dtype":"F32","shape":[1]}})", four),
                   {"tensor 'a' lacks \"data_offsets\""});
  expect_malformed(
      assemble(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"offset":0}})", four),
      {"tensor 'a' has an unknown field 'offset'"});
}

TEST(SafetensorsMalformed, UnsupportedDType) {
  for (const char* dt : {"U8", "I8", "F8_E4M3", "C64", "f32", "float32", ""})
    expect_malformed(assemble(header({entry("a", dt, "[1]", "[0,4]")}), Bytes(4, 0)),
                     {"tensor 'a' has dtype '" + std::string(dt) + "', which Tessera does not",
                      "(F32, F64, BF16, F16, I64, I32, BOOL)"});
  expect_malformed(assemble(R"({"a":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", Bytes(4, 0)),
                   {"tensor 'a': dtype is not a string"});
}

TEST(SafetensorsMalformed, ShapeOfTheWrongForm) {
  expect_malformed(assemble(header({entry("a", "F32", "4", "[0,4]")}), Bytes(4, 0)),
                   {"tensor 'a': shape is not an array"});
  for (const char* dim : {"-1", "1.0", "\"1\"", "null", "true", "-0"})
    expect_malformed(
        assemble(header({entry("a", "F32", std::string("[").append(dim).append("]"), "[0,4]")}),
                 Bytes(4, 0)),
        {"tensor 'a': a dim of shape is not a non-negative integer"});
}

// Tessera's strides multiply every dim (a zero counted as one), so an empty tensor's dims must
// not overflow either.
TEST(SafetensorsMalformed, ShapeOverflowingAnIndex) {
  for (const char* shape :
       {"[4294967296,4294967296]", "[9223372036854775808]", "[18446744073709551615]",
        "[0,4611686018427387904,4611686018427387904]", "[3074457345618258603,3]"})
    expect_malformed(assemble(header({entry("a", "F32", shape, "[0,0]")})),
                     {"tensor 'a': the product of the dims of its shape overflows"});
}

TEST(SafetensorsMalformed, ShapeDisagreeingWithItsByteRange) {
  expect_malformed(assemble(header({entry("a", "F32", "[2,3]", "[0,20]")}), Bytes(20, 0)),
                   {"tensor 'a': shape [2, 3] of F32 needs 24 bytes but data_offsets span 20"});
  expect_malformed(assemble(header({entry("a", "BOOL", "[]", "[0,0]")})),
                   {"shape [] of BOOL needs 1 bytes but data_offsets span 0"});
  expect_malformed(assemble(header({entry("a", "I64", "[0]", "[0,8]")}), Bytes(8, 0)),
                   {"needs 0 bytes but data_offsets span 8"});
  // The byte count itself overflows: the message must not show a wrapped number.
  expect_malformed(assemble(header({entry("a", "F64", "[2305843009213693952]", "[0,0]")})),
                   {"needs 2^64 or more bytes"});
}

TEST(SafetensorsMalformed, OffsetsOfTheWrongForm) {
  const Bytes four(4, 0);
  for (const char* off : {"4", "[0]", "[0,4,8]", "{\"a\":0}", "\"0,4\"", "[]"})
    expect_malformed(assemble(header({entry("a", "F32", "[1]", off)}), four),
                     {"tensor 'a': data_offsets is not [begin, end]"});
  expect_malformed(assemble(header({entry("a", "F32", "[1]", "[-1,4]")}), four),
                   {"tensor 'a': data_offsets[0] is not a non-negative integer"});
  expect_malformed(assemble(header({entry("a", "F32", "[1]", "[0,4.0]")}), four),
                   {"tensor 'a': data_offsets[1] is not a non-negative integer"});
  expect_malformed(assemble(header({entry("a", "F32", "[0]", "[4,0]")}), four),
                   {"tensor 'a': data_offsets [4, 0] end before they begin"});
}

TEST(SafetensorsMalformed, TensorsNotContiguous) {
  const std::string a = entry("a", "F32", "[1]", "[0,4]");
  expect_malformed(
      assemble(header({a, entry("b", "F32", "[1]", "[8,12]")}), Bytes(12)),
      {"tensor 'b' starts at byte 8 but the previous one ends at 4", "without gaps or overlaps"});
  expect_malformed(assemble(header({a, entry("b", "F32", "[2]", "[2,10]")}), Bytes(10)),
                   {"tensor 'b' starts at byte 2 but the previous one ends at 4"});
  expect_malformed(assemble(header({entry("a", "F32", "[1]", "[4,8]")}), Bytes(8)),
                   {"tensor 'a' starts at byte 4 but the previous one ends at 0"});
  expect_malformed(assemble(header({a, entry("b", "F32", "[1]", "[0,4]")}), Bytes(4)),
                   {"starts at byte 0 but the previous one ends at 4"});
}

TEST(SafetensorsMalformed, DataSectionLongerOrShorterThanTheTensors) {
  const std::string h = header({entry("a", "F32", "[2]", "[0,8]")});
  expect_malformed(assemble(h, Bytes(9)),
                   {"the tensors cover 8 bytes but the data section holds 9"});
  expect_malformed(assemble(h, Bytes(6)),
                   {"the tensors cover 8 bytes but the data section holds 6"});
  expect_malformed(assemble("{}", Bytes(1)), {"cover 0 bytes but the data section holds 1"});
  expect_malformed(assemble(h + std::string(40, ' ')),
                   {"cover 8 bytes but the data section holds 0"});
}

TEST(SafetensorsMalformed, MetadataNotAMapOfStrings) {
  for (const char* m : {"[]", "\"x\"", "3"})
    expect_malformed(assemble(std::string("{\"__metadata__\":") + m + "}"),
                     {"__metadata__ is not an object"});
  for (const char* v : {"1", "null", "[\"a\"]", "true"})
    expect_malformed(assemble(std::string("{\"__metadata__\":{\"k\":") + v + "}}"),
                     {"__metadata__ value of 'k' is not a string"});
}

// A bool byte other than 0 or 1 would be an invalid C++ bool once read.
TEST(SafetensorsMalformed, BoolBytesOtherThanZeroOrOne) {
  expect_malformed(assemble(header({entry("a", "BOOL", "[3]", "[0,3]")}), Bytes{1, 0, 2}),
                   {"tensor 'a' holds a bool byte 2 that is neither 0 nor 1"});
  expect_malformed(assemble(header({entry("a", "BOOL", "[]", "[0,1]")}), Bytes{255}),
                   {"bool byte 255"});
}

TEST(SafetensorsMalformed, LoadNamesThePathOfAMalformedFile) {
  const std::string path = scratch("malformed_path") + "/bad.safetensors";
  const Bytes f = assemble(header({entry("a", "F32", "[2]", "[0,8]")}), Bytes(4));
  write_file(path, f);
  expect_error([&] { load_safetensors(path); },
               {"safetensors file '" + path + "' is malformed",
                "the tensors cover 8 bytes but the data section holds 4"});
}

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

// ---------------------------------------------------------------------------------------------
// Against Hugging Face's reference package (scripts/setup-deps installs it into the environment
// whose interpreter CMake hands in).

using tessera::test::shell_quoted;

// Why the reference package cannot run here, or "" when it can.
std::string reference_missing() {
  const std::string python = TESSERA_SAFETENSORS_PYTHON;
  if (python.empty() || !std::filesystem::exists(python))
    return "no Python environment at '" + python + "' (scripts/setup-deps creates it)";
  for (const char* module : {"numpy", "safetensors"}) {
    const std::string cmd = shell_quoted(python) + " -c 'import " + module + "' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0)
      return std::string("the Python package '") + module + "' is missing from " + python +
             " (scripts/setup-deps installs it)";
  }
  return "";
}

// Runs tests/python/check_safetensors.py; its exit status and output.
std::pair<int, std::string> run_reference(const std::string& mode, const std::string& spec) {
  const std::string log = spec + "." + mode + ".log";
  const std::string cmd =
      shell_quoted(TESSERA_SAFETENSORS_PYTHON) + " " +
      shell_quoted(std::string(TESSERA_SOURCE_DIR) + "/tests/python/check_safetensors.py") + " " +
      mode + " " + shell_quoted(spec) + " > " + shell_quoted(log) + " 2>&1";
  const int rc = std::system(cmd.c_str());
  const Bytes out = read_file(log);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, std::string(out.begin(), out.end())};
}

struct SpecTensor {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t seed;
  bool transposed = false;  // the transpose of a pattern tensor of the reversed shape
};

struct SpecFile {
  std::string path;
  std::map<std::string, std::string> metadata;
  std::vector<SpecTensor> tensors;
};

void write_spec(const std::string& path, const std::vector<SpecFile>& files) {
  json spec = {{"files", json::array()}};
  for (const SpecFile& f : files) {
    json tensors = json::object();
    for (const SpecTensor& t : f.tensors)
      tensors[t.name] = {{"dtype", format_name(t.dtype)},
                         {"shape", t.shape},
                         {"seed", t.seed},
                         {"transposed", t.transposed}};
    spec["files"].push_back({{"path", f.path},
                             {"metadata", f.metadata.empty() ? json(nullptr) : json(f.metadata)},
                             {"tensors", tensors}});
  }
  std::ofstream(path) << spec.dump(1);
}

TEST(SafetensorsReference, ReadsWhatTesseraWrites) {
  if (const std::string why = reference_missing(); !why.empty()) GTEST_SKIP() << why;
  const std::string dir = scratch("reference_reads");
  std::vector<SpecFile> files(4);
  // Every dtype in every layout; BF16 only through the package's raw parser (numpy has none).
  files[0].path = dir + "/every_dtype.safetensors";
  files[0].metadata = {{"format", "pt"}, {"note", "\xc3\xa9 \xe2\x9c\x93"}};
  // Without BF16, so that safetensors.numpy.load_file reads the whole file.
  files[1].path = dir + "/numpy.safetensors";
  files[2].path = dir + "/metadata_only.safetensors";
  files[2].metadata = {{"only", "metadata"}};
  files[3].path = dir + "/nothing.safetensors";
  uint64_t seed = 1000;
  for (DType dt : kDTypes) {
    const std::string p = format_name(dt);
    for (SpecFile* f : {&files[0], &files[1]}) {
      if (dt == DType::BFloat16 && f == &files[1]) continue;
      f->tensors.push_back({p + ".matrix", dt, {5, 7}, seed++});
      f->tensors.push_back({p + ".scalar", dt, {}, seed++});
      f->tensors.push_back({p + ".empty", dt, {0, 3}, seed++});
      f->tensors.push_back({p + ".transposed", dt, {3, 4}, seed++, true});
      f->tensors.push_back({p + ".\xc3\xa9/\xe5\x90\x8d", dt, {2, 1, 2}, seed++});
    }
  }
  for (const SpecFile& f : files) {
    std::map<std::string, Tensor> tensors;
    for (const SpecTensor& t : f.tensors)
      tensors[t.name] = t.transposed ? pattern_tensor({t.shape[1], t.shape[0]}, t.dtype, t.seed)
                                           .as_strided(t.shape, {1, t.shape[0]}, 0)
                                     : pattern_tensor(t.shape, t.dtype, t.seed);
    save_safetensors(f.path, tensors, f.metadata);
  }
  write_spec(dir + "/spec.json", files);
  const auto [rc, out] = run_reference("read", dir + "/spec.json");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find(" 0 problems"), std::string::npos) << out;
  std::cout << out;
}

TEST(SafetensorsReference, WritesWhatTesseraReads) {
  if (const std::string why = reference_missing(); !why.empty()) GTEST_SKIP() << why;
  const std::string dir = scratch("reference_writes");
  std::vector<SpecFile> files(3);
  // safetensors.numpy.save_file: every dtype numpy has.
  files[0].path = dir + "/numpy.safetensors";
  files[0].metadata = {{"format", "np"}, {"note", "\xc3\xa9 \xe2\x9c\x93"}};
  // BF16 through the package's raw serializer, next to others (it orders data by alignment).
  files[1].path = dir + "/bf16.safetensors";
  files[2].path = dir + "/nothing.safetensors";
  uint64_t seed = 2000;
  for (DType dt : kDTypes) {
    const std::string p = format_name(dt);
    SpecFile& f = files[dt == DType::BFloat16 ? 1 : 0];
    f.tensors.push_back({p + ".matrix", dt, {64, 33}, seed++});
    f.tensors.push_back({p + ".scalar", dt, {}, seed++});
    f.tensors.push_back({p + ".empty", dt, {4, 0}, seed++});
    f.tensors.push_back({p + ".odd", dt, {3}, seed++});
  }
  files[1].tensors.push_back({"F32.next_to_bf16", DType::Float32, {5}, seed++});
  files[1].tensors.push_back({"BOOL.next_to_bf16", DType::Bool, {3, 3}, seed++});
  write_spec(dir + "/spec.json", files);
  const auto [rc, out] = run_reference("write", dir + "/spec.json");
  ASSERT_EQ(rc, 0) << out;
  int compared = 0;
  for (const SpecFile& f : files) {
    SCOPED_TRACE(f.path);
    const SafetensorsFile got = load_safetensors(f.path);
    EXPECT_EQ(got.metadata, f.metadata);
    ASSERT_EQ(got.tensors.size(), f.tensors.size());
    for (const SpecTensor& t : f.tensors) {
      ASSERT_TRUE(got.tensors.count(t.name)) << t.name;
      expect_tensor(got.tensors.at(t.name), t.dtype, t.shape,
                    pattern_bytes(t.dtype, t.seed, shape_numel(t.shape)), t.name);
      ++compared;
    }
  }
  EXPECT_EQ(compared, 30);
}

}  // namespace
}  // namespace tessera
