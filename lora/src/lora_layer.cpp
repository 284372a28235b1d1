// The adapter slots of a LoRA layer: their layout, their lifecycle (init, free, restore), the
// per-forward choice of slots and masks, and merging into the base weight.
#include "tessera/lora/lora_layer.h"

#include <algorithm>
#include <cstdio>
#include <utility>
#include <vector>

#include "adapter_math.h"
#include "beside_base.h"
#include "describe.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/ops.h"
#include "window.h"

namespace tessera {

using lora_detail::describe_parameter;
using lora_detail::window_of;

namespace {

// A zero adapter matrix (float32) laid out for a base weight.
Parameter adapter_parameter(const Shape& shape, const Parameter& base, const Placements& p) {
  return lora_detail::zero_beside(shape, DType::Float32, base, p);
}

uint64_t fnv1a(const std::string& s, uint64_t h) {
  for (unsigned char c : s)
    h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace

uint64_t lora_slot_seed(uint64_t seed, const std::string& adapter, const std::string& path) {
  uint64_t h = fnv1a(adapter, 0xcbf29ce484222325ull ^ (seed * 0x9E3779B97F4A7C15ull));
  return fnv1a(path, fnv1a("|", h));
}

namespace {

template <class T>
LoraLayer::Stacked<T> stack_adapters(std::vector<T> as, std::vector<T> bs,
                                     const std::vector<double>& scales) {
  if (as.size() == 1) return {as[0], bs[0], scales[0]};
  for (size_t k = 0; k < bs.size(); ++k)
    bs[k] = mul(bs[k], scales[k]);
  return {cat(as, 0), cat(bs, 1), 1.0};
}

}  // namespace

LoraWeight::LoraWeight(Parameter value) : Module("LoraWeight"), weight(std::move(value)) {
  register_parameter("weight", &weight);
}

LoraWeights::LoraWeights(const std::vector<std::shared_ptr<LoraWeight>>& items)
    : Module("LoraWeights"), items_(items) {
  for (size_t i = 0; i < items_.size(); ++i)
    register_module(std::to_string(i), items_[i]);
}

LoraLayer::LoraLayer(std::string kind, const Parameter& weight, bool transposed, int64_t in,
                     int64_t out, const LoraSlots& slots, std::shared_ptr<LoraRouting> routing,
                     const std::pair<std::string, std::string>& names)
    : kind_(std::move(kind)),
      weight_(&weight),
      transposed_(transposed),
      names_(names),
      in_(in),
      out_(out),
      max_rank_(slots.max_rank),
      routing_(std::move(routing)),
      dropout_gens_(size_t(std::max<int64_t>(slots.max_adapters, 0))) {
  TESSERA_CHECK(slots.max_adapters >= 1 && slots.max_rank >= 1, kind_, ": ", slots.max_adapters,
                " adapter slots of rank ", slots.max_rank, " (both must be at least 1)");
  TESSERA_CHECK(routing_ != nullptr, kind_, ": no routing state");
  Placements pa, pb;
  if (weight.is_dtensor()) std::tie(pa, pb) = adapter_placements(weight.stored_dtensor());
  for (int64_t i = 0; i < slots.max_adapters; ++i) {
    a_.push_back(std::make_shared<LoraWeight>(adapter_parameter({max_rank_, in_}, weight, pa)));
    b_.push_back(std::make_shared<LoraWeight>(adapter_parameter({out_, max_rank_}, weight, pb)));
  }
  a_list_ = std::make_shared<LoraWeights>(a_);
  b_list_ = std::make_shared<LoraWeights>(b_);
  slots_.resize(size_t(slots.max_adapters));
  dora_norms_.resize(size_t(slots.max_adapters));
}

void LoraLayer::make_magnitudes() {
  Placements pb;
  if (weight_->is_dtensor()) pb = adapter_placements(weight_->stored_dtensor()).second;
  for (int64_t i = 0; i < num_slots(); ++i)
    m_.push_back(std::make_shared<LoraWeight>(adapter_parameter({out_}, *weight_, pb)));
  m_list_ = std::make_shared<LoraWeights>(m_);
}

// See the header: W's out dim split gives (Replicate, Shard(0)), its in dim split (Shard(1),
// Replicate). A transposed W (an Embedding's table) has its out dim at 1.
std::pair<Placements, Placements> LoraLayer::adapter_placements(const DTensor& w) const {
  const int64_t out_dim = transposed_ ? 1 : 0;
  Placements pa, pb;
  for (const Placement& p : w.placements()) {
    if (p.is_replicate()) {
      pa.push_back(Replicate());
      pb.push_back(Replicate());
    } else if (p.kind() == Placement::Kind::Shard && p.dim() == out_dim) {
      pa.push_back(Replicate());
      pb.push_back(Shard(0));
    } else if (p.kind() == Placement::Kind::Shard && p.dim() == 1 - out_dim) {
      pa.push_back(Shard(1));
      pb.push_back(Replicate());
    } else {
      TESSERA_FAIL("LoRA: the base weight ", w.str(), " of a ", kind_,
                   " is laid out in a way adapters cannot follow (split on one of its two dims, "
                   "or replicated, are supported); apply LoRA before fully_shard");
    }
  }
  return {pa, pb};
}

void LoraLayer::check_slot(int64_t i, const char* op) const {
  TESSERA_CHECK(i >= 0 && i < num_slots(), kind_, ".", op, ": slot ", i, " out of range (",
                num_slots(), " slots)");
}

const LoraLayer::Slot& LoraLayer::slot(int64_t i) const {
  check_slot(i, "slot");
  return slots_[size_t(i)];
}

Parameter& LoraLayer::lora_A(int64_t i) {
  check_slot(i, "lora_A");
  return a_[size_t(i)]->weight;
}

Parameter& LoraLayer::lora_B(int64_t i) {
  check_slot(i, "lora_B");
  return b_[size_t(i)]->weight;
}

Parameter& LoraLayer::lora_magnitude_vector(int64_t i) {
  check_slot(i, "lora_magnitude_vector");
  TESSERA_CHECK(has_magnitude(), kind_, ": no DoRA magnitude slots (LoraSlots::use_dora)");
  return m_[size_t(i)]->weight;
}

std::vector<Parameter*> LoraLayer::slot_parameters(int64_t i, bool magnitude) {
  check_slot(i, "slot_parameters");
  std::vector<Parameter*> out = {&a_[size_t(i)]->weight, &b_[size_t(i)]->weight};
  if (magnitude && has_magnitude()) out.push_back(&m_[size_t(i)]->weight);
  return out;
}

bool LoraLayer::can_unmerge(int64_t i) const {
  check_slot(i, "can_unmerge");
  const Slot& s = slots_[size_t(i)];
  return !s.merged || !s.use_dora || dora_norms_[size_t(i)].defined();
}

std::vector<std::pair<std::string, std::string>> LoraLayer::describe_adapters() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (size_t i = 0; i < a_.size(); ++i) {
    out.push_back(
        describe_parameter(detail::concat(names_.first, ".", i, ".weight"), a_[i]->weight));
    out.push_back(
        describe_parameter(detail::concat(names_.second, ".", i, ".weight"), b_[i]->weight));
    if (has_magnitude())
      out.push_back(describe_parameter(detail::concat("lora_magnitude_vector.", i, ".weight"),
                                       m_[i]->weight));
  }
  return out;
}

void LoraLayer::distribute_adapters(const DeviceMesh& mesh) {
  TESSERA_CHECK(weight_->is_dtensor(), kind_, ": a parallel style left the weight plain");
  const auto [pa, pb] = adapter_placements(weight_->stored_dtensor());
  NoGradGuard no_grad;
  // The adapters hold the same values on every rank (their draws do not depend on the rank).
  auto cut = [&](Parameter& p, const Placements& placements) {
    lora_detail::cut_to_window(p, mesh, placements, kind_);
  };
  for (size_t i = 0; i < a_.size(); ++i) {
    cut(a_[i]->weight, pa);
    cut(b_[i]->weight, pb);
    if (has_magnitude()) cut(m_[i]->weight, pb);
  }
}

void LoraLayer::check_init(int64_t i, const std::string& adapter, const LoraConfig& config,
                           const std::string& path) const {
  check_slot(i, "init_slot");
  config.validate();
  // The merged values would stay in the weight, with nothing left to unmerge them.
  TESSERA_CHECK(!slots_[size_t(i)].merged, kind_, " '", path, "': slot ", i, " (adapter '",
                slots_[size_t(i)].adapter, "') is merged into the weight; unmerge it before '",
                adapter, "' takes the slot");
  TESSERA_CHECK(config.r <= max_rank_, kind_, " '", path, "': adapter '", adapter, "' has r ",
                config.r, " but the slots hold at most rank ", max_rank_,
                " (LoraSlots::max_rank, fixed when LoRA was applied)");
  TESSERA_CHECK(!config.use_dora || has_magnitude(), kind_, " '", path, "': adapter '", adapter,
                "' uses DoRA but the slots hold no magnitude vectors (LoraSlots::use_dora, fixed "
                "when LoRA was applied)");
}

void LoraLayer::set_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                         const std::string& path, bool merged) {
  Slot& s = slots_[size_t(i)];
  s.adapter = adapter;
  s.r = config.r;
  s.scale = config.scaling();
  s.dropout = config.lora_dropout;
  s.merged = merged;
  s.use_dora = config.use_dora;
  dora_norms_[size_t(i)] = Tensor();
  // A stream per slot: adding or removing another adapter leaves this one's masks as they were.
  dropout_gens_[size_t(i)].manual_seed(lora_slot_seed(config.seed, adapter + "#dropout", path));
}

void LoraLayer::clear_slot(int64_t i) {
  check_slot(i, "clear_slot");
  TESSERA_CHECK(!slots_[size_t(i)].merged, kind_, ": slot ", i, " (adapter '",
                slots_[size_t(i)].adapter, "') is merged into the weight; unmerge it first");
  a_[size_t(i)]->weight.fill_(0.0);
  b_[size_t(i)]->weight.fill_(0.0);
  if (has_magnitude()) m_[size_t(i)]->weight.fill_(0.0);
  slots_[size_t(i)] = Slot{};
  dora_norms_[size_t(i)] = Tensor();
}

void LoraLayer::restore_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                             const std::string& path, bool merged, uint64_t dropout_offset) {
  check_slot(i, "restore_slot");
  if (adapter.empty()) {
    slots_[size_t(i)] = Slot{};
    dora_norms_[size_t(i)] = Tensor();
    dropout_gens_[size_t(i)].manual_seed(0);
    return;
  }
  config.validate();
  TESSERA_CHECK(config.r <= max_rank_, kind_, " '", path, "': adapter '", adapter, "' has r ",
                config.r, " but the slots hold at most rank ", max_rank_);
  TESSERA_CHECK(!config.use_dora || has_magnitude(), kind_, " '", path, "': adapter '", adapter,
                "' uses DoRA but the slots hold no magnitude vectors");
  set_slot(i, adapter, config, path, merged);
  dropout_gens_[size_t(i)].set_offset(dropout_offset);
}

