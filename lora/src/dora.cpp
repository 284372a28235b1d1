// DoRA (PEFT's use_dora): the magnitude vector's initial values, merge/unmerge and the norms the
// forward divides by (LoraLayer), and LoraLinear's forward. Every norm is the norm of one output
// feature of the whole W + scale B A (a row of a Linear's weight, a column of an Embedding's
// table), also where a rank holds only part of it (row parallel, a vocabulary-parallel table, or
// FSDP): those ranks sum their squares before the square root, by DTensor's Partial ->
// Replicate.
#include <cmath>

#include "adapter_math.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/ops.h"
#include "tessera/lora/lora_linear.h"
#include "window.h"

namespace tessera {

using lora_detail::scaled;
using lora_detail::window_of;

namespace {

// The placements of per-feature values [out] summed over a window of W laid out as `wp`, whose
// out dim is `out_dim` (0 for a Linear's weight, 1 for a table): split as W's out dim is, and a
// Partial sum where W's in dim is split.
Placements out_sum_placements(const Placements& wp, int64_t out_dim) {
  Placements out;
  for (const Placement& p : wp) {
    if (p.is_shard() && p.dim() == out_dim && (out_dim == 0 || !p.is_strided_shard()))
      out.push_back(out_dim == 0 ? p : Placement(Shard(0)));  // or FSDP x TP's StridedShard(0, f)
    else if (p.is_shard() && p.dim() == 1 - out_dim)
      out.push_back(Partial());
    else if (p.is_replicate())
      out.push_back(Replicate());
    else
      TESSERA_FAIL("LoRA DoRA: the base weight's placements ", placements_str(wp),
                   " leave no norm to compute (split on one of its two dims, FSDP, or "
                   "replicated)");
  }
  return out;
}

// Each output feature's sum of squares of `v` (W's layout, out dim `out_dim`), detached.
Tensor out_squares(const Tensor& v, int64_t out_dim) {
  NoGradGuard no_grad;
  return sum(mul(v, v), {1 - out_dim});
}

}  // namespace

Tensor LoraLayer::global_out_norms(const Tensor& window) const {
  NoGradGuard no_grad;
  const int64_t od = transposed_ ? 1 : 0;
  const Tensor squares = out_squares(window, od);
  if (!weight_->is_dtensor()) return sqrt(squares);
  const DTensor& w = weight_->stored_dtensor();
  const DTensor d =
      DTensor::from_local(squares, w.mesh(), out_sum_placements(w.placements(), od), Shape{out_});
  return sqrt(d.full_tensor());
}

// PEFT's DoraLinearLayer.update_layer (DoraEmbeddingLayer's too): m = ||W + scale B A|| per
// output feature, from the adapter's initial A and B. Computed from the global norms, so that m
// is the same under any mesh.
void LoraLayer::init_magnitude(int64_t i) {
  if (!has_magnitude()) return;
  NoGradGuard no_grad;
  Parameter& m = m_[size_t(i)]->weight;
  if (!slots_[size_t(i)].use_dora) {
    m.fill_(0.0);
    return;
  }
  const DType ct = promote_types(weight_->dtype(), DType::Float32);
  const Tensor norms = global_out_norms(adapted_window(i, 1.0, ct));
  m.copy_from_full(norms.to(DType::Float32));
}

// PEFT's DoRA merge: W' = (m / ||W + scale B A||) (W + scale B A) per output feature, the norms
// kept for unmerge, W = W' / (m / norms) - scale B A (the norms of W' + ... would be other
// values).
LoraLayer::Merged LoraLayer::dora_merged_window(int64_t i, bool unmerge, DType ct) {
  NoGradGuard no_grad;
  const LocalLayout l = window_of(*weight_);
  const size_t od = transposed_ ? 1 : 0;
  const int64_t first = l.global_offset[od], n = l.local_shape[od];
  const Tensor m = kernels::narrow(m_[size_t(i)]->weight.full(), 0, first, n).to(ct);
  // The factor per output feature, shaped to scale W's rows (a Linear) or columns (a table).
  auto factor_of = [&](const Tensor& norms) {
    return kernels::reshape(div(m, norms), transposed_ ? Shape{1, n} : Shape{n, 1});
  };
  const Tensor& w = weight_->stored();
  if (!unmerge) {
    const Tensor v = adapted_window(i, 1.0, ct);
    const Tensor norms = kernels::narrow(global_out_norms(v), 0, first, n).contiguous();
    return {mul(v, factor_of(norms)).to(w.dtype()), norms};
  }
  const Tensor factor = factor_of(dora_norms_[size_t(i)]);
  return {adapted_window(i, -1.0, ct, div(w.detach().to(ct), factor)).to(w.dtype()), Tensor()};
}

Tensor LoraLayer::adapted_local(const Tensor& w, const Tensor& a, const Tensor& b,
                                double scale) const {
  NoGradGuard no_grad;
  const DType ct = promote_types(w.dtype(), DType::Float32);
  Tensor ba = matmul(b.detach().to(ct), a.detach().to(ct));
  if (transposed_) ba = transpose(ba, 0, 1);
  return add(w.detach().to(ct), mul(ba, scale));
}

Tensor LoraLayer::out_norms(const Tensor& w, const Tensor& a, const Tensor& b, double scale) const {
  NoGradGuard no_grad;
  return sqrt(out_squares(adapted_local(w, a, b, scale), transposed_ ? 1 : 0));
}

DTensor LoraLayer::out_norms(const DTensor& w, const DTensor& a, const DTensor& b, double scale,
                             const Placements& placements) const {
  NoGradGuard no_grad;
  // This rank's window of W + scale B A: its pieces of B and A make exactly W's window.
  const Tensor v = adapted_local(w.to_local(), a.to_local(), b.to_local(), scale);
  const int64_t od = transposed_ ? 1 : 0;
  const Shape out{out_};
  const DTensor squares =
      DTensor::from_local(out_squares(v, od), w.mesh(), out_sum_placements(w.placements(), od), out)
          .redistribute(placements);
  return DTensor::from_local(sqrt(squares.to_local()).to(DType::Float32), w.mesh(), placements,
                             out);
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
  const Tensor norms = out_norms(w, a, b, scale);
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

// As forward_dora, on the layer's mesh. The norms: each rank's output features of its window of
// W + scale B A, their squares summed over the ranks that split the in dim (row parallel: one
// all-reduce of [out]), laid out as m. With dropout, (x - dropout(x)) W^T and the layer's
// product of dropout(x) run as one product of the two batches stacked on dim 0, the adapters
// routed to the second batch's samples alone, so that they share the layer's one collective (row
// parallel: the forward's reduction; column parallel: the backward's all-reduce of the input's
// gradient) rather than each making its own.
DTensor LoraLinear::forward_dtensor_dora(const DTensor& x, const DTensor& w, const DTensor& bd,
                                         const DTensor& a, const DTensor& b, int64_t slot,
                                         const DTensor& xl) {
  const double scale = slots_[size_t(slot)].scale;
  const DTensor mag = m_[size_t(slot)]->weight.on_mesh(x.mesh());
  const DTensor g = div(mag, out_norms(w, a, b, scale, mag.placements()));
  if (!xl.defined()) {
    const DTensor y = scaled(lowrank_dtensor(x, w, DTensor(), a, b, scale, DTensor(), {}), g);
    return bd.defined() ? add(y, bd) : y;
  }
  const DTensor xw = xl.dtype() == w.dtype() ? xl : cast(xl, w.dtype());
  const DTensor rest_in = x.dtype() == xw.dtype() ? sub(x, xw) : sub(cast(x, xw.dtype()), xw);
  bool batch_whole = x.dim() >= 2;
  for (const Placement& p : x.placements())
    batch_whole &= !(p.is_shard() && p.dim() == 0);
  if (!batch_whole) {  // no batch dim to stack on (a 1-D input), or one split over the mesh
    const DTensor z = lowrank_dtensor(xw, w, DTensor(), a, b, scale, xl, {});
    DTensor rest = linear(rest_in, w, bd);
    if (rest.placements() != z.placements()) rest = rest.redistribute(z.placements());
    return add(rest, scaled(z, g));
  }
  const int64_t n = x.size(0);
  const Device device = x.mesh().device();
  Tensor& rows = routing_->second_halves[{device.str(), n}];
  if (!rows.defined())
    rows = arange(double(n), double(2 * n), 1.0, TensorOptions(DType::Int64, device));
  const LowRankRouting second{a.size(0), 2 * n, rows, {n}};
  const DTensor both =
      lowrank_dtensor(cat({rest_in, xw}, 0), w, DTensor(), a, b, scale, cat({xl, xl}, 0), second);
  DTensor rest = narrow(both, 0, 0, n);
  if (bd.defined()) rest = add(rest, bd);
  return add(rest, scaled(narrow(both, 0, n, n), g));
}

}  // namespace tessera
