#pragma once
// TESSERA_EXPECT_CONTAINS(haystack, needle): a non-fatal check that a message (an error, a child
// job's output) contains a substring, printing both when it does not. A macro, so a failure
// points at the line of the check.
#include <gtest/gtest.h>

#include <string>

#define TESSERA_EXPECT_CONTAINS(haystack, needle)                  \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "missing: " << (needle) << "\nin: " << (haystack)
