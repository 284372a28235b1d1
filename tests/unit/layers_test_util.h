#pragma once
// Shared by the layer tests: element-wise comparisons of tensors with tolerances (common/near.h)
// or exactly, the names of a module's parameters in registration order, and a small model.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/near.h"
#include "tessera/tessera.h"

namespace tessera::layers_test {

using tessera::testing::expect_near_all;

inline void expect_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  EXPECT_EQ(got.to_vector<double>(), want.to_vector<double>()) << what;
}

inline std::vector<std::string> names_of(Module& m) {
  std::vector<std::string> out;
  for (auto& [name, p] : m.named_parameters())
    out.push_back(name);
  return out;
}

// A container with two layers of different types, as a model would hold them.
class Block : public Module {
 public:
  explicit Block(Generator& gen) : Module("Block") {
    proj = std::make_shared<Linear>(4, 3, true, gen);
    norm = std::make_shared<RMSNorm>(3);
    register_module("proj", proj);
    register_module("norm", norm);
  }
  Tensor forward(const Tensor& x) override { return (*norm)((*proj)(x)); }
  std::shared_ptr<Linear> proj;
  std::shared_ptr<RMSNorm> norm;
};

}  // namespace tessera::layers_test