uint64_t LoraLayer::dropout_offset(int64_t i) const {
  check_slot(i, "dropout_offset");
  return dropout_gens_[size_t(i)].offset();
}

LoraLayer::Merged LoraLayer::merged_window(int64_t i, bool unmerge, const char* op) {
  check_slot(i, op);
  const Slot& s = slots_[size_t(i)];
  TESSERA_CHECK(!s.adapter.empty(), kind_, " ", op, ": slot ", i, " holds no adapter");
  TESSERA_CHECK(s.merged == unmerge, kind_, " ", op, ": adapter '", s.adapter, "' is ",
                s.merged ? "already merged" : "not merged");
  TESSERA_CHECK(can_unmerge(i), kind_, " ", op, ": DoRA adapter '", s.adapter,
                "' was merged when its checkpoint was saved, and the weight norms that undo its "
                "merge are not in it");
  NoGradGuard no_grad;
  // In float32, or W's dtype where that is wider (a float64 W rounded to float32 would lose
  // its every element, adapter or not).
  const Tensor& w = weight_->stored();
  const DType ct = promote_types(w.dtype(), DType::Float32);
  if (s.use_dora) return dora_merged_window(i, unmerge, ct);
  return {adapted_window(i, unmerge ? -1.0 : 1.0, ct).to(w.dtype()), Tensor()};
}

