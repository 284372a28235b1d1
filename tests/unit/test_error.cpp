// Errors keep where they were raised, and show it in their message only when asked
// (TESSERA_ERROR_LOCATION) or in a debug build; tests/CMakeLists.txt runs this file twice.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "tessera/core/error.h"

namespace tessera {
namespace {

bool locations_asked_for() {
  const char* v = std::getenv("TESSERA_ERROR_LOCATION");
  if (v != nullptr && *v != '\0') return std::string(v) != "0";
#ifdef NDEBUG
  return false;
#else
  return true;
#endif
}

TEST(ErrorLocation, KeptInTheErrorAndShownOnlyWhenAsked) {
  int line = 0;
  try {
    line = __LINE__ + 1;
    TESSERA_FAIL("shape [2, 3] does not match [3, 2]");
  } catch (const Error& e) {
    EXPECT_TRUE(std::string(e.file()).ends_with("tests/unit/test_error.cpp")) << e.file();
    EXPECT_EQ(e.line(), line);
    const std::string what = e.what();
    EXPECT_TRUE(what.starts_with("shape [2, 3] does not match [3, 2]")) << what;
    const std::string where = "(raised at tests/unit/test_error.cpp:" + std::to_string(line) + ")";
    if (locations_asked_for()) {
      EXPECT_NE(what.find(where), std::string::npos) << what;
    } else {
      EXPECT_EQ(what.find("raised at"), std::string::npos) << what;
    }
    return;
  }
  ADD_FAILURE() << "TESSERA_FAIL did not throw";
}

TEST(ErrorLocation, ErrorsMadeDirectlyHaveNone) {
  const Error e("plain");
  EXPECT_STREQ(e.file(), "");
  EXPECT_EQ(e.line(), 0);
  EXPECT_STREQ(e.what(), "plain");
}

}  // namespace
}  // namespace tessera
