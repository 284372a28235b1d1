#pragma once
// What the checkpoint tests share: tensors whose values encode their global index (so any
// window read from the wrong place shows), bit-exact comparison, and a scratch directory.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "tessera/tessera.h"

namespace tessera::testing {

// Element i of the global tensor: distinct for every index below 97, exact in every dtype
// (bfloat16 included); `salt` makes two tensors differ.
inline Tensor index_tensor(const Shape& shape, DType dtype, int salt = 0) {
  const int64_t n = shape_numel(shape);
  std::vector<double> v(static_cast<size_t>(n), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = (i + 13 * salt) % 97;
    if (dtype == DType::Bool)
      v[size_t(i)] = double(k % 3 == 0);
    else if (is_floating(dtype))
      v[size_t(i)] = double(k) * 0.25 - 7.0;
    else
      v[size_t(i)] = double(k * 3 - 5 + 1000 * salt);
  }
  // from_vector reads an empty shape as 1-D; a 0-d tensor is made as such.
  if (shape.empty()) return full({}, v[0], dtype);
  return from_vector<double>(v, shape).to(dtype);
}

// Bit-for-bit equality of two tensors of one dtype and shape.
inline void expect_identical(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  Tensor a = got.contiguous(), b = want.contiguous();
  const bool same = a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
  EXPECT_TRUE(same) << what << ": values differ (got " << got.str() << ")";
}

// A directory under the build tree that every job of the test binary shares (rank 0 creates
// it): for files one world size writes and another reads, in jobs CTest orders by fixtures.
inline std::string shared_scratch_dir(const std::string& name) {
  const std::string dir = std::string(TESSERA_TEST_SCRATCH) + "/" + name;
  if (world_rank() == 0) std::filesystem::create_directories(dir);
  world_group()->barrier()->wait();
  return dir;
}

// A directory for the ranks of this job alone. Its name carries the world size: CTest runs a
// test's world sizes concurrently, and two jobs writing one file damaged each other's
// checkpoints.
inline std::string scratch_dir(const std::string& name) {
  return shared_scratch_dir(name + ".np" + std::to_string(world_size()));
}

}  // namespace tessera::testing
