// Malformed safetensors files: one test per kind of problem; each error names the file and the
// problem. Part of the test_safetensors binary.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/checkpoint/safetensors.h"
#include "tessera/testing/expect_error.h"
#include "unit/safetensors_test_util.h"

namespace tessera {
namespace {

using namespace safetensors_test;
using testing::expect_error;

// ---------------------------------------------------------------------------------------------
// Malformed files: one test per kind; each error names the file and the problem.

void expect_malformed(const Bytes& file, std::vector<std::string> needles) {
  needles.push_back("safetensors file 'bad.safetensors'");
  expect_error([&] { parse_safetensors(file.data(), file.size(), "bad.safetensors"); }, needles);
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

}  // namespace
}  // namespace tessera
