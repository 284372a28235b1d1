#include "tessera/lora/lora_linear.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

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
using lora_detail::window_of;
using lora_detail::write_window;

namespace {

// The adapters' placements from the base weight's (see the header).
std::pair<Placements, Placements> adapter_placements(const DTensor& w) {
  Placements pa, pb;
  for (const Placement& p : w.placements()) {
    if (p.is_replicate()) {
      pa.push_back(Replicate());
      pb.push_back(Replicate());
    } else if (p.kind() == Placement::Kind::Shard && p.dim() == 0) {
      pa.push_back(Replicate());
      pb.push_back(Shard(0));
    } else if (p.kind() == Placement::Kind::Shard && p.dim() == 1) {
      pa.push_back(Shard(1));
      pb.push_back(Replicate());
    } else {
      TESSERA_FAIL("LoRA: the base weight ", w.str(),
                   " is laid out in a way adapters cannot follow (column or row parallel, or "
                   "replicated, are supported); apply LoRA before fully_shard");
    }
  }
  return {pa, pb};
}

// A zero adapter matrix laid out for a base weight: plain, or a DTensor with `placements`.
Parameter adapter_parameter(const Shape& shape, const Parameter& base, bool a) {
  const TensorOptions opts(DType::Float32, base.stored().device());
  if (!base.is_dtensor()) return Parameter(zeros(shape, opts));
  const DTensor& w = base.stored_dtensor();
  const auto [pa, pb] = adapter_placements(w);
  const Placements& p = a ? pa : pb;
  auto spec = std::make_shared<const DTensorSpec>(w.mesh(), p, shape, DType::Float32);
  return Parameter(DTensor(spec, zeros(spec->local_layout().local_shape, opts)));
}

// DoRA's magnitude [out], laid out as B's rows: Shard(0) under a column-parallel W, replicated
// under a row-parallel or replicated one.
Parameter magnitude_parameter(int64_t out, const Parameter& base) {
  const TensorOptions opts(DType::Float32, base.stored().device());
  if (!base.is_dtensor()) return Parameter(zeros({out}, opts));
  const DTensor& w = base.stored_dtensor();
  auto spec = std::make_shared<const DTensorSpec>(w.mesh(), adapter_placements(w).second,
                                                  Shape{out}, DType::Float32);
  return Parameter(DTensor(spec, zeros(spec->local_layout().local_shape, opts)));
}

// Zeroes the rows >= r (dim 0) or columns >= r (dim 1) of this rank's piece.
void zero_from(Parameter& p, int64_t dim, int64_t r) {
  NoGradGuard no_grad;
  const LocalLayout l = window_of(p);
  const int64_t lo = l.global_offset[size_t(dim)], n = l.local_shape[size_t(dim)];
  const int64_t first = std::clamp<int64_t>(r - lo, 0, n);
  if (first < n) kernels::narrow(p.stored().detach(), dim, first, n - first).zero_();
}

uint64_t fnv1a(const std::string& s, uint64_t h) {
  for (unsigned char c : s)
    h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// The generator of one adapter of one module: its values depend on these alone.
uint64_t slot_seed(uint64_t seed, const std::string& adapter, const std::string& path) {
  uint64_t h = fnv1a(adapter, 0xcbf29ce484222325ull ^ (seed * 0x9E3779B97F4A7C15ull));
  return fnv1a(path, fnv1a("|", h));
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

// What one forward applies: the slots, and for a mixed batch the weight of each sample in each
// slot's activations; dropout per sample row.
struct LoraLinear::Batch {
  std::vector<int64_t> slots;
  Tensor h_scale;  // float [rows, 1, ..., k * max_rank] (mixed batches only)
  Tensor dropout;  // per row (mixed) or one value
  bool any_dropout = false;
};

LoraLinear::LoraLinear(const Linear& base, const LoraSlots& slots,
                       std::shared_ptr<LoraRouting> routing)
    : Linear("LoraLinear", base),
      max_rank_(slots.max_rank),
      routing_(std::move(routing)),
      dropout_gens_(size_t(std::max<int64_t>(slots.max_adapters, 0))) {
  TESSERA_CHECK(slots.max_adapters >= 1 && slots.max_rank >= 1, "LoraLinear: ", slots.max_adapters,
                " adapter slots of rank ", slots.max_rank, " (both must be at least 1)");
  TESSERA_CHECK(routing_ != nullptr, "LoraLinear: no routing state");
  for (int64_t i = 0; i < slots.max_adapters; ++i) {
    a_.push_back(
        std::make_shared<LoraWeight>(adapter_parameter({max_rank_, in_features()}, weight, true)));
    b_.push_back(std::make_shared<LoraWeight>(
        adapter_parameter({out_features(), max_rank_}, weight, false)));
  }
  a_list_ = std::make_shared<LoraWeights>(a_);
  b_list_ = std::make_shared<LoraWeights>(b_);
  register_module("lora_A", a_list_);
  register_module("lora_B", b_list_);
  if (slots.use_dora) {
    for (int64_t i = 0; i < slots.max_adapters; ++i)
      m_.push_back(std::make_shared<LoraWeight>(magnitude_parameter(out_features(), weight)));
    m_list_ = std::make_shared<LoraWeights>(m_);
    register_module("lora_magnitude_vector", m_list_);
  }
  slots_.resize(size_t(slots.max_adapters));
  dora_norms_.resize(size_t(slots.max_adapters));
}

void LoraLinear::check_slot(int64_t i, const char* op) const {
  TESSERA_CHECK(i >= 0 && i < num_slots(), "LoraLinear.", op, ": slot ", i, " out of range (",
                num_slots(), " slots)");
}

const LoraLinear::Slot& LoraLinear::slot(int64_t i) const {
  check_slot(i, "slot");
  return slots_[size_t(i)];
}

Parameter& LoraLinear::lora_A(int64_t i) {
  check_slot(i, "lora_A");
  return a_[size_t(i)]->weight;
}

Parameter& LoraLinear::lora_B(int64_t i) {
  check_slot(i, "lora_B");
  return b_[size_t(i)]->weight;
}

Parameter& LoraLinear::lora_magnitude_vector(int64_t i) {
  check_slot(i, "lora_magnitude_vector");
  TESSERA_CHECK(has_magnitude(), "LoraLinear: no DoRA magnitude slots (LoraSlots::use_dora)");
  return m_[size_t(i)]->weight;
}

bool LoraLinear::can_unmerge(int64_t i) const {
  check_slot(i, "can_unmerge");
  const Slot& s = slots_[size_t(i)];
  return !s.merged || !s.use_dora || dora_norms_[size_t(i)].defined();
}

std::vector<std::pair<std::string, std::string>> LoraLinear::tensor_parallel_inputs() const {
  // after_tensor_parallel cuts each adapter from this rank's own copy (kEveryRank), whose values
  // must be every rank's: compared here, a rank holding other values is refused before the first
  // target changes rather than in this layer's distribution, after earlier targets had. Device
  // tensors are not read back, as distribute_tensor does not.
  std::vector<std::pair<std::string, std::string>> out;
  auto describe = [&](const std::string& name, const Parameter& p) {
    const Tensor& t = p.stored();
    std::string values = "on a device";
    if (t.device().is_cpu()) {
      char hex[17];
      std::snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)values_digest(t));
      values = std::string("digest ") + hex;
    }
    out.emplace_back(
        name, detail::concat(dtype_name(t.dtype()), " ", shape_str(p.global_shape()), " ", values));
  };
  for (size_t i = 0; i < a_.size(); ++i) {
    describe(detail::concat("lora_A.", i, ".weight"), a_[i]->weight);
    describe(detail::concat("lora_B.", i, ".weight"), b_[i]->weight);
    if (has_magnitude())
      describe(detail::concat("lora_magnitude_vector.", i, ".weight"), m_[i]->weight);
  }
  return out;
}

void LoraLinear::after_tensor_parallel(const DeviceMesh& mesh) {
  TESSERA_CHECK(weight.is_dtensor(), "LoraLinear: a parallel style left the weight plain");
  const auto [pa, pb] = adapter_placements(weight.stored_dtensor());
  NoGradGuard no_grad;
  // The adapters hold the same values on every rank (their draws do not depend on the rank):
  // each cuts its window, with no data moving.
  for (size_t i = 0; i < a_.size(); ++i) {
    Parameter& a = a_[i]->weight;
    Parameter& b = b_[i]->weight;
    TESSERA_CHECK(!a.is_dtensor() && !b.is_dtensor(), "LoraLinear: adapters already distributed");
    a = Parameter(distribute_tensor(a.full(), mesh, pa, kEveryRank), a.requires_grad());
    b = Parameter(distribute_tensor(b.full(), mesh, pb, kEveryRank), b.requires_grad());
    if (!has_magnitude()) continue;
    Parameter& m = m_[i]->weight;
    m = Parameter(distribute_tensor(m.full(), mesh, pb, kEveryRank), m.requires_grad());
  }
}

void LoraLinear::init_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                           const std::string& path) {
  check_slot(i, "init_slot");
  config.validate();
  // The merged values would stay in the weight, with nothing left to unmerge them.
  TESSERA_CHECK(!slots_[size_t(i)].merged, "LoraLinear '", path, "': slot ", i, " (adapter '",
                slots_[size_t(i)].adapter, "') is merged into the weight; unmerge it before '",
                adapter, "' takes the slot");
  TESSERA_CHECK(config.r <= max_rank_, "LoraLinear '", path, "': adapter '", adapter, "' has r ",
                config.r, " but the slots hold at most rank ", max_rank_,
                " (LoraSlots::max_rank, fixed when LoRA was applied)");
  TESSERA_CHECK(!config.use_dora || has_magnitude(), "LoraLinear '", path, "': adapter '", adapter,
                "' uses DoRA but the slots hold no magnitude vectors (LoraSlots::use_dora, fixed "
                "when LoRA was applied)");
  Generator gen(slot_seed(config.seed, adapter, path));
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

void LoraLinear::set_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
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
  dropout_gens_[size_t(i)].manual_seed(slot_seed(config.seed, adapter + "#dropout", path));
}