Tensor LoraLayer::adapted_window(int64_t i, double sign, DType ct, const Tensor& onto) const {
  NoGradGuard no_grad;
  const Slot& s = slots_[size_t(i)];
  // The adapter matrices' global values (small), then only this rank's window of B A: its rows
  // of W's out dim and columns of its in dim (a table's rows are the in dim).
  const Tensor a = a_[size_t(i)]->weight.full();
  const Tensor b = b_[size_t(i)]->weight.full();
  const LocalLayout l = window_of(*weight_);
  const size_t od = transposed_ ? 1 : 0, id = 1 - od;
  Tensor b_rows =
      kernels::narrow(kernels::narrow(b, 0, l.global_offset[od], l.local_shape[od]), 1, 0, s.r);
  Tensor a_cols =
      kernels::narrow(kernels::narrow(a, 0, 0, s.r), 1, l.global_offset[id], l.local_shape[id]);
  Tensor delta = matmul(b_rows.contiguous().to(ct), a_cols.contiguous().to(ct));
  if (transposed_) delta = transpose(delta, 0, 1).contiguous();
  delta = mul(delta, sign * s.scale);
  return add((onto.defined() ? onto : weight_->stored().detach()).to(ct), delta);
}

bool LoraLayer::merge_is_finite(int64_t i) {
  return lora_detail::all_finite(merged_window(i, /*unmerge=*/false, "merge_is_finite").window);
}

