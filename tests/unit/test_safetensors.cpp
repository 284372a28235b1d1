// The safetensors reader and writer: round trips of every dtype and layout, metadata and names,
// files other writers lay out differently, and what the writer refuses. The malformed files
// (safetensors_malformed.cpp), the fuzz test of corrupted files (safetensors_fuzz.cpp) and both
// directions against Hugging Face's reference package (safetensors_reference.cpp) are compiled
// into this same binary.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "common/bit_pattern.h"
#include "tessera/checkpoint/safetensors.h"
#include "tessera/core/factory.h"
#include "tessera/testing/expect_error.h"
#include "unit/safetensors_test_util.h"

namespace tessera {
namespace {

using namespace safetensors_test;
using testing::expect_error;
using testing::pattern_bytes;
using testing::pattern_tensor;

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

}  // namespace
}  // namespace tessera