void LoraLinear::clear_slot(int64_t i) {
  check_slot(i, "clear_slot");
  TESSERA_CHECK(!slots_[size_t(i)].merged, "LoraLinear: slot ", i, " (adapter '",
                slots_[size_t(i)].adapter, "') is merged into the weight; unmerge it first");
  a_[size_t(i)]->weight.fill_(0.0);
  b_[size_t(i)]->weight.fill_(0.0);
  if (has_magnitude()) m_[size_t(i)]->weight.fill_(0.0);
  slots_[size_t(i)] = Slot{};
  dora_norms_[size_t(i)] = Tensor();
}

void LoraLinear::restore_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                              const std::string& path, bool merged, uint64_t dropout_offset) {
  check_slot(i, "restore_slot");
  if (adapter.empty()) {
    slots_[size_t(i)] = Slot{};
    dora_norms_[size_t(i)] = Tensor();
    dropout_gens_[size_t(i)].manual_seed(0);
    return;
  }
  config.validate();
  TESSERA_CHECK(config.r <= max_rank_, "LoraLinear '", path, "': adapter '", adapter, "' has r ",
                config.r, " but the slots hold at most rank ", max_rank_);
  set_slot(i, adapter, config, path, merged);
  dropout_gens_[size_t(i)].set_offset(dropout_offset);
}

