// The safetensors reader and writer against Hugging Face's reference package, both directions
// (tests/python/check_safetensors.py). Part of the test_safetensors binary.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/bit_pattern.h"
#include "common/shell_quote.h"
#include "tessera/checkpoint/safetensors.h"
#include "tessera/core/factory.h"
#include "unit/safetensors_test_util.h"

namespace tessera {
namespace {

using namespace safetensors_test;
using testing::pattern_bytes;
using testing::pattern_tensor;

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
