// Module path patterns (parallelize_module's plan keys, LoRA's target modules) match each path
// component as Python's fnmatch.fnmatchcase does; the expectations below are what it returns.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tessera/nn/module_path.h"

using namespace tessera;

namespace {

struct Case {
  std::string pattern, component;
  bool matches;
};

TEST(ModulePath, EachComponentMatchesAsFnmatch) {
  const std::vector<Case> cases = {
      {"*", "w1", true},        {"w?", "w1", true},         {"w?", "w12", false},
      {"w[13]", "w3", true},    {"w[13]", "w2", false},     {"w[!13]", "w2", true},
      {"w[!13]", "w1", false},  {"[0-1]", "0", true},       {"[0-1]", "2", false},
      {"[a-c]x", "bx", true},   {"[]]", "]", true},         {"[!]]", "a", true},
      {"w[1", "w[1", true},     {"w[1", "w1", false},       {"a*b*c", "aXbYc", true},
      {"a*b*c", "aXbY", false}, {"*[0-9]", "layer7", true}, {"*[0-9]", "layer", false}};
  for (const Case& c : cases)
    EXPECT_EQ(module_path_matches(c.pattern, c.component), c.matches)
        << "'" << c.pattern << "' against '" << c.component << "'";
}

TEST(ModulePath, PatternsMatchComponentByComponentAndNeverTheRootByWildcard) {
  EXPECT_TRUE(module_path_matches("layers.[0-1].mlp", "layers.1.mlp"));
  EXPECT_FALSE(module_path_matches("layers.[0-1].mlp", "layers.2.mlp"));
  EXPECT_FALSE(module_path_matches("layers.*", "layers.0.mlp"));  // '*' stays in its component
  EXPECT_FALSE(module_path_matches("*", "a.b"));
  EXPECT_FALSE(module_path_matches("*", ""));  // the root is not its own child
  EXPECT_TRUE(module_path_matches("", ""));
}

}  // namespace