uint64_t LoraLinear::dropout_offset(int64_t i) const {
  check_slot(i, "dropout_offset");
  return dropout_gens_[size_t(i)].offset();
}

LoraLinear::Merged LoraLinear::merged_window(int64_t i, bool unmerge, const char* op) {
  check_slot(i, op);
  const Slot& s = slots_[size_t(i)];
  TESSERA_CHECK(!s.adapter.empty(), "LoraLinear ", op, ": slot ", i, " holds no adapter");
  TESSERA_CHECK(s.merged == unmerge, "LoraLinear ", op, ": adapter '", s.adapter, "' is ",
                s.merged ? "already merged" : "not merged");
  TESSERA_CHECK(can_unmerge(i), "LoraLinear ", op, ": DoRA adapter '", s.adapter,
                "' was merged when its checkpoint was saved, and the weight norms that undo its "
                "merge are not in it");
  NoGradGuard no_grad;
  // In float32, or W's dtype where that is wider (a float64 W rounded to float32 would lose
  // its every element, adapter or not).
  const Tensor& w = weight.stored();
  const DType ct = promote_types(w.dtype(), DType::Float32);
  if (s.use_dora) return dora_merged_window(i, unmerge, ct);
  return {adapted_window(i, unmerge ? -1.0 : 1.0, ct).to(w.dtype()), Tensor()};
}

