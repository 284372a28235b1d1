#include "tessera/lora/lora_linear.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

#include "adapter_math.h"
#include "orthogonal_init.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/digest.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/ops.h"
#include "tessera/dtensor/random.h"
#include "window.h"

namespace tessera {

using lora_detail::orthogonal_init;
using lora_detail::per_row_shape;
using lora_detail::reduce_with_activations;
using lora_detail::window_of;
using lora_detail::write_window;

namespace {

// Zeroes the rows >= r (dim 0) or columns >= r (dim 1) of this rank's piece.
void zero_from(Parameter& p, int64_t dim, int64_t r) {
  NoGradGuard no_grad;
  const LocalLayout l = window_of(p);
  const int64_t lo = l.global_offset[size_t(dim)], n = l.local_shape[size_t(dim)];
  const int64_t first = std::clamp<int64_t>(r - lo, 0, n);
  if (first < n) kernels::narrow(p.stored().detach(), dim, first, n - first).zero_();
}

}  // namespace

LoraLinear::LoraLinear(const Linear& base, const LoraSlots& slots,
                       std::shared_ptr<LoraRouting> routing)
    : Linear("LoraLinear", base),
      LoraLayer("LoraLinear", weight, /*transposed=*/false, in_features(), out_features(), slots,
                std::move(routing), {"lora_A", "lora_B"}) {
  register_module(names_.first, a_list_);
  register_module(names_.second, b_list_);
  if (!slots.use_dora) return;
  make_magnitudes();
  register_module("lora_magnitude_vector", m_list_);
}

void LoraLinear::init_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                           const std::string& path) {
  check_init(i, adapter, config, path);
  Generator gen(lora_slot_seed(config.seed, adapter, path));
  Parameter& a = a_[size_t(i)]->weight;
  Parameter& b = b_[size_t(i)]->weight;
  if (config.init_lora_weights == LoraInit::Orthogonal) {
    // Drawn whole on every rank, each keeping its window: the values do not depend on the mesh.
    const auto [a_full, b_full] = orthogonal_init(config.r, in_features(), out_features(), gen);
    Tensor a_padded = zeros({max_rank_, in_features()});
    Tensor b_padded = zeros({out_features(), max_rank_});
    kernels::narrow(a_padded, 0, 0, config.r).copy_(a_full);
    kernels::narrow(b_padded, 1, 0, config.r).copy_(b_full);
    write_window(a, a_padded);
    write_window(b, b_padded);
    set_slot(i, adapter, config, path, /*merged=*/false);
    init_magnitude(i);
    return;
  }
  // Padding lies after the first r rows of A, so the first r rows of the draw are those of an
  // unpadded [r, in] draw.
  const uint64_t start = gen.offset();
  if (config.init_lora_weights == LoraInit::Gaussian)
    a.normal_(0.0, 1.0 / double(config.r), gen);
  else
    a.kaiming_uniform_(gen, std::sqrt(5.0));
  zero_from(a, 0, config.r);
  // B's draw (Random) starts where an unpadded A's would end: independent of max_rank.
  gen.set_offset(start + uint64_t(config.r * in_features()));
  NoGradGuard no_grad;
  b.fill_(0.0);
  if (config.init_lora_weights == LoraInit::Random) {
    // As nn.Linear(r, out) draws its weight: kaiming with the fan-in r, whatever the padding.
    Tensor full = empty({out_features(), config.r});
    kaiming_uniform_(full, gen, std::sqrt(5.0));
    const LocalLayout l = window_of(b);
    Tensor rows = kernels::narrow(full, 0, l.global_offset[0], l.local_shape[0]);
    kernels::narrow(b.stored().detach(), 1, 0, config.r).copy_(rows);
  }
  set_slot(i, adapter, config, path, /*merged=*/false);
  init_magnitude(i);
}

