#include "tessera/dtensor/random.h"

#include <vector>

#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/dtensor/ops.h"

namespace tessera {

namespace {

// The windows only fit together into one draw when every rank of the mesh draws from the same
// seed and offset; a generator seeded by rank (common for data order) would give each rank a
// window of a different draw and unequal replicas, silently. PyTorch syncs its DTensor RNG state
// from rank 0; here the generator is the caller's, so the ranks check that they agree (one small
// all-reduce per mesh dim), all failing together when they do not. The all-reduces over the
// mesh dims run one after another on the same values, which then hold the whole mesh's extremes:
// every rank judges the same values. (Judging after each dim let the ranks of a line that
// disagreed throw while the others waited for them in the next dim's all-reduce.)
void check_same_generator(const DTensorSpec& s, const Generator& gen, const char* op) {
  const auto seed = int64_t(gen.seed()), offset = int64_t(gen.offset());
  // ~x orders opposite to x without overflowing, so one Max gives both ends.
  Tensor v = from_vector<int64_t>({seed, ~seed, offset, ~offset}).to(s.mesh.device());
  for (int64_t m = 0; m < s.mesh.ndim(); ++m)
    s.mesh.group(m)->all_reduce(v, ReduceOp::Max)->wait();
  const std::vector<int64_t> r = v.to_vector<int64_t>();
  TESSERA_CHECK(r[0] == ~r[1] && r[2] == ~r[3], op, " on a DTensor over ", s.mesh.str(),
                ": the ranks of the mesh draw from different generator states (seed ",
                uint64_t(~r[1]), " to ", uint64_t(r[0]), ", offset ", uint64_t(~r[3]), " to ",
                uint64_t(r[2]), "; this rank: seed ", gen.seed(), ", offset ", gen.offset(),
                "); seed the Generator alike on every rank and draw the same sequence on each");
}

// Every rank reserves the whole logical draw, then fills only its window of it.
DTensor& fill_window(DTensor& t, RandomKind kind, double a, double b, Generator& gen,
                     const char* op, bool check_generator = true) {
  const DTensorSpec& s = t.spec();
  check_random_fill(s.dtype, kind, a, b, op);
  if (check_generator) check_same_generator(s, gen, op);
  uint64_t base = gen.advance(uint64_t(shape_numel(s.global_shape)));
  Tensor local = t.to_local();
  LocalLayout l = s.local_layout();
  philox_fill(local, kind, a, b, gen.seed(), base, {s.global_shape, l.global_offset});
  for (int64_t m = 0; m < s.mesh.ndim(); ++m) {
    const Placement& p = s.placements[size_t(m)];
    if (p.is_partial() && p.reduce_op() == ReduceOp::Sum && s.mesh.coordinate()[size_t(m)] != 0) {
      local.zero_();
      break;
    }
  }
  return t;
}

DTensor empty_dtensor(const Shape& global_shape, const DeviceMesh& mesh,
                      const Placements& placements, DType dtype) {
  auto spec = std::make_shared<const DTensorSpec>(mesh, placements, global_shape, dtype);
  Tensor local = empty(spec->local_layout().local_shape, TensorOptions(dtype, mesh.device()));
  return DTensor(std::move(spec), local);
}

}  // namespace

DTensor rand(const Shape& global_shape, const DeviceMesh& mesh, const Placements& placements,
             Generator& gen, DType dtype, bool check_generator) {
  DTensor t = empty_dtensor(global_shape, mesh, placements, dtype);
  return fill_window(t, RandomKind::Uniform, 0.0, 1.0, gen, "rand", check_generator);
}

DTensor randn(const Shape& global_shape, const DeviceMesh& mesh, const Placements& placements,
              Generator& gen, DType dtype) {
  DTensor t = empty_dtensor(global_shape, mesh, placements, dtype);
  return fill_window(t, RandomKind::Normal, 0.0, 1.0, gen, "randn");
}

DTensor& uniform_(DTensor& t, double low, double high, Generator& gen) {
  return fill_window(t, RandomKind::Uniform, low, high, gen, "uniform_");
}

DTensor& normal_(DTensor& t, double mean, double std, Generator& gen) {
  return fill_window(t, RandomKind::Normal, mean, std, gen, "normal_");
}

DTensor dropout(const DTensor& x, double p, bool training, Generator& gen) {
  TESSERA_CHECK(p >= 0 && p <= 1, "dropout: probability p must be in [0, 1], got ", p, " for x ",
                x.defined() ? x.str() : std::string("undefined"));
  if (!training || p == 0) return x;
  if (p == 1) return mul(x, 0.0);
  const DTensorSpec& s = x.spec();
  TESSERA_CHECK(is_floating(s.dtype), "dropout: x must be floating point, got ", x.str());
  check_same_generator(s, gen, "dropout");
  const uint64_t base = gen.advance(uint64_t(shape_numel(s.global_shape)));
  const LocalLayout l = s.local_layout();
  Tensor keep = empty(l.local_shape, TensorOptions(s.dtype, s.mesh.device()));
  philox_fill(keep, RandomKind::Bernoulli, 1.0 - p, 0.0, gen.seed(), base,
              {s.global_shape, l.global_offset});
  // 0 or 1/(1-p) rounded to x's dtype once, as the single-process kernel scales.
  Tensor scale = kernels::binary_scalar(kernels::BinaryOp::Mul, keep, 1.0 / (1.0 - p));
  // A Partial dim's ranks drew the same window: the mask is replicated there.
  return mul(x, DTensor::from_local(scale, s.mesh, s.grad_placements(), s.global_shape));
}

DTensor& kaiming_uniform_(DTensor& t, Generator& gen, double a, FanMode mode) {
  // As PyTorch: a tensor of no elements is left alone (its fans may be 0, the bound infinite).
  if (shape_numel(t.shape()) == 0) return t;
  double bound = kaiming_uniform_bound(t.shape(), a, mode);
  return uniform_(t, -bound, bound, gen);
}

DTensor& xavier_uniform_(DTensor& t, Generator& gen, double gain) {
  // As PyTorch: a tensor of no elements is left alone (its fans may be 0, the bound infinite).
  if (shape_numel(t.shape()) == 0) return t;
  double bound = xavier_uniform_bound(t.shape(), gain);
  return uniform_(t, -bound, bound, gen);
}

}  // namespace tessera
