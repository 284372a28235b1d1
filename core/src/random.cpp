#include "tessera/core/random.h"

#include <cmath>

#include "cpu/kernels.h"
#include "portable/element_ops.h"
#include "tessera/core/detail/strided_loop.h"
#include "tessera/core/factory.h"

namespace tessera {

namespace detail {
thread_local GeneratorObserver* t_generator_observer = nullptr;
}  // namespace detail

Generator& default_generator() {
  static Generator gen(0);
  return gen;
}
void manual_seed(uint64_t seed) {
  default_generator().manual_seed(seed);
}

void philox_fill(Tensor& out, RandomKind kind, double a, double b, uint64_t seed, uint64_t base,
                 const RandomWindow& window) {
  const Shape& local = out.shape();
  TESSERA_CHECK(is_floating(out.dtype()), "random fill of a ", dtype_name(out.dtype()),
                " tensor: needs a floating dtype");
  TESSERA_CHECK(
      window.global_shape.size() == local.size() && window.global_offset.size() == local.size(),
      "random window: global shape ", shape_str(window.global_shape), " / offset ",
      shape_str(window.global_offset), " do not match local shape ", shape_str(local));
  for (size_t d = 0; d < local.size(); ++d) {
    TESSERA_CHECK(window.global_offset[d] >= 0 &&
                      window.global_offset[d] + local[d] <= window.global_shape[d],
                  "random window: local shape ", shape_str(local), " at offset ",
                  shape_str(window.global_offset), " exceeds global shape ",
                  shape_str(window.global_shape));
  }
  if (out.numel() == 0) {
    // A write all the same (as copy_ and fill_ count one): a rank with an empty shard sees the
    // versions the others do.
    if (out.storage().impl()) out.storage().impl()->bump_version();
    return;
  }
  kernels::philox_fill(out, kind, a, b, seed, base, window);
}

namespace kernels::cpu {

void philox_fill(Tensor& out, RandomKind kind, double a, double b, uint64_t seed, uint64_t base,
                 const RandomWindow& window) {
  const Shape& local = out.shape();
  // Global linear index of the local element at multi-index idx is
  // sum_d (offset_d + idx_d) * gstride_d; iterate runs over the local tensor.
  Shape gstrides = contiguous_strides(window.global_shape);
  int64_t gbase = 0;
  for (size_t d = 0; d < local.size(); ++d)
    gbase += window.global_offset[d] * gstrides[d];
  dispatch_dtype(out.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      T* p = static_cast<T*>(out.raw_data());
      detail::for_each_run<2>(local, {&out.strides(), &gstrides}, [&](const detail::Run<2>& r) {
        for (int64_t i = 0; i < r.length; ++i) {
          uint64_t g = base + uint64_t(gbase + r.offset[1] + i * r.stride[1]);
          p[r.offset[0] + i * r.stride[0]] =
              kernels::portable::philox_element<T>(seed, kind, a, b, g);
        }
      });
    }
  });
}

}  // namespace kernels::cpu

void check_random_fill(DType dtype, RandomKind kind, double a, double b, const char* op) {
  TESSERA_CHECK(is_floating(dtype), op, ": random fill of a ", dtype_name(dtype),
                " tensor: needs a floating dtype");
  if (kind == RandomKind::Uniform)
    TESSERA_CHECK(std::isfinite(a) && std::isfinite(b) && a <= b, op,
                  ": expects a [low, high) range of finite bounds, got low=", a, ", high=", b);
  if (kind == RandomKind::Normal) TESSERA_CHECK(b >= 0, op, ": expects std >= 0, got std=", b);
}

namespace {
void fill_whole(Tensor& t, RandomKind kind, double a, double b, Generator& gen, const char* op) {
  check_random_fill(t.dtype(), kind, a, b, op);
  uint64_t base = gen.advance(uint64_t(t.numel()));
  philox_fill(t, kind, a, b, gen.seed(), base, {t.shape(), Shape(t.dim(), 0)});
}
}  // namespace

Tensor rand(const Shape& shape, Generator& gen, DType dtype) {
  Tensor t = empty(shape, dtype);
  fill_whole(t, RandomKind::Uniform, 0.0, 1.0, gen, "rand");
  return t;
}

Tensor randn(const Shape& shape, Generator& gen, DType dtype) {
  Tensor t = empty(shape, dtype);
  fill_whole(t, RandomKind::Normal, 0.0, 1.0, gen, "randn");
  return t;
}

Tensor& uniform_(Tensor& t, double low, double high, Generator& gen) {
  fill_whole(t, RandomKind::Uniform, low, high, gen, "uniform_");
  return t;
}

Tensor& normal_(Tensor& t, double mean, double std, Generator& gen) {
  fill_whole(t, RandomKind::Normal, mean, std, gen, "normal_");
  return t;
}

Fans compute_fans(const Shape& s) {
  TESSERA_CHECK(s.size() >= 2, "fan in/out need at least 2 dims, got shape ", shape_str(s));
  int64_t receptive = 1;
  for (size_t d = 2; d < s.size(); ++d)
    receptive *= s[d];
  return {s[1] * receptive, s[0] * receptive};
}

double kaiming_uniform_bound(const Shape& global_shape, double a, FanMode mode) {
  Fans f = compute_fans(global_shape);
  double fan = double(mode == FanMode::FanIn ? f.fan_in : f.fan_out);
  double gain = std::sqrt(2.0 / (1.0 + a * a));
  return gain * std::sqrt(3.0 / fan);
}

Tensor& kaiming_uniform_(Tensor& t, Generator& gen, double a, FanMode mode) {
  // As PyTorch: a tensor of no elements is left alone (its fans may be 0, the bound infinite).
  if (shape_numel(t.shape()) == 0) return t;
  double bound = kaiming_uniform_bound(t.shape(), a, mode);
  return uniform_(t, -bound, bound, gen);
}

double xavier_uniform_bound(const Shape& global_shape, double gain) {
  Fans f = compute_fans(global_shape);
  return gain * std::sqrt(6.0 / double(f.fan_in + f.fan_out));
}

Tensor& xavier_uniform_(Tensor& t, Generator& gen, double gain) {
  // As PyTorch: a tensor of no elements is left alone (its fans may be 0, the bound infinite).
  if (shape_numel(t.shape()) == 0) return t;
  double bound = xavier_uniform_bound(t.shape(), gain);
  return uniform_(t, -bound, bound, gen);
}

}  // namespace tessera
