// Grouped-query causal self-attention with rotary embeddings (LLaMA's Attention).
//
// Under tensor parallelism wq/wk/wv are column-parallel and hand back only this rank's slice of
// the heads, and wo is row-parallel. The head counts therefore come from the projections' local
// outputs, never from the config, so one forward serves every TP degree.
#include <string>
#include <tuple>
#include <vector>

#include "tessera/autograd/ops.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/nn/transformer.h"

namespace tessera {

namespace {

// LLaMA's repeat_kv on [B, Hkv, T, D] -> [B, Hkv * groups, T, D]: kv head j serves query heads
// j * groups .. j * groups + groups - 1.
Tensor repeat_kv(const Tensor& x, int64_t groups) {
  if (groups == 1) return x;
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  Tensor e = expand(unsqueeze(x, 2), {b, h, groups, t, d});
  return reshape(e, {b, h * groups, t, d});
}

}  // namespace

Attention::Attention(const DecoderConfig& cfg, Generator& gen)
    : Module("Attention"),
      n_heads_(cfg.n_heads),
      n_kv_heads_(cfg.n_kv_heads),
      head_dim_(cfg.head_dim()) {
  cfg.validate();
  wq = std::make_shared<Linear>(cfg.dim, n_heads_ * head_dim_, false, gen);
  wk = std::make_shared<Linear>(cfg.dim, n_kv_heads_ * head_dim_, false, gen);
  wv = std::make_shared<Linear>(cfg.dim, n_kv_heads_ * head_dim_, false, gen);
  wo = std::make_shared<Linear>(n_heads_ * head_dim_, cfg.dim, false, gen);
  register_module("wq", wq);
  register_module("wk", wk);
  register_module("wv", wv);
  register_module("wo", wo);
  // The tables are derived from the config, so they stay out of the state dict (not buffers).
  // Kept in float64: the rotary kernel rounds them to each input's compute dtype.
  std::tie(rope_cos_, rope_sin_) =
      kernels::rope_tables(cfg.max_seq_len, head_dim_, cfg.rope_theta, DType::Float64);
}

namespace {

// The width of `proj`'s local output at every coordinate of its mesh, from its output layout
// alone (the same on every rank); empty when it computes on plain tensors or its layout is not
// one this can tell.
std::vector<int64_t> local_widths(const Linear& proj, int64_t out) {
  const auto& io = proj.dtensor_io();
  if (!io || io->output_layouts.size() != size_t(io->mesh.ndim())) return {};
  std::vector<int64_t> widths;
  try {
    const DTensorSpec spec(io->mesh, io->output_layouts, Shape{1, 1, out}, DType::Float32);
    const Shape& mesh = io->mesh.shape();
    for (int64_t r = 0; r < io->mesh.size(); ++r) {
      std::vector<int64_t> c(mesh.size());
      for (int64_t d = int64_t(mesh.size()) - 1, rest = r; d >= 0; --d) {
        c[size_t(d)] = rest % mesh[size_t(d)];
        rest /= mesh[size_t(d)];
      }
      widths.push_back(spec.local_layout_at(c).local_shape[2]);
    }
  } catch (const Error&) {
    return {};
  }
  return widths;
}

}  // namespace

void Attention::check_head_split() const {
  // Checked for every rank's share, not only this rank's: a split that leaves some rank partial
  // heads must fail on every rank, not on some while the others go on into wo's collective.
  const std::vector<int64_t> q = local_widths(*wq, n_heads_ * head_dim_),
                             kv = local_widths(*wk, n_kv_heads_ * head_dim_);
  if (q.empty() || q.size() != kv.size()) return;
  const int64_t groups = n_heads_ / n_kv_heads_;
  for (size_t r = 0; r < q.size(); ++r)
    TESSERA_CHECK(q[r] % head_dim_ == 0 && kv[r] % head_dim_ == 0 &&
                      q[r] / head_dim_ == kv[r] / head_dim_ * groups,
                  "Attention: the tensor-parallel split gives mesh position ", r, " of ",
                  wq->dtensor_io()->mesh.str(), " q width ", q[r], " and k/v width ", kv[r],
                  ": not whole heads of head_dim ", head_dim_, " with ", groups,
                  " query heads per kv head (n_heads ", n_heads_, ", n_kv_heads ", n_kv_heads_,
                  "); the tensor-parallel degree must divide n_kv_heads");
}

Tensor Attention::forward(const Tensor& x) {
  TESSERA_CHECK(x.defined() && x.dim() == 3, "Attention: input must be [B, T, dim], got ",
                x.defined() ? shape_str(x.shape()) : std::string("undefined"));
  Tensor q = (*wq)(x), k = (*wk)(x), v = (*wv)(x);
  // The projections may run on the full sequence even when x is a sequence-parallel slice.
  TESSERA_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.shape() == v.shape() &&
                    q.size(0) == k.size(0) && q.size(1) == k.size(1),
                "Attention: projections of x ", shape_str(x.shape()), " gave q ",
                shape_str(q.shape()), ", k ", shape_str(k.shape()), ", v ", shape_str(v.shape()),
                "; expected [B, T, heads * ", head_dim_, "] with k and v alike");
  const int64_t b = q.size(0), t = q.size(1);
  check_head_split();
  TESSERA_CHECK(q.size(2) % head_dim_ == 0 && k.size(2) % head_dim_ == 0,
                "Attention: local projection widths q ", q.size(2), " and k/v ", k.size(2),
                " are not whole heads of head_dim ", head_dim_,
                " (a tensor-parallel degree must split the heads, not a head)");
  const int64_t hq = q.size(2) / head_dim_, hkv = k.size(2) / head_dim_;
  const int64_t groups = n_heads_ / n_kv_heads_;
  // Each rank must hold the query heads its kv heads serve; then the ranks' slices line up.
  TESSERA_CHECK(hq == hkv * groups, "Attention: this rank holds ", hq, " query heads and ", hkv,
                " kv heads, but each kv head serves ", groups, " query heads (n_heads ", n_heads_,
                ", n_kv_heads ", n_kv_heads_,
                "); the tensor-parallel degree must divide n_kv_heads");
  TESSERA_CHECK(t <= rope_cos_.size(0), "Attention: sequence length ", t, " exceeds max_seq_len ",
                rope_cos_.size(0));

  // The tables follow the activations to their device once (they are not buffers: PyTorch's
  // rotary tables are non-persistent, and a state dict never holds them).
  if (rope_cos_.device() != x.device()) {
    rope_cos_ = rope_cos_.to(x.device());
    rope_sin_ = rope_sin_.to(x.device());
  }
  q = rope(reshape(q, {b, t, hq, head_dim_}), rope_cos_, rope_sin_);
  k = rope(reshape(k, {b, t, hkv, head_dim_}), rope_cos_, rope_sin_);
  v = reshape(v, {b, t, hkv, head_dim_});
  q = transpose(q, 1, 2);
  k = repeat_kv(transpose(k, 1, 2), groups);
  v = repeat_kv(transpose(v, 1, 2), groups);
  Tensor o = scaled_dot_product_attention(q, k, v, /*causal=*/true);
  o = reshape(transpose(o, 1, 2), {b, t, hq * head_dim_});
  return (*wo)(o);
}

}  // namespace tessera
