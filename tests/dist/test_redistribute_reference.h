#pragma once
// What the redistribute, random and misuse tests add to the testing kit's reference geometry
// (tessera/testing/geometry.h, computed without the layout code under test): gradient
// placements, and a failure counter for sweeps that run thousands of checks.
#include <gtest/gtest.h>

#include <string>

#include "tessera/tessera.h"
#include "tessera/testing.h"

namespace tessera::test_ref {

using namespace ::tessera::testing;

// Partial placements become Replicate: the placements of a gradient.
inline Placements grad_placements(Placements p) {
  for (auto& q : p)
    if (q.is_partial()) q = Replicate();
  return p;
}

// Failures of one test on this rank: the first few are reported in full, the rest counted, so a
// systematic bug does not bury the output.
class Failures {
 public:
  void check(const std::string& what, const std::string& context, const std::string& problem) {
    ++checks_;
    if (problem.empty()) return;
    if (++count_ <= kReported) ADD_FAILURE() << context << ": " << what << ": " << problem;
  }
  void summarize() const {
    EXPECT_EQ(count_, 0) << count_ << " of " << checks_ << " checks failed on world rank "
                         << world_rank() << " (first " << kReported << " reported above)";
    EXPECT_GT(checks_, 0);
  }

 private:
  static constexpr int kReported = 8;
  int count_ = 0;
  int checks_ = 0;
};

}  // namespace tessera::test_ref