Tensor LoraLinear::adapted_window(int64_t i, double sign, DType ct, const Tensor& onto) const {
  NoGradGuard no_grad;
  const Slot& s = slots_[size_t(i)];
  // The adapter matrices' global values (small), then only this rank's window of B A.
  const Tensor a = a_[size_t(i)]->weight.full();
  const Tensor b = b_[size_t(i)]->weight.full();
  const LocalLayout l = window_of(weight);
  Tensor b_rows =
      kernels::narrow(kernels::narrow(b, 0, l.global_offset[0], l.local_shape[0]), 1, 0, s.r);
  Tensor a_cols =
      kernels::narrow(kernels::narrow(a, 0, 0, s.r), 1, l.global_offset[1], l.local_shape[1]);
  Tensor delta =
      mul(matmul(b_rows.contiguous().to(ct), a_cols.contiguous().to(ct)), sign * s.scale);
  return add((onto.defined() ? onto : weight.stored().detach()).to(ct), delta);
}

bool LoraLinear::merge_is_finite(int64_t i) {
  const Tensor m = merged_window(i, /*unmerge=*/false, "merge_is_finite").window;
  // 0 * x is 0 for every finite x and NaN for an infinite or NaN one.
  const Tensor zeros_or_nan = kernels::binary_scalar(
      kernels::BinaryOp::Mul, m.to(promote_types(m.dtype(), DType::Float32)), 0.0);
  return !std::isnan(kernels::sum(zeros_or_nan).to(DType::Float64).item<double>());
}

void LoraLinear::merge_slot(int64_t i, bool unmerge) {
  const Merged m = merged_window(i, unmerge, "merge_slot");
  NoGradGuard no_grad;
  Tensor w = weight.stored().detach();
  w.copy_(m.window);
  slots_[size_t(i)].merged = !unmerge;
  dora_norms_[size_t(i)] = unmerge ? Tensor() : m.norms;
}

