// Rotary position embedding, interleaved (Meta LLaMA) convention: the pair (x[2i], x[2i+1]) of
// every head at position t is rotated by the angle t * theta^(-2i/D).
#include <cmath>

#include "../portable/nn_checks.h"
#include "kernels.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/nn.h"

namespace tessera::kernels::cpu {

namespace {

template <class C>
void rotate(const C* x, const C* cos, const C* sin, C* out, int64_t batch, int64_t seq,
            int64_t heads, int64_t half, bool inverse) {
  // The inverse rotation by -angle is the transpose: only sin changes sign.
  const C sign = inverse ? C(-1) : C(1);
  const int64_t d = 2 * half;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      const C* ct = cos + t * half;
      const C* st = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = ((b * seq + t) * heads + h) * d;
        const C* xi = x + base;
        C* oi = out + base;
        for (int64_t i = 0; i < half; ++i) {
          const C c = ct[i], s = sign * st[i];
          const C x0 = xi[2 * i], x1 = xi[2 * i + 1];
          oi[2 * i] = x0 * c - x1 * s;
          oi[2 * i + 1] = x0 * s + x1 * c;
        }
      }
    }
  }
}

}  // namespace

Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse) {
  const portable::RopeDims r = portable::check_rope(x, cos, sin);
  const int64_t batch = r.batch, seq = r.seq, heads = r.heads, half = r.half;
  DType cdt = compute_dtype(x.dtype());
  // Only the first T rows of a longer table are used; viewing them avoids converting the rest.
  auto rows = [&](const Tensor& table) {
    return table.as_strided({seq, half}, table.strides(), table.storage_offset())
        .to(cdt)
        .contiguous();
  };
  Tensor xc = x.to(cdt).contiguous(), cc = rows(cos), sc = rows(sin);
  Tensor out = empty(x.shape(), cdt);
  if (cdt == DType::Float64) {
    rotate<double>(xc.data<double>(), cc.data<double>(), sc.data<double>(), out.data<double>(),
                   batch, seq, heads, half, inverse);
  } else {
    rotate<float>(xc.data<float>(), cc.data<float>(), sc.data<float>(), out.data<float>(), batch,
                  seq, heads, half, inverse);
  }
  return out.to(x.dtype());
}

}  // namespace tessera::kernels::cpu

namespace tessera::kernels {

// Tables are built on the host: they hold no tensor input to say which device, and are small.
std::pair<Tensor, Tensor> rope_tables(int64_t max_seq, int64_t head_dim, double theta,
                                      DType dtype) {
  TESSERA_CHECK(max_seq >= 0, "rope_tables: max_seq must be >= 0, got ", max_seq);
  TESSERA_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope_tables: head_dim must be positive and ",
                "even, got ", head_dim);
  TESSERA_CHECK(theta > 0, "rope_tables: theta must be > 0, got ", theta);
  TESSERA_CHECK(is_floating(dtype), "rope_tables: dtype must be floating, got ", dtype_name(dtype));
  const int64_t half = head_dim / 2;
  // Angles in float64 so positions far into a long context keep their precision before the
  // tables are rounded to `dtype`.
  Tensor cos = empty({max_seq, half}, DType::Float64), sin = empty({max_seq, half}, DType::Float64);
  double* cp = cos.data<double>();
  double* sp = sin.data<double>();
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(theta, -double(2 * i) / double(head_dim));
    for (int64_t t = 0; t < max_seq; ++t) {
      const double angle = double(t) * inv_freq;
      cp[t * half + i] = std::cos(angle);
      sp[t * half + i] = std::sin(angle);
    }
  }
  return {cos.to(dtype), sin.to(dtype)};
}

}  // namespace tessera::kernels
