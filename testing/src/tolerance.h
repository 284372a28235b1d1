#pragma once
// The one rule by which the kit's checks and its parity runner compare numbers, and how they print
// them.
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "tessera/testing/checks.h"

namespace tessera::testing::detail {

// |got - want| as a share of what `tol` allows at `want` (atol + rtol * |want|): at most 1 is a
// match. Equal values (infinities included) match exactly; NaN is infinitely far from anything.
inline double tolerance_share(double got, double want, Tolerance tol) {
  if (got == want) return 0;
  const double d = std::abs(got - want);
  if (std::isnan(d)) return std::numeric_limits<double>::infinity();
  const double allowed = tol.atol + tol.rtol * std::abs(want);
  return allowed > 0 ? d / allowed : std::numeric_limits<double>::infinity();
}

inline bool within(double got, double want, Tolerance tol) {
  return tolerance_share(got, want, tol) <= 1;
}

inline std::string number_str(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}

}  // namespace tessera::testing::detail
