#pragma once
// Reference helpers shared by the kernel tests (elementwise, reduce): deterministic inputs, values
// as a dtype holds them, broadcasting by hand, tolerance checks and gradchecks.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "tessera/tessera.h"

namespace tessera::kernel_test {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Deterministic, irregular values in [lo, hi], never exactly 0 when lo < 0 < hi is symmetric.
inline std::vector<double> wavy(int64_t n, double lo, double hi, double phase = 0.0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double u = 0.5 + 0.5 * std::sin(1.7 * double(i) + 0.3 + phase);  // (0, 1)
    v[size_t(i)] = lo + (hi - lo) * (0.02 + 0.96 * u);
  }
  return v;
}

inline Tensor tensor_of(const std::vector<double>& v, const Shape& shape, DType dt) {
  return from_vector<double>(v, shape).to(dt);
}

// Values a tensor of dtype `dt` actually holds after rounding `v` into it.
inline std::vector<double> rounded(const std::vector<double>& v, DType dt) {
  return from_vector<double>(v).to(dt).to_vector<double>();
}

inline void expect_close(const Tensor& t, const std::vector<double>& want, double rtol, double atol,
                         const std::string& what = "") {
  const std::vector<double> got = t.to_vector<double>();
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << what << " element " << i << " got " << got[i];
      continue;
    }
    if (std::isinf(want[i])) {
      EXPECT_EQ(got[i], want[i]) << what << " element " << i;
      continue;
    }
    EXPECT_NEAR(got[i], want[i], atol + rtol * std::abs(want[i])) << what << " element " << i;
  }
}

// out[idx] = f(a[bcast idx], b[bcast idx]) for numpy broadcasting of a and b to `out_shape`.
inline std::vector<double> ref_broadcast(const std::vector<double>& a, const Shape& as,
                                         const std::vector<double>& b, const Shape& bs,
                                         const Shape& out_shape,
                                         const std::function<double(double, double)>& f) {
  const int64_t n = shape_numel(out_shape);
  const size_t nd = out_shape.size();
  auto index_in = [&](int64_t flat, const Shape& s) {
    // Walk out's dims from the back; dims of s align to the right, size-1 dims read index 0.
    int64_t idx = 0, mul = 1;
    for (size_t k = 0; k < nd; ++k) {
      const size_t od = nd - 1 - k;
      const int64_t coord = flat % out_shape[od];
      flat /= out_shape[od];
      if (k < s.size()) {
        const int64_t sd = s[s.size() - 1 - k];
        idx += (sd == 1 ? 0 : coord) * mul;
        mul *= sd;
      }
    }
    return idx;
  };
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    out[size_t(i)] = f(a[size_t(index_in(i, as))], b[size_t(index_in(i, bs))]);
  return out;
}

inline std::vector<double> map(const std::vector<double>& v,
                               const std::function<double(double)>& f) {
  std::vector<double> out;
  for (double x : v)
    out.push_back(f(x));
  return out;
}

inline Tensor leaf(const std::vector<double>& v, const Shape& s) {
  Tensor t = from_vector<double>(v, s);
  t.set_requires_grad(true);
  return t;
}

inline void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                             const std::vector<Tensor>& inputs, const std::string& what) {
  GradcheckResult r = gradcheck(f, inputs);
  EXPECT_TRUE(r.ok) << what << ": " << r.message;
}

}  // namespace tessera::kernel_test
