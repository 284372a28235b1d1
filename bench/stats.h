#pragma once
// The summaries the benchmarks report, defined once: the median as Python's statistics.median
// and NumPy take it (an even count gives the mean of its two middle values, so that a ratio
// against PyTorch's timings compares like with like), and the spread around it.
#include <algorithm>
#include <stdexcept>
#include <vector>

namespace tessera::bench {

template <class T>
T median(std::vector<T> v) {
  if (v.empty()) throw std::invalid_argument("median of no values");
  std::sort(v.begin(), v.end());
  const size_t mid = v.size() / 2;
  return v.size() % 2 ? v[mid] : (v[mid - 1] + v[mid]) / T(2);
}

struct Spread {
  double median, min, max;
};

inline Spread spread(const std::vector<double>& v) {
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return {median(v), *lo, *hi};
}

}  // namespace tessera::bench
