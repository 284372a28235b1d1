// PEFT's orthogonal init (LoraLayer.orthogonal_init), drawn whole on every rank.
#include "orthogonal_init.h"

#include <cmath>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/core/factory.h"

namespace tessera::lora_detail {

namespace {

// An [n, n] orthogonal matrix, row-major: the Q of the QR of `x` (modified Gram-Schmidt over its
// columns, twice for orthogonality to rounding, in float64).
std::vector<double> orthogonal_q(const std::vector<double>& x, int64_t n) {
  std::vector<double> q = x;
  auto at = [&](int64_t r, int64_t c) -> double& { return q[size_t(r * n + c)]; };
  for (int64_t c = 0; c < n; ++c) {
    for (int pass = 0; pass < 2; ++pass)
      for (int64_t k = 0; k < c; ++k) {
        double dot = 0;
        for (int64_t r = 0; r < n; ++r)
          dot += at(r, k) * at(r, c);
        for (int64_t r = 0; r < n; ++r)
          at(r, c) -= dot * at(r, k);
      }
    double norm = 0;
    for (int64_t r = 0; r < n; ++r)
      norm += at(r, c) * at(r, c);
    norm = std::sqrt(norm);
    TESSERA_CHECK(norm > 0, "LoRA orthogonal init: a singular draw");
    for (int64_t r = 0; r < n; ++r)
      at(r, c) /= norm;
  }
  return q;
}

// PEFT's orthogonal init (LoraLayer.orthogonal_init): Q from the QR of an [r, r] normal draw,
// A = (G Q[0::2])^T / 10 with G [in, r/2] and B = H^T Q[1::2] / 10 with H [r/2, out], both
// normal. Q's rows are orthonormal, so B A = H^T Q[1::2] Q[0::2]^T G^T / 100 = 0: the adapter
// starts as the identity with neither matrix zero. The global [r, in] and [out, r], from `gen`
// alone.
}  // namespace

std::pair<Tensor, Tensor> orthogonal_init(int64_t r, int64_t in, int64_t out, Generator& gen) {
  const int64_t h = r / 2;
  const std::vector<double> q =
      orthogonal_q(randn({r, r}, gen, DType::Float64).to_vector<double>(), r);
  const std::vector<double> g = randn({in, h}, gen, DType::Float64).to_vector<double>();
  const std::vector<double> hh = randn({h, out}, gen, DType::Float64).to_vector<double>();
  std::vector<float> a(size_t(r * in)), b(size_t(out * r));
  for (int64_t j = 0; j < r; ++j)
    for (int64_t i = 0; i < in; ++i) {
      double v = 0;  // (G Q[0::2])[i, j]
      for (int64_t k = 0; k < h; ++k)
        v += g[size_t(i * h + k)] * q[size_t(2 * k * r + j)];
      a[size_t(j * in + i)] = float(v / 10.0);
    }
  for (int64_t o = 0; o < out; ++o)
    for (int64_t j = 0; j < r; ++j) {
      double v = 0;  // (H^T Q[1::2])[o, j]
      for (int64_t k = 0; k < h; ++k)
        v += hh[size_t(k * out + o)] * q[size_t((2 * k + 1) * r + j)];
      b[size_t(o * r + j)] = float(v / 10.0);
    }
  return {from_vector<float>(a, {r, in}), from_vector<float>(b, {out, r})};
}

}  // namespace tessera::lora_detail
