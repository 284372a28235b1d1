#include "tessera/lora/lora_embedding.h"

#include <utility>
#include <vector>

#include "adapter_math.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/nn_ops.h"
#include "tessera/dtensor/ops.h"
#include "window.h"

namespace tessera {

using lora_detail::reduce_with_activations;
using lora_detail::scaled;
using lora_detail::write_window;

LoraEmbedding::LoraEmbedding(const Embedding& base, const LoraSlots& slots,
                             std::shared_ptr<LoraRouting> routing)
    : Embedding("LoraEmbedding", base),
      LoraLayer("LoraEmbedding", weight, /*transposed=*/true, num_embeddings(), embedding_dim(),
                slots, std::move(routing), {"lora_embedding_A", "lora_embedding_B"}) {
  register_module(names_.first, a_list_);
  register_module(names_.second, b_list_);
  if (!slots.use_dora) return;
  make_magnitudes();
  register_module("lora_magnitude_vector", m_list_);
}

namespace {

// Slot values whose first r rows (A) or columns (B) are `draw` and the rest zero, laid out as
// `p`'s global shape: independent of max_rank.
void write_padded(Parameter& p, const Tensor& draw, int64_t dim) {
  Tensor padded = zeros(p.global_shape());
  kernels::narrow(padded, dim, 0, draw.size(dim)).copy_(draw);
  write_window(p, padded);
}

}  // namespace

// PEFT's LoraLayer.reset_lora_parameters for embeddings: A zeros and B normal, as loralib's
// Embedding; with init_lora_weights false (LoraInit::Random) both keep a normal draw. Each
// matrix is drawn whole from (config.seed, adapter, path) and each rank keeps its window.
void LoraEmbedding::init_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                              const std::string& path) {
  check_init(i, adapter, config, path);
  Generator gen(lora_slot_seed(config.seed, adapter, path));
  const int64_t r = config.r;
  const uint64_t start = gen.offset();
  NoGradGuard no_grad;
  Parameter& a = a_[size_t(i)]->weight;
  Parameter& b = b_[size_t(i)]->weight;
  if (config.init_lora_weights == LoraInit::Random) {
    Tensor draw = empty({r, lora_in()});
    normal_(draw, 0.0, 1.0, gen);
    write_padded(a, draw, 0);
  } else {
    a.fill_(0.0);
  }
  // B's draw starts where an unpadded A's would end, drawn or not.
  gen.set_offset(start + uint64_t(r * lora_in()));
  Tensor draw = empty({lora_out(), r});
  normal_(draw, 0.0, 1.0, gen);
  write_padded(b, draw, 1);
  set_slot(i, adapter, config, path, /*merged=*/false);
  init_magnitude(i);
}

Tensor LoraEmbedding::forward(const Tensor& ids) {
  const Tensor& w = weight.whole_local(type_name(), "weight");
  const Batch bt = batch(ids.dim() >= 1 ? ids.size(0) : 1, ids.device());
  const Tensor y = embedding(ids, w);
  if (bt.slots.empty()) return y;
  const auto [a, b, scale] = stacked_local(bt);
  // A^T [num_embeddings, k max_rank] looked up as a table: each id's column of A. In a mixed
  // batch lowrank_up reads each sample's own adapter's columns alone.
  Tensor h = embedding(ids, transpose(a, 0, 1));
  if (scale != 1.0) h = mul(h, scale);
  const Tensor low = bt.routing.defined() ? lowrank_up(h, b, bt.routing) : linear(h, b);
  const Tensor z = add(y, low.dtype() == y.dtype() ? low : cast(low, y.dtype()));
  // batch() refused DoRA in a mixed batch: a DoRA forward has one adapter.
  if (!slots_[size_t(bt.slots[0])].use_dora) return z;
  const Tensor& mag =
      m_[size_t(bt.slots[0])]->weight.whole_local(type_name(), "lora_magnitude_vector");
  return scaled(z, div(mag, out_norms(w, a, b, scale).to(mag.dtype())));
}

// The adapters' update of the table, (scale B A)^T, read by the projection h W^T: scale (h B) A,
// a Linear whose A is B^T and whose B is A^T (PEFT's tied lm_head), lora_dropout on h included.
// Only a Decoder under tie_embeddings calls this, and only with ensure_weight_tying do its
// adapters reach a tied table (LoraModel checks): no flag here. A merged slot is in W already.
Tensor LoraEmbedding::output_projection(const Tensor& h) {
  const Tensor& w = weight.local();
  const Batch bt = batch(h.dim() >= 2 ? h.size(0) : 1, h.device());
  if (bt.slots.empty()) return Embedding::output_projection(h);
  TESSERA_CHECK(!slots_[size_t(bt.slots[0])].use_dora, "LoraEmbedding: DoRA adapter '",
                slots_[size_t(bt.slots[0])].adapter,
                "' on a table the Decoder also projects with (tie_embeddings)");
  const Stacked<Tensor> ab = stacked_local(bt);
  const Tensor hl = dropped_input(h, bt, ab.a.dtype());
  return linear_lowrank(h, w, Tensor(), transpose(ab.b, 0, 1), transpose(ab.a, 0, 1), ab.scale, hl,
                        bt.routing);
}

DTensor LoraEmbedding::forward_dtensor(const DTensor& ids) {
  const DeviceMesh& mesh = ids.mesh();
  const DTensor w = weight.on_mesh(mesh);
  const Batch bt = batch_of(ids, /*rows_from_ndim=*/1);
  const DTensor y = embedding(ids, w);
  if (bt.slots.empty()) return y;
  const auto [a, b, scale] = stacked_on(mesh, bt);
  // A vocabulary-split table looks A^T up as it looks up W: partial sums over the ranks.
  const DTensor hp = embedding(ids, transpose(a, 0, 1));
  bool partial = false;
  for (const Placement& p : hp.placements())
    partial |= p.is_partial();
  DTensor z;
  if (partial) {
    z = reduce_with_activations(y, hp, b, scale, bt.routing);
  } else {
    DTensor h = hp;
    if (scale != 1.0) h = mul(h, scale);
    const DTensor low = bt.routing.defined() ? lowrank_up(h, b, bt.routing) : linear(h, b);
    z = add(y, low.dtype() == y.dtype() ? low : cast(low, y.dtype()));
  }
  if (!slots_[size_t(bt.slots[0])].use_dora) return z;
  const DTensor mag = m_[size_t(bt.slots[0])]->weight.on_mesh(mesh);
  return scaled(z, div(mag, out_norms(w, a, b, scale, mag.placements())));
}

}  // namespace tessera
