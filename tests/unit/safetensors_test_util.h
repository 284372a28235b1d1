#pragma once
// Helpers shared by the safetensors tests: the format's dtype names, a scratch directory per
// test, raw file bytes, headers assembled by hand and parsed independently of the reader, and a
// check of a read tensor against its expected bytes.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "common/bit_pattern.h"
#include "tessera/checkpoint/safetensors.h"
#include "tessera/core/factory.h"

namespace tessera::safetensors_test {

using testing::raw_bytes;
using Bytes = std::vector<unsigned char>;
using json = nlohmann::json;

inline constexpr DType kDTypes[] = {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16,
                                    DType::Int64,   DType::Int32,   DType::Bool};

// The format's names, written out here rather than taken from the code under test.
inline const char* format_name(DType dt) {
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
inline std::string scratch(const std::string& name) {
  const std::string dir = std::string(TESSERA_TEST_SCRATCH) + "/safetensors/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_file(const std::string& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

inline void put_u64(Bytes& b, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i)
    b[at + size_t(i)] = static_cast<unsigned char>(v >> (8 * i));
}

inline uint64_t get_u64(const Bytes& b, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i)
    v = (v << 8) | b[at + size_t(i)];
  return v;
}

// A file from header text and data, with the header's true length.
inline Bytes assemble(const std::string& header, const Bytes& data = {}) {
  Bytes out(8 + header.size() + data.size());
  put_u64(out, 0, header.size());
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + std::ptrdiff_t(header.size()));
  return out;
}

// The header of a file as JSON, parsed independently of the reader under test.
inline json header_of(const Bytes& file) {
  const uint64_t n = get_u64(file, 0);
  return json::parse(file.begin() + 8, file.begin() + 8 + std::ptrdiff_t(n));
}

inline std::vector<std::string> names_of(const std::map<std::string, Tensor>& m) {
  std::vector<std::string> out;
  for (const auto& [k, v] : m)
    out.push_back(k);
  return out;
}

inline void expect_tensor(const Tensor& got, DType dt, const Shape& shape, const Bytes& bytes,
                          const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  EXPECT_EQ(got.dtype(), dt) << what;
  EXPECT_EQ(got.shape(), shape) << what;
  EXPECT_TRUE(got.is_contiguous()) << what;
  EXPECT_TRUE(raw_bytes(got) == bytes) << what << ": bytes differ";
}

// Built by appending: GCC 12 misreports chains of string operator+ as overlapping copies.
inline std::string entry(const std::string& name, const std::string& dtype,
                         const std::string& shape, const std::string& offsets) {
  std::string s = "\"";
  s.append(name).append("\":{\"dtype\":\"").append(dtype).append("\",\"shape\":");
  s.append(shape).append(",\"data_offsets\":").append(offsets).append("}");
  return s;
}

inline std::string header(std::initializer_list<std::string> entries) {
  std::string s = "{";
  for (const std::string& e : entries)
    s.append(s.size() > 1 ? "," : "").append(e);
  return s.append("}");
}

}  // namespace tessera::safetensors_test
