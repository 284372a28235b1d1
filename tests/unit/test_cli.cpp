// Numbers typed on the command line of the examples and benchmarks (examples/common/cli.h).
#include <gtest/gtest.h>

#include "cli.h"
#include "tessera/testing/expect_error.h"

namespace tessera {
namespace {

using testing::expect_error;

TEST(CliNumbers, WholeNumbersInRange) {
  EXPECT_EQ(cli::parse_int("--n", "0", 0, 10), 0);
  EXPECT_EQ(cli::parse_int("--n", "10", 0, 10), 10);
  EXPECT_EQ(cli::parse_int("--n", "-3", -5, 10), -3);
  EXPECT_EQ(cli::parse_int("--n", "9223372036854775807", 0, INT64_MAX), INT64_MAX);
}

TEST(CliNumbers, MalformedWholeNumbersNameTheFlagTextAndRange) {
  for (const char* bad : {"abc", "12abc", "", " 12", "1.5", "0x10", "--", "1e3"})
    expect_error([&] { cli::parse_int("--steps", bad, 0, 100); },
                 {"--steps takes a whole number in [0, 100]", "got '" + std::string(bad) + "'"});
  expect_error([] { cli::parse_int("--mib", "99999999999999999999", 1, 1 << 20); },
               "got '99999999999999999999'");
  expect_error([] { cli::parse_int("--tp", "0", 1, 8); }, "--tp takes a whole number in [1, 8]");
  expect_error([] { cli::parse_int("--tp", "9", 1, 8); }, "got '9'");
}

TEST(CliNumbers, RealsInRange) {
  EXPECT_DOUBLE_EQ(cli::parse_real("--lr", "3e-3", 0, 1), 3e-3);
  EXPECT_DOUBLE_EQ(cli::parse_real("--lr", "1", 0, 1), 1.0);
  EXPECT_DOUBLE_EQ(cli::parse_real("--lr", "0", 0, 1), 0.0);
}

TEST(CliNumbers, MalformedRealsAreRefused) {
  for (const char* bad : {"abc", "1e-3x", "", "nan", "inf", "-0.5", "2"})
    expect_error([&] { cli::parse_real("--lr", bad, 0, 1); },
                 {"--lr takes a number in [0, 1]", "got '" + std::string(bad) + "'"});
}

}  // namespace
}  // namespace tessera