Tensor LoraLinear::forward(const Tensor& x) {
  TESSERA_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == in_features(), "LoraLinear(",
                in_features(), " -> ", out_features(), "): input ",
                x.defined() ? x.str() : std::string("undefined"), " must have last dim ",
                in_features());
  const Tensor& w = weight.whole_local(type_name(), "weight");
  const Tensor& b0 = bias.whole_local(type_name(), "bias");
  const Batch bt = batch(x.dim() >= 2 ? x.size(0) : 1, x.device());
  if (bt.slots.empty()) return linear(x, w, b0);
  const Stacked<Tensor> ab = stacked_local(bt);
  const Tensor xl = dropped_input(x, bt, ab.a.dtype());
  // batch() refused a DoRA slot in a mixed batch: a DoRA forward has one adapter.
  if (slots_[size_t(bt.slots[0])].use_dora)
    return forward_dora(x, w, b0, ab.a, ab.b, bt.slots[0], xl);
  return linear_lowrank(x, w, b0, ab.a, ab.b, ab.scale, xl, bt.routing);
}

DTensor LoraLinear::forward_dtensor(const DTensor& x) {
  TESSERA_CHECK(x.dim() >= 1 && x.size(-1) == in_features(), "LoraLinear(", in_features(), " -> ",
                out_features(), "): input ", x.str(), " must have last dim ", in_features());
  const DeviceMesh& mesh = x.mesh();
  const DTensor w = weight.on_mesh(mesh), bd = bias.on_mesh(mesh);
  const Batch bt = batch_of(x, /*rows_from_ndim=*/2);
  if (bt.slots.empty()) return linear(x, w, bd);
  const auto [a, b, scale] = stacked_on(mesh, bt);
  DTensor xl;
  if (bt.any_dropout) {
    // The same mask a single process would draw: the draw follows x's layout, replicated over
    // Partial dims, whose ranks must mask their terms of one sum alike. (x in the adapters'
    // dtype first, as in forward.) The slot's stream needs no cross-rank check: every rank seeded
    // it alike (add_adapter, or an adapter table the ranks agreed on) and advances it by the
    // same global numel in the same forwards.
    const Placements mask_placements = x.spec().grad_placements();  // Partial -> Replicate
    DTensor u = rand(x.shape(), mesh, mask_placements, dropout_gens_[size_t(bt.slots[0])],
                     DType::Float32, /*check_generator=*/false);
    Tensor keep =
        lora_detail::keep_scale(u.to_local(), bt.dropout, slots_[size_t(bt.slots[0])].dropout);
    xl = mul(x.dtype() == a.dtype() ? x : cast(x, a.dtype()),
             DTensor::from_local(keep.to(a.dtype()), mesh, mask_placements, x.shape()));
  }
  if (slots_[size_t(bt.slots[0])].use_dora)
    return forward_dtensor_dora(x, w, bd, a, b, bt.slots[0], xl);
  return lowrank_dtensor(x, w, bd, a, b, scale, xl, bt.routing);
}

DTensor LoraLinear::lowrank_dtensor(const DTensor& x, const DTensor& w, const DTensor& bd,
                                    const DTensor& a, const DTensor& b, double scale,
                                    const DTensor& xl, const LowRankRouting& routing) const {
  bool row_parallel = false;
  for (const Placement& p : w.placements())
    row_parallel |= p.kind() == Placement::Kind::Shard && p.dim() == 1;
  if (!row_parallel) return linear_lowrank(x, w, bd, a, b, scale, xl, routing);
  // Row parallel: the partial base product and the partial adapter activations share the
  // layer's one reduction; B then applies to replicated activations.
  const DTensor yp = linear(x, w, bd);
  const DTensor low_in = xl.defined() ? xl : x;
  const DTensor xa = low_in.dtype() == a.dtype() ? low_in : cast(low_in, a.dtype());
  const DTensor hp = routing.defined() ? lowrank_down(xa, a, routing) : linear(xa, a);
  return reduce_with_activations(yp, hp, b, scale, routing);
}

}  // namespace tessera