// The weight carries every merged slot into every sample's output: only the active adapter of a
// batch that is not mixed may be merged. LoraModel keeps to this; the check guards direct use.
void LoraLinear::check_merged(bool mixed) const {
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

LoraLinear::Batch LoraLinear::batch(int64_t rows, Device device) const {
  Batch b;
  const bool mixed = routing_->sample_slots.has_value();
  check_merged(mixed);
  if (!mixed) {
    const int64_t s = routing_->active_slot;
    if (s >= 0 && s < num_slots() && !slots_[size_t(s)].adapter.empty() &&
        !slots_[size_t(s)].merged) {
      b.slots.push_back(s);
      b.any_dropout = slots_[size_t(s)].dropout > 0 && is_training();
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
    b.any_dropout |= slots_[size_t(s)].dropout > 0 && is_training();
  }
  auto [it, made] = routing_->masks.try_emplace(std::move(key));
  if (made) {
    const int64_t k = int64_t(b.slots.size());
    std::vector<float> scale(size_t(rows * k * max_rank_), 0.0f), drop(size_t(rows), 0.0f);
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t s = v[size_t(row)];
      if (s < 0) continue;
      const int64_t j = std::find(b.slots.begin(), b.slots.end(), s) - b.slots.begin();
      for (int64_t c = 0; c < max_rank_; ++c)
        scale[size_t((row * k + j) * max_rank_ + c)] = 1.0f;
      drop[size_t(row)] = float(slots_[size_t(s)].dropout);
    }
    it->second.h_scale = from_vector<float>(scale, {rows, k * max_rank_}).to(device);
    it->second.dropout = from_vector<float>(drop, {rows}).to(device);
  }
  b.h_scale = it->second.h_scale;
  b.dropout = it->second.dropout;
  return b;
}

namespace {

// [rows, 1, ..., width]: broadcasts a per-row tensor over activations of x's rank. A 1-D x is
// one row, and its activations [width] keep its rank, as a Linear's output for it does.
Shape per_row_shape(int64_t rows, int64_t width, int64_t ndim) {
  if (ndim <= 1) return {width};
  Shape s(size_t(ndim), 1);
  s.front() = rows;
  s.back() = width;
  return s;
}

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

template <class T>
struct Stacked {
  T a, b;
  double scale;
};

// The adapters of one forward side by side: A [k max_rank, in] and B [out, k max_rank]. One
// adapter's scale applies to its activations inside the op; several carry theirs in their B.
template <class T>
Stacked<T> stack_adapters(std::vector<T> as, std::vector<T> bs, const std::vector<double>& scales) {
  if (as.size() == 1) return {as[0], bs[0], scales[0]};
  for (size_t k = 0; k < bs.size(); ++k)
    bs[k] = mul(bs[k], scales[k]);
  return {cat(as, 0), cat(bs, 1), 1.0};
}

}  // namespace

// A mixed batch's mask over the adapter activations, shaped to broadcast over x's rank
// (undefined when the batch is not mixed).
Tensor LoraLinear::activation_mask(const Batch& bt, int64_t ndim) {
  if (!bt.h_scale.defined()) return Tensor();
  return kernels::reshape(bt.h_scale, per_row_shape(bt.h_scale.size(0), bt.h_scale.size(1), ndim));
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
  std::vector<Tensor> as, bs;
  std::vector<double> scales;
  for (int64_t s : bt.slots) {
    as.push_back(a_[size_t(s)]->weight.whole_local(type_name(), "lora_A"));
    bs.push_back(b_[size_t(s)]->weight.whole_local(type_name(), "lora_B"));
    scales.push_back(slots_[size_t(s)].scale);
  }
  const Stacked<Tensor> ab = stack_adapters(std::move(as), std::move(bs), scales);
  Tensor xl;
  if (bt.any_dropout) {
    // As PEFT: x in the adapters' dtype, then dropout (a bfloat16 base keeps 1/(1-p) exact
    // under float32 adapters).
    const DType at = ab.a.dtype();
    Tensor u = empty(x.shape(), TensorOptions(DType::Float32, x.device()));
    uniform_(u, 0.0, 1.0, dropout_gens_[size_t(bt.slots[0])]);
    xl = mul(x.dtype() == at ? x : cast(x, at),
             keep_scale(u, bt.dropout, slots_[size_t(bt.slots[0])].dropout).to(at));
  }
  // batch() refused a DoRA slot in a mixed batch: a DoRA forward has one adapter.
  if (slots_[size_t(bt.slots[0])].use_dora)
    return forward_dora(x, w, b0, ab.a, ab.b, bt.slots[0], xl);
  return linear_lowrank(x, w, b0, ab.a, ab.b, ab.scale, xl, activation_mask(bt, x.dim()));
}

DTensor LoraLinear::forward_dtensor(const DTensor& x) {
  TESSERA_CHECK(x.dim() >= 1 && x.size(-1) == in_features(), "LoraLinear(", in_features(), " -> ",
                out_features(), "): input ", x.str(), " must have last dim ", in_features());
  const DeviceMesh& mesh = x.mesh();
  const DTensor w = weight.on_mesh(mesh), bd = bias.on_mesh(mesh);
  // A mixed batch names each of this rank's rows: rows split over the mesh would need the ids
  // split alike, which nothing here does (no tensor-parallel plan splits the batch dim).
  if (routing_->sample_slots && x.dim() >= 2)
    for (const Placement& p : x.placements())
      TESSERA_CHECK(!p.is_shard() || p.dim() != 0,
                    "LoRA: a mixed batch (set_batch_adapters) "
                    "needs the input's batch dim whole on the layer's mesh, but the input is ",
                    x.str(), "; replicate the batch dim there, or clear the mixed batch");
  const Batch bt = batch(x.dim() >= 2 ? x.size(0) : 1, mesh.device());
  if (bt.slots.empty()) return linear(x, w, bd);
  std::vector<DTensor> as, bs;
  std::vector<double> scales;
  for (int64_t s : bt.slots) {
    as.push_back(a_[size_t(s)]->weight.on_mesh(mesh));
    bs.push_back(b_[size_t(s)]->weight.on_mesh(mesh));
    scales.push_back(slots_[size_t(s)].scale);
  }
  const auto [a, b, scale] = stack_adapters(std::move(as), std::move(bs), scales);
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
    Tensor keep = keep_scale(u.to_local(), bt.dropout, slots_[size_t(bt.slots[0])].dropout);
    xl = mul(x.dtype() == a.dtype() ? x : cast(x, a.dtype()),
             DTensor::from_local(keep.to(a.dtype()), mesh, mask_placements, x.shape()));
  }
  if (slots_[size_t(bt.slots[0])].use_dora)
    return forward_dtensor_dora(x, w, bd, a, b, bt.slots[0], xl);
  return lowrank_dtensor(x, w, bd, a, b, scale, xl, activation_mask(bt, x.dim()));
}

