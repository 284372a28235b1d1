// DoRA (PEFT's use_dora) in LoraLinear: the magnitude vector's initial values, the forward, and
// merge/unmerge. Every norm is a row norm of the whole W + scale B A, also where a rank holds
// only some of a row's columns (row parallel, or FSDP): those ranks sum their rows' squares
// before the square root, by DTensor's Partial -> Replicate.
#include <cmath>

#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/ops.h"
#include "tessera/lora/lora_linear.h"
#include "window.h"

namespace tessera {

using lora_detail::window_of;

namespace {

// The placements of per-row values [out] summed over a window of W laid out as `wp`: the rows
// split as W's are, and a Partial sum where W's columns are split.
Placements row_sum_placements(const Placements& wp) {
  Placements out;
  for (const Placement& p : wp) {
    if (p.is_shard() && p.dim() == 0)
      out.push_back(p);  // Shard(0), or FSDP x TP's StridedShard(0, f)
    else if (p.is_shard() && p.dim() == 1)
      out.push_back(Partial());
    else if (p.is_replicate())
      out.push_back(Replicate());
    else
      TESSERA_FAIL("LoRA DoRA: the base weight's placements ", placements_str(wp),
                   " leave no row norm to compute (column or row parallel, FSDP, or replicated)");
  }
  return out;
}

// Each row's sum of squares of `v` [rows, cols], detached.
Tensor row_squares(const Tensor& v) {
  NoGradGuard no_grad;
  return sum(mul(v, v), {1});
}

// g z in g's dtype (the adapters' float32), rounded once to z's (a bfloat16 base's): g is not
// rounded to bfloat16, nor is the gradient m gets through it.
template <class T>
T scaled(const T& z, const T& g) {
  if (z.dtype() == g.dtype()) return mul(z, g);
  return cast(mul(cast(z, g.dtype()), g), z.dtype());
}

}  // namespace

Tensor LoraLinear::global_row_norms(const Tensor& window) const {
  NoGradGuard no_grad;
  const Tensor squares = row_squares(window);
  if (!weight.is_dtensor()) return sqrt(squares);
  const DTensor& w = weight.stored_dtensor();
  const DTensor d = DTensor::from_local(squares, w.mesh(), row_sum_placements(w.placements()),
                                        Shape{out_features()});
  return sqrt(d.full_tensor());
}

// PEFT's DoraLinearLayer.update_layer: m = ||W + scale B A|| per output row, from the adapter's
// initial A and B. Computed from the global norms, so that m is the same under any mesh.
void LoraLinear::init_magnitude(int64_t i) {
  if (!has_magnitude()) return;
  NoGradGuard no_grad;
  Parameter& m = m_[size_t(i)]->weight;
  if (!slots_[size_t(i)].use_dora) {
    m.fill_(0.0);
    return;
  }
  const DType ct = promote_types(weight.dtype(), DType::Float32);
  const Tensor norms = global_row_norms(adapted_window(i, 1.0, ct));
  m.copy_from_full(norms.to(DType::Float32));
}

// PEFT's DoraLinearVariant.merge: W' = (m / ||W + scale B A||) (W + scale B A), the norms kept
// for unmerge, W = W' / (m / norms) - scale B A (the norms of W' + ... would be other values).
LoraLinear::Merged LoraLinear::dora_merged_window(int64_t i, bool unmerge, DType ct) {
  NoGradGuard no_grad;
  const LocalLayout l = window_of(weight);
  const int64_t row0 = l.global_offset[0], rows = l.local_shape[0];
  const Tensor m = kernels::narrow(m_[size_t(i)]->weight.full(), 0, row0, rows).to(ct);
  const Tensor& w = weight.stored();
  if (!unmerge) {
    const Tensor v = adapted_window(i, 1.0, ct);
    const Tensor norms = kernels::narrow(global_row_norms(v), 0, row0, rows).contiguous();
    const Tensor factor = kernels::reshape(div(m, norms), {rows, 1});
    return {mul(v, factor).to(w.dtype()), norms};
  }
  const Tensor factor = kernels::reshape(div(m, dora_norms_[size_t(i)]), {rows, 1});
  return {adapted_window(i, -1.0, ct, div(w.detach().to(ct), factor)).to(w.dtype()), Tensor()};
}

// PEFT's DoraLinearLayer.forward on top of the base layer's output:
//   y = base(x) + (g - 1) (x W^T) + g scale (x A^T) B^T,  g = m / ||W + scale B A|| (detached),
// which is g (x W^T + scale (x A^T) B^T) + bias. With dropout in training PEFT feeds dropout(x)
// to both extra terms, so y = base(x) + g L(dropout(x)) - dropout(x) W^T, with L the layer's
// product without bias, computed as (x - dropout(x)) W^T + bias + g L(dropout(x)): one more
// product of W, not two.
Tensor LoraLinear::forward_dora(const Tensor& x, const Tensor& w, const Tensor& b0, const Tensor& a,
                                const Tensor& b, int64_t slot, const Tensor& xl) {
  const double scale = slots_[size_t(slot)].scale;
  Tensor norms;
  {
    NoGradGuard no_grad;
    const DType ct = promote_types(w.dtype(), DType::Float32);
    const Tensor v =
        add(w.detach().to(ct), mul(matmul(b.detach().to(ct), a.detach().to(ct)), scale));
    norms = sqrt(row_squares(v));
  }
  const Tensor& mag = m_[size_t(slot)]->weight.whole_local(type_name(), "lora_magnitude_vector");
  const Tensor g = div(mag, norms.to(mag.dtype()));
  if (!xl.defined()) {
    const Tensor y = scaled(linear_lowrank(x, w, Tensor(), a, b, scale), g);
    return b0.defined() ? add(y, b0) : y;
  }
  const Tensor xw = xl.dtype() == w.dtype() ? xl : cast(xl, w.dtype());
  const Tensor z = linear_lowrank(xw, w, Tensor(), a, b, scale, xl);
  const Tensor rest =
      linear(x.dtype() == xw.dtype() ? sub(x, xw) : sub(cast(x, xw.dtype()), xw), w, b0);
  return add(rest, scaled(z, g));
}

// As forward_dora, on the layer's mesh. The norms: each rank's rows of its window of
// W + scale B A (its pieces of B and A make exactly that window), their squares summed over the
// ranks that split the columns (row parallel: one all-reduce of [out]), laid out as m. With
// dropout, (x - dropout(x)) W^T is a product of its own: a row-parallel forward reduces it (one
// reduction of the output more than without dropout), a column-parallel backward all-reduces
// the gradient of its input (one more).
DTensor LoraLinear::forward_dtensor_dora(const DTensor& x, const DTensor& w, const DTensor& bd,
                                         const DTensor& a, const DTensor& b, int64_t slot,
                                         const DTensor& xl) {
  const DeviceMesh& mesh = x.mesh();
  const double scale = slots_[size_t(slot)].scale;
  const DTensor mag = m_[size_t(slot)]->weight.on_mesh(mesh);
  DTensor norms;
  {
    NoGradGuard no_grad;
    const DType ct = promote_types(w.dtype(), DType::Float32);
    const Tensor v =
        add(w.to_local().detach().to(ct),
            mul(matmul(b.to_local().detach().to(ct), a.to_local().detach().to(ct)), scale));
    const Shape out{out_features()};
    const DTensor squares =
        DTensor::from_local(row_squares(v), mesh, row_sum_placements(w.placements()), out)
            .redistribute(mag.placements());
    norms =
        DTensor::from_local(sqrt(squares.to_local()).to(mag.dtype()), mesh, mag.placements(), out);
  }
  const DTensor g = div(mag, norms);
  if (!xl.defined()) {
    const DTensor y = scaled(lowrank_dtensor(x, w, DTensor(), a, b, scale, DTensor(), Tensor()), g);
    return bd.defined() ? add(y, bd) : y;
  }
  const DTensor xw = xl.dtype() == w.dtype() ? xl : cast(xl, w.dtype());
  const DTensor z = lowrank_dtensor(xw, w, DTensor(), a, b, scale, xl, Tensor());
  DTensor rest = linear(x.dtype() == xw.dtype() ? sub(x, xw) : sub(cast(x, xw.dtype()), xw), w, bd);
  if (rest.placements() != z.placements()) rest = rest.redistribute(z.placements());
  return add(rest, scaled(z, g));
}

}  // namespace tessera