void LoraLayer::merge_slot(int64_t i, bool unmerge) {
  const Merged m = merged_window(i, unmerge, "merge_slot");
  NoGradGuard no_grad;
  Tensor w = weight_->stored().detach();
  w.copy_(m.window);
  slots_[size_t(i)].merged = !unmerge;
  dora_norms_[size_t(i)] = unmerge ? Tensor() : m.norms;
}

// The weight carries every merged slot into every sample's output: only the active adapter of a
// batch that is not mixed may be merged. LoraModel keeps to this; the check guards direct use.
void LoraLayer::check_merged(bool mixed) const {
  const int64_t active = routing_->active_slot;
  const bool has_active =
      active >= 0 && active < num_slots() && !slots_[size_t(active)].adapter.empty();
  for (int64_t i = 0; i < num_slots(); ++i) {
    const Slot& s = slots_[size_t(i)];
    if (!s.merged || (!mixed && i == active)) continue;
    TESSERA_CHECK(!mixed, "LoRA: adapter '", s.adapter,
                  "' is merged into the weight, which would apply it to every sample of the mixed "
                  "batch; unmerge it first");
    TESSERA_FAIL(
        "LoRA: adapter '", s.adapter, "' is merged into the weight but is not the active adapter (",
        has_active ? "'" + slots_[size_t(active)].adapter + "' is" : std::string("none is"),
        "), so it would apply to every sample; unmerge it first");
  }
}

Tensor LoraLayer::dropped_input(const Tensor& x, const Batch& bt, DType at) {
  if (!bt.any_dropout) return Tensor();
  // As PEFT: x in the adapters' dtype, then dropout (a bfloat16 base keeps 1/(1-p) exact under
  // float32 adapters).
  Tensor u = empty(x.shape(), TensorOptions(DType::Float32, x.device()));
  uniform_(u, 0.0, 1.0, dropout_gens_[size_t(bt.slots[0])]);
  return mul(x.dtype() == at ? x : cast(x, at),
             lora_detail::keep_scale(u, bt.dropout, slots_[size_t(bt.slots[0])].dropout).to(at));
}

LoraLayer::Batch LoraLayer::batch(int64_t rows, Device device) const {
  Batch b;
  const bool mixed = routing_->sample_slots.has_value();
  check_merged(mixed);
  const bool training = module().is_training();
  if (!mixed) {
    const int64_t s = routing_->active_slot;
    if (s >= 0 && s < num_slots() && !slots_[size_t(s)].adapter.empty() &&
        !slots_[size_t(s)].merged) {
      b.slots.push_back(s);
      b.any_dropout = slots_[size_t(s)].dropout > 0 && training;
    }
    return b;
  }
  std::vector<int64_t> v = *routing_->sample_slots;
  TESSERA_CHECK(int64_t(v.size()) == rows, "LoRA: the batch's adapter ids hold ", v.size(),
                " entries but this rank's batch has ", rows, " rows (one entry per row)");
  // LoraModel checked the ids; an adapter that does not target this layer leaves its samples
  // to the base layer here.
  for (int64_t& s : v) {
    TESSERA_CHECK(s < num_slots(), "LoRA: adapter id ", s, " out of range (", num_slots(),
                  " slots)");
    if (s >= 0 && slots_[size_t(s)].adapter.empty()) s = -1;
    if (s < 0) continue;
    TESSERA_CHECK(!slots_[size_t(s)].use_dora, "LoRA: DoRA adapter '", slots_[size_t(s)].adapter,
                  "' cannot run in a mixed batch (PEFT refuses DoRA with adapter_names too)");
    if (std::find(b.slots.begin(), b.slots.end(), s) == b.slots.end()) b.slots.push_back(s);
  }
  if (b.slots.empty()) return b;
  // The masks follow from the batch's ids and this layer's slots (ids of adapters it lacks are
  // -1 above, and its slots are in order of first use), so the key names them.
  LoraRouting::MaskKey key{device.str(), rows, max_rank_, {}};
  for (int64_t s : b.slots) {
    key.slots.emplace_back(s, slots_[size_t(s)].dropout);
    b.any_dropout |= slots_[size_t(s)].dropout > 0 && training;
  }
  auto [it, made] = routing_->masks.try_emplace(std::move(key));
  if (made) {
    // Each slot's samples, slot by slot in b.slots' order: the stacked adapters' order.
    std::vector<int64_t> order, counts(b.slots.size(), 0);
    std::vector<float> drop(size_t(rows), 0.0f);
    for (size_t j = 0; j < b.slots.size(); ++j)
      for (int64_t row = 0; row < rows; ++row)
        if (v[size_t(row)] == b.slots[j]) {
          order.push_back(row);
          ++counts[j];
          drop[size_t(row)] = float(slots_[size_t(b.slots[j])].dropout);
        }
    const int64_t used = int64_t(order.size());
    it->second.routing = {max_rank_, rows, from_vector<int64_t>(order, {used}).to(device), counts};
    it->second.dropout = from_vector<float>(drop, {rows}).to(device);
  }
  b.routing = it->second.routing;
  b.dropout = it->second.dropout;
  return b;
}