DTensor LoraLinear::lowrank_dtensor(const DTensor& x, const DTensor& w, const DTensor& bd,
                                    const DTensor& a, const DTensor& b, double scale,
                                    const DTensor& xl, const Tensor& h_scale) const {
  const DeviceMesh& mesh = x.mesh();
  bool row_parallel = false;
  for (const Placement& p : w.placements())
    row_parallel |= p.kind() == Placement::Kind::Shard && p.dim() == 1;
  if (!row_parallel) return linear_lowrank(x, w, bd, a, b, scale, xl, h_scale);
  // Row parallel: the partial base product and the partial adapter activations share the
  // layer's one reduction; B then applies to replicated activations.
  const DTensor yp = linear(x, w, bd);
  const DTensor low_in = xl.defined() ? xl : x;
  const DTensor hp = linear(low_in.dtype() == a.dtype() ? low_in : cast(low_in, a.dtype()), a);
  // The reduction runs in the wider dtype: h (and A's gradient through it) stays float32 under
  // a bfloat16 base, as on one rank, at the cost of sending the base's part in float32 too.
  const DType zt = promote_types(yp.dtype(), hp.dtype());
  auto in_zt = [zt](const DTensor& t) { return t.dtype() == zt ? t : cast(t, zt); };
  const DTensor z =
      cat({in_zt(yp), in_zt(hp)}, -1).redistribute(Placements(size_t(mesh.ndim()), Replicate()));
  const int64_t out = out_features(), rank = a.size(0);
  DTensor y = narrow(z, -1, 0, out);
  if (y.dtype() != yp.dtype()) y = cast(y, yp.dtype());
  DTensor h = narrow(z, -1, out, rank);
  if (h.dtype() != b.dtype()) h = cast(h, b.dtype());
  if (h_scale.defined())
    h = mul(h, DTensor::from_local(h_scale, mesh, Placements(size_t(mesh.ndim()), Replicate()),
                                   h_scale.shape()));
  if (scale != 1.0) h = mul(h, scale);
  DTensor low = linear(h, b);
  return add(y, low.dtype() == y.dtype() ? low : cast(low, y.dtype()));
}

}  // namespace tessera
