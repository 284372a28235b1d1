// Sharding rules of elementwise ops, per mesh dim. Operands broadcast like numpy; an output dim
// is sharded when an operand that really has it (not broadcast) is sharded on it, and every
// operand that has the dim is then cut the same way (free when it is replicated). Sum-partials
// pass through ops that are linear in them: a + b with both partial (a replicated addend is
// turned into a partial one, kept on one rank), a * r and a / r with r replicated, neg and
// scaling. Everything else sees replicated values.
#include "dispatch.h"
#include "tessera/autograd/ops.h"
#include "tessera/dtensor/ops.h"

namespace tessera {

namespace {

using dtensor_ops::ShardingDecision;
using dtensor_ops::sum_partial;

enum class Linearity { Additive, Multiplicative, Divide, None };

// Index in the output of input dim `d` of an operand with `nd` dims, or -1 when the operand is
// broadcast along it.
int64_t out_dim_of(const DTensor& x, int64_t d, const Shape& out) {
  int64_t od = d + int64_t(out.size()) - x.dim();
  return x.size(d) == out[size_t(od)] ? od : -1;
}

// Input dim of `x` that becomes output dim `od`, or -1 when x is broadcast there.
int64_t in_dim_of(const DTensor& x, int64_t od, const Shape& out) {
  int64_t d = od - (int64_t(out.size()) - x.dim());
  if (d < 0 || x.size(d) != out[size_t(od)]) return -1;
  return d;
}

ShardingDecision pointwise_decision(const std::vector<DTensor>& in, const Shape& out,
                                    Linearity lin) {
  ShardingDecision dec;
  dec.inputs.resize(in.size());
  const int64_t nm = in[0].mesh().ndim();
  for (int64_t m = 0; m < nm; ++m) {
    // Output shard: the first operand's plain shard of a dim it really has.
    int64_t shard_od = -1;
    for (const DTensor& x : in) {
      const Placement& p = x.placements()[size_t(m)];
      if (p.kind() == Placement::Kind::Shard && shard_od < 0)
        shard_od = out_dim_of(x, p.dim(), out);
    }
    bool any_partial = false, all_partial = true;
    for (const DTensor& x : in) {
      bool sp = sum_partial(x.placements()[size_t(m)]);
      any_partial = any_partial || sp;
      all_partial = all_partial && sp;
    }
    if (shard_od >= 0) {
      for (size_t i = 0; i < in.size(); ++i) {
        int64_t d = in_dim_of(in[i], shard_od, out);
        dec.inputs[i].push_back(d >= 0 ? Shard(d) : Replicate());
      }
      dec.output.push_back(Shard(shard_od));
      continue;
    }
    // Partial handling.
    bool keep_partial = false;
    if (any_partial) {
      if (lin == Linearity::Additive) keep_partial = true;
      if (lin == Linearity::Multiplicative || lin == Linearity::Divide)
        keep_partial = sum_partial(in[0].placements()[size_t(m)]) &&
                       (in.size() == 1 || !sum_partial(in[1].placements()[size_t(m)]));
      if (lin == Linearity::Multiplicative && !keep_partial && in.size() == 2)
        keep_partial = !sum_partial(in[0].placements()[size_t(m)]);  // r * P
    }
    if (keep_partial) {
      for (size_t i = 0; i < in.size(); ++i) {
        bool sp = sum_partial(in[i].placements()[size_t(m)]);
        // Additive: a replicated addend becomes partial (kept on coordinate 0).
        dec.inputs[i].push_back(sp || lin == Linearity::Additive ? Partial() : Replicate());
      }
      dec.output.push_back(Partial());
      (void)all_partial;
      continue;
    }
    for (size_t i = 0; i < in.size(); ++i)
      dec.inputs[i].push_back(Replicate());
    dec.output.push_back(Replicate());
  }
  return dec;
}

DTensor binary(const char* op, const DTensor& a, const DTensor& b, Linearity lin,
               Tensor (*fn)(const Tensor&, const Tensor&)) {
  dtensor_ops::check_same_mesh(op, {a, b});
  Shape out = broadcast_shapes(a.shape(), b.shape(), op);
  return dtensor_ops::run(op, {a, b}, pointwise_decision({a, b}, out, lin), out,
                          [fn](const std::vector<Tensor>& l) { return fn(l[0], l[1]); });
}

DTensor ternary(const char* op, const DTensor& a, const DTensor& b, const DTensor& c,
                Tensor (*fn)(const Tensor&, const Tensor&, const Tensor&)) {
  dtensor_ops::check_same_mesh(op, {a, b, c});
  Shape out = broadcast_shapes(broadcast_shapes(a.shape(), b.shape(), op), c.shape(), op);
  return dtensor_ops::run(op, {a, b, c}, pointwise_decision({a, b, c}, out, Linearity::None), out,
                          [fn](const std::vector<Tensor>& l) { return fn(l[0], l[1], l[2]); });
}

template <class F>
DTensor unary(const char* op, const DTensor& x, Linearity lin, F fn) {
  return dtensor_ops::run(op, {x}, pointwise_decision({x}, x.shape(), lin), x.shape(),
                          [fn](const std::vector<Tensor>& l) { return fn(l[0]); });
}

}  // namespace

DTensor add(const DTensor& a, const DTensor& b) {
  return binary("add", a, b, Linearity::Additive,
                [](const Tensor& x, const Tensor& y) { return add(x, y); });
}
DTensor sub(const DTensor& a, const DTensor& b) {
  return binary("sub", a, b, Linearity::Additive,
                [](const Tensor& x, const Tensor& y) { return sub(x, y); });
}
DTensor mul(const DTensor& a, const DTensor& b) {
  return binary("mul", a, b, Linearity::Multiplicative,
                [](const Tensor& x, const Tensor& y) { return mul(x, y); });
}
DTensor div(const DTensor& a, const DTensor& b) {
  return binary("div", a, b, Linearity::Divide,
                [](const Tensor& x, const Tensor& y) { return div(x, y); });
}
DTensor maximum(const DTensor& a, const DTensor& b) {
  return binary("maximum", a, b, Linearity::None,
                [](const Tensor& x, const Tensor& y) { return maximum(x, y); });
}
DTensor minimum(const DTensor& a, const DTensor& b) {
  return binary("minimum", a, b, Linearity::None,
                [](const Tensor& x, const Tensor& y) { return minimum(x, y); });
}
DTensor where(const DTensor& cond, const DTensor& a, const DTensor& b) {
  return ternary("where", cond, a, b,
                 [](const Tensor& c, const Tensor& x, const Tensor& y) { return where(c, x, y); });
}
DTensor masked_fill(const DTensor& x, const DTensor& mask, double value) {
  dtensor_ops::check_same_mesh("masked_fill", {x, mask});
  Shape out = broadcast_shapes(x.shape(), mask.shape(), "masked_fill");
  // Not linear in x: partial pieces would each get the value, and their sum too many of it.
  return dtensor_ops::run(
      "masked_fill", {x, mask}, pointwise_decision({x, mask}, out, Linearity::None), out,
      [value](const std::vector<Tensor>& l) { return masked_fill(l[0], l[1], value); });
}
DTensor add(const DTensor& a, double s) {
  return unary("add", a, Linearity::None, [s](const Tensor& x) { return add(x, s); });
}
DTensor sub(const DTensor& a, double s) {
  return unary("sub", a, Linearity::None, [s](const Tensor& x) { return sub(x, s); });
}
DTensor div(const DTensor& a, double s) {
  return unary("div", a, Linearity::Multiplicative, [s](const Tensor& x) { return div(x, s); });
}
DTensor pow(const DTensor& a, double exponent) {
  return unary("pow", a, Linearity::None, [exponent](const Tensor& x) { return pow(x, exponent); });
}
DTensor mul(const DTensor& a, double s) {
  return unary("mul", a, Linearity::Multiplicative, [s](const Tensor& x) { return mul(x, s); });
}
DTensor neg(const DTensor& x) {
  return unary("neg", x, Linearity::Multiplicative, [](const Tensor& t) { return neg(t); });
}
// A partial sum stays one through a cast only where the cast is linear: into a floating dtype,
// or between integer dtypes (two's complement wraps alike). Truncating floats to integers, or
// anything to bool, is not (trunc(0.5) + trunc(0.5) is 0, trunc(1.0) is 1): the sum is taken
// first, as PyTorch's DTensor does since its _to_copy fix.
DTensor cast(const DTensor& x, DType dtype) {
  const bool linear = dtype != DType::Bool &&
                      (is_floating(dtype) || (!is_floating(x.dtype()) && x.dtype() != DType::Bool));
  return unary("cast", x, linear ? Linearity::Multiplicative : Linearity::None,
               [dtype](const Tensor& t) { return cast(t, dtype); });
}

#define TESSERA_DTENSOR_UNARY(name)                                                   \
  DTensor name(const DTensor& x) {                                                    \
    return unary(#name, x, Linearity::None, [](const Tensor& t) { return name(t); }); \
  }
TESSERA_DTENSOR_UNARY(exp)
TESSERA_DTENSOR_UNARY(log)
TESSERA_DTENSOR_UNARY(sqrt)
TESSERA_DTENSOR_UNARY(rsqrt)
TESSERA_DTENSOR_UNARY(tanh)
TESSERA_DTENSOR_UNARY(sigmoid)
TESSERA_DTENSOR_UNARY(relu)
TESSERA_DTENSOR_UNARY(silu)
TESSERA_DTENSOR_UNARY(square)
TESSERA_DTENSOR_UNARY(abs)
#undef TESSERA_DTENSOR_UNARY

DTensor gelu(const DTensor& x, bool approximate) {
  return unary("gelu", x, Linearity::None,
               [approximate](const Tensor& t) { return gelu(t, approximate); });
}

}  // namespace tessera