LoraLayer::Batch LoraLayer::batch_of(const DTensor& x, int64_t rows_from_ndim) const {
  const bool rows = x.dim() >= rows_from_ndim;
  // A mixed batch names each of this rank's rows: rows split over the mesh would need the ids
  // split alike, which nothing here does (no tensor-parallel plan splits the batch dim).
  if (routing_->sample_slots && rows)
    for (const Placement& p : x.placements())
      TESSERA_CHECK(!p.is_shard() || p.dim() != 0,
                    "LoRA: a mixed batch (set_batch_adapters) "
                    "needs the input's batch dim whole on the ",
                    kind_, "'s mesh, but the input is ", x.str(),
                    "; replicate the batch dim there, or clear the mixed batch");
  return batch(rows ? x.size(0) : 1, x.mesh().device());
}

LoraLayer::Stacked<Tensor> LoraLayer::stacked_local(const Batch& bt) const {
  std::vector<Tensor> as, bs;
  std::vector<double> scales;
  for (int64_t s : bt.slots) {
    as.push_back(a_[size_t(s)]->weight.whole_local(kind_, names_.first.c_str()));
    bs.push_back(b_[size_t(s)]->weight.whole_local(kind_, names_.second.c_str()));
    scales.push_back(slots_[size_t(s)].scale);
  }
  return stack_adapters(std::move(as), std::move(bs), scales);
}

LoraLayer::Stacked<DTensor> LoraLayer::stacked_on(const DeviceMesh& mesh, const Batch& bt) const {
  std::vector<DTensor> as, bs;
  std::vector<double> scales;
  for (int64_t s : bt.slots) {
    as.push_back(a_[size_t(s)]->weight.on_mesh(mesh));
    bs.push_back(b_[size_t(s)]->weight.on_mesh(mesh));
    scales.push_back(slots_[size_t(s)].scale);
  }
  return stack_adapters(std::move(as), std::move(bs), scales);
}

namespace lora_detail {

// Inverted dropout's multiplier, from the uniform draw `u`: 1/(1-p) where u >= p, else 0; p one
// value or one per row ([rows]).
Tensor keep_scale(const Tensor& u, const Tensor& p_rows, double p) {
  NoGradGuard no_grad;
  Tensor p_t = p_rows.defined()
                   ? kernels::reshape(p_rows, per_row_shape(p_rows.size(0), 1, u.dim()))
                   : full({}, p, TensorOptions(DType::Float32, u.device()));
  Tensor keep = kernels::compare(kernels::CompareOp::Ge, u, p_t).to(DType::Float32);
  return kernels::binary(kernels::BinaryOp::Div, keep,
                         kernels::rbinary_scalar(kernels::BinaryOp::Sub, 1.0, p_t));
}

DTensor reduce_with_activations(const DTensor& yp, const DTensor& hp, const DTensor& b,
                                double scale, const LowRankRouting& routing) {
  const DeviceMesh& mesh = yp.mesh();
  const DType zt = promote_types(yp.dtype(), hp.dtype());
  auto in_zt = [zt](const DTensor& t) { return t.dtype() == zt ? t : cast(t, zt); };
  const DTensor z =
      cat({in_zt(yp), in_zt(hp)}, -1).redistribute(Placements(size_t(mesh.ndim()), Replicate()));
  const int64_t out = yp.size(-1), rank = hp.size(-1);
  DTensor y = narrow(z, -1, 0, out);
  if (y.dtype() != yp.dtype()) y = cast(y, yp.dtype());
  DTensor h = narrow(z, -1, out, rank);
  if (h.dtype() != b.dtype()) h = cast(h, b.dtype());
  if (scale != 1.0) h = mul(h, scale);
  const DTensor low = routing.defined() ? lowrank_up(h, b, routing) : linear(h, b);
  return add(y, low.dtype() == y.dtype() ? low : cast(low, y.dtype()));
}

}  // namespace lora_detail

}  // namespace tessera
