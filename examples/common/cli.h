#pragma once
// Numbers typed on a command line, for the examples and benchmarks. The whole text must be the
// number and lie in [lo, hi]: "abc", "12abc", "" and out-of-range values are errors naming the
// flag, the text and the range, never a silent 0 as atoi makes of them.
#include <charconv>
#include <cstdint>
#include <string>
#include <system_error>

#include "tessera/core/error.h"

namespace tessera::cli {

inline int64_t parse_int(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
  int64_t x = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, x);
  TESSERA_CHECK(ec == std::errc() && ptr == end && !text.empty() && x >= lo && x <= hi, flag,
                " takes a whole number in [", lo, ", ", hi, "], got '", text, "'");
  return x;
}

inline double parse_real(const std::string& flag, const std::string& text, double lo, double hi) {
  double x = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, x);
  // The negated comparison also refuses NaN.
  TESSERA_CHECK(
      ec == std::errc() && ptr == end && !text.empty() && !(x < lo) && !(x > hi) && x == x, flag,
      " takes a number in [", lo, ", ", hi, "], got '", text, "'");
  return x;
}

}  // namespace tessera::cli
