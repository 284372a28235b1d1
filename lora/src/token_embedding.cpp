// Trainable tokens: the slots' rows of a table, their forward, merge and layout.
#include "tessera/lora/token_embedding.h"

#include <algorithm>
#include <set>

#include "beside_base.h"
#include "describe.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/nn_ops.h"
#include "tessera/dtensor/ops.h"
#include "window.h"

namespace tessera {

using lora_detail::describe_parameter;
using lora_detail::window_of;
using lora_detail::write_window;

// PEFT's ParameterDict "trainable_tokens_delta", by slot: "token_adapter.trainable_tokens_delta.0".
class TokenDeltas : public Module {
 public:
  explicit TokenDeltas(std::vector<Parameter> rows) : Module("TokenDeltas") {
    for (Parameter& v : rows)
      values.push_back(std::make_unique<Parameter>(std::move(v)));
    for (size_t i = 0; i < values.size(); ++i)
      register_parameter(std::to_string(i), values[i].get());
  }
  std::vector<std::unique_ptr<Parameter>> values;
};

class TokenAdapter : public Module {
 public:
  explicit TokenAdapter(std::shared_ptr<TokenDeltas> d) : Module("TokenAdapter"), deltas(d) {
    register_module("trainable_tokens_delta", deltas);
  }
  std::shared_ptr<TokenDeltas> deltas;
};

namespace {

// A slot's rows laid out for a table: replicated where the table splits its rows (every rank
// may look up any id), split on dim 1 where the table is, replicated where it is.
Placements delta_placements(const DTensor& table) {
  Placements out;
  for (const Placement& p : table.placements()) {
    if (p.kind() == Placement::Kind::Shard && p.dim() == 1)
      out.push_back(Shard(1));
    else if (p.is_replicate() || (p.kind() == Placement::Kind::Shard && p.dim() == 0))
      out.push_back(Replicate());
    else
      TESSERA_FAIL("trainable tokens: the table ", table.str(),
                   " is laid out in a way its rows cannot follow (split on one of its two dims, "
                   "or replicated, are supported); apply LoRA before fully_shard");
  }
  return out;
}

Parameter zero_rows(const Parameter& table, int64_t rows, int64_t dim) {
  return lora_detail::zero_beside(
      {rows, dim}, table.dtype(), table,
      table.is_dtensor() ? delta_placements(table.stored_dtensor()) : Placements{});
}

}  // namespace

TokenEmbedding::TokenEmbedding(const Embedding& base, int64_t slots, int64_t max_tokens,
                               std::shared_ptr<LoraRouting> routing)
    : Embedding("TokenEmbedding", base), max_tokens_(max_tokens), routing_(std::move(routing)) {
  TESSERA_CHECK(slots >= 1 && max_tokens >= 1, "TokenEmbedding: ", slots, " slots of ", max_tokens,
                " tokens (both must be at least 1)");
  TESSERA_CHECK(routing_ != nullptr, "TokenEmbedding: no routing state");
  std::vector<Parameter> values;
  for (int64_t i = 0; i < slots; ++i)
    values.push_back(zero_rows(weight, max_tokens, embedding_dim()));
  adapter_ = std::make_shared<TokenAdapter>(std::make_shared<TokenDeltas>(std::move(values)));
  register_module("token_adapter", adapter_);
  slots_.resize(size_t(slots));
}

void TokenEmbedding::check_slot(int64_t i, const char* op) const {
  TESSERA_CHECK(i >= 0 && i < num_slots(), "TokenEmbedding ", op, ": slot ", i, " of ",
                num_slots());
}

const std::vector<int64_t>& TokenEmbedding::token_indices(int64_t i) const {
  check_slot(i, "token_indices");
  return slots_[size_t(i)].indices;
}

bool TokenEmbedding::merged(int64_t i) const {
  check_slot(i, "merged");
  return slots_[size_t(i)].merged;
}

Parameter& TokenEmbedding::trainable_tokens_delta(int64_t i) {
  check_slot(i, "trainable_tokens_delta");
  return *adapter_->deltas->values[size_t(i)];
}

// --- layout ---

void TokenEmbedding::after_tensor_parallel(const DeviceMesh& mesh) {
  TESSERA_CHECK(weight.is_dtensor(), "TokenEmbedding: a parallel style left the table plain");
  const Placements placements = delta_placements(weight.stored_dtensor());
  NoGradGuard no_grad;
  // Every rank holds the same rows (the table's, from before it was cut).
  for (auto& p : adapter_->deltas->values)
    lora_detail::cut_to_window(*p, mesh, placements, "TokenEmbedding");
}

std::vector<std::pair<std::string, std::string>> TokenEmbedding::tensor_parallel_inputs() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (size_t i = 0; i < adapter_->deltas->values.size(); ++i)
    out.push_back(describe_parameter(detail::concat("token_adapter.trainable_tokens_delta.", i),
                                     *adapter_->deltas->values[i]));
  return out;
}

// --- slots ---

Tensor TokenEmbedding::table_rows(const std::vector<int64_t>& indices) const {
  NoGradGuard no_grad;
  const Tensor ids =
      from_vector<int64_t>(indices, {int64_t(indices.size())}).to(weight.stored().device());
  if (!weight.is_dtensor()) return embedding(ids, weight.stored()).to(Device::cpu());
  const DTensor& w = weight.stored_dtensor();
  const Placements replicated(size_t(w.mesh().ndim()), Replicate());
  const DTensor at = DTensor::from_local(ids, w.mesh(), replicated, Shape{int64_t(indices.size())});
  return embedding(at, w).full_tensor().to(Device::cpu());
}

void TokenEmbedding::write_table_rows(const std::vector<int64_t>& indices, const Tensor& rows) {
  NoGradGuard no_grad;
  const LocalLayout l = window_of(weight);
  Tensor local = weight.stored().detach();
  const Tensor src = rows.to(weight.dtype()).to(local.device());
  for (size_t j = 0; j < indices.size(); ++j) {
    const int64_t r = indices[j] - l.global_offset[0];
    if (r < 0 || r >= l.local_shape[0]) continue;
    Tensor dst = kernels::narrow(local, 0, r, 1);
    dst.copy_(kernels::narrow(kernels::narrow(src, 0, int64_t(j), 1), 1, l.global_offset[1],
                              l.local_shape[1]));
  }
}

void TokenEmbedding::init_slot(int64_t i, const std::vector<int64_t>& indices,
                               const std::string& path) {
  check_slot(i, "init_slot");
  const std::string at = "trainable tokens at '" + path + "'";
  TESSERA_CHECK(!slots_[size_t(i)].merged, at, ": slot ", i,
                " is merged into the table; unmerge it first");
  TESSERA_CHECK(!indices.empty(), at, ": no token ids");
  TESSERA_CHECK(int64_t(indices.size()) <= max_tokens_, at, ": ", indices.size(),
                " token ids, but the slots hold at most ", max_tokens_,
                " (LoraSlots::max_trainable_tokens, fixed when LoRA was applied)");
  std::set<int64_t> seen;
  for (int64_t id : indices) {
    TESSERA_CHECK(id >= 0 && id < num_embeddings(), at, ": token id ", id,
                  " is out of range for num_embeddings ", num_embeddings());
    TESSERA_CHECK(seen.insert(id).second, at, ": token id ", id, " is listed twice");
  }
  // PEFT's init: the new rows start as the table's, so the adapter starts as the identity.
  Tensor full = zeros({max_tokens_, embedding_dim()}, weight.dtype());
  kernels::narrow(full, 0, 0, int64_t(indices.size())).copy_(table_rows(indices));
  write_window(trainable_tokens_delta(i), full);
  restore_slot(i, indices, /*merged=*/false);
}

void TokenEmbedding::clear_slot(int64_t i) {
  check_slot(i, "clear_slot");
  NoGradGuard no_grad;
  trainable_tokens_delta(i).fill_(0.0);
  slots_[size_t(i)] = Slot{};
}

void TokenEmbedding::restore_slot(int64_t i, const std::vector<int64_t>& indices, bool merged) {
  check_slot(i, "restore_slot");
  Slot s;
  s.indices = indices;
  for (size_t j = 0; j < indices.size(); ++j)
    s.row_of[indices[j]] = int64_t(j);
  s.merged = merged;
  slots_[size_t(i)] = std::move(s);
}

void TokenEmbedding::merge_slot(int64_t i, bool unmerge) {
  check_slot(i, "merge_slot");
  Slot& s = slots_[size_t(i)];
  if (s.indices.empty() || s.merged != unmerge) return;
  TESSERA_CHECK(!unmerge || s.replaced.defined(), "TokenEmbedding: slot ", i,
                " was merged when its checkpoint was saved; the rows it replaced are not in a "
                "checkpoint, so it cannot be unmerged");
  if (unmerge) {
    write_table_rows(s.indices, s.replaced);
    s.replaced = Tensor();
  } else {
    s.replaced = table_rows(s.indices);
    const int64_t n = int64_t(s.indices.size());
    write_table_rows(s.indices, kernels::narrow(trainable_tokens_delta(i).full(), 0, 0, n));
  }
  s.merged = !unmerge;
}

bool TokenEmbedding::merge_is_finite(int64_t i) const {
  check_slot(i, "merge_is_finite");
  const Slot& s = slots_[size_t(i)];
  if (s.indices.empty()) return true;
  // The rows in the table's dtype, as the merge writes them.
  const Tensor rows = adapter_->deltas->values[size_t(i)]->full();
  return lora_detail::all_finite(kernels::narrow(rows, 0, 0, int64_t(s.indices.size())));
}

// --- forward ---

bool TokenEmbedding::applies(int64_t s) const {
  return s >= 0 && s < num_slots() && !slots_[size_t(s)].indices.empty() &&
         !slots_[size_t(s)].merged;
}

bool TokenEmbedding::lookup(const Tensor& ids, Lookup& out) const {
  const bool mixed = routing_->sample_slots.has_value();
  // A merged slot is in the table for every sample: only the active slot of a batch that is
  // not mixed may be. LoraModel keeps to this; the check guards direct use.
  for (int64_t i = 0; i < num_slots(); ++i)
    TESSERA_CHECK(!slots_[size_t(i)].merged || (!mixed && i == routing_->active_slot),
                  "trainable tokens: slot ", i,
                  " is merged into the table but is not the active adapter of a batch that is "
                  "not mixed, so it would apply to every sample; unmerge it first");
  const int64_t rows = ids.dim() >= 1 ? ids.size(0) : 1;
  std::vector<int64_t> slot_of_row(size_t(rows), routing_->active_slot);
  if (mixed) {
    TESSERA_CHECK(int64_t(routing_->sample_slots->size()) == rows,
                  "trainable tokens: the mixed batch routes ", routing_->sample_slots->size(),
                  " samples, but this rank's ids ", ids.str(), " hold ", rows);
    slot_of_row = *routing_->sample_slots;
  }
  // Chosen from the routing alone, not from which ids this rank holds, so that every rank takes
  // the same path.
  out.slots.clear();
  for (int64_t s : mixed ? *routing_->sample_slots : std::vector<int64_t>{routing_->active_slot})
    if (applies(s) && std::find(out.slots.begin(), out.slots.end(), s) == out.slots.end())
      out.slots.push_back(s);
  if (out.slots.empty()) return false;
  const std::vector<int64_t> host = ids.to(Device::cpu()).to(DType::Int64).to_vector<int64_t>();
  std::vector<int64_t> pos(host.size(), 0), replace(host.size(), 0);
  const size_t per_row = rows == 0 ? 0 : host.size() / size_t(rows);
  for (size_t k = 0; k < host.size(); ++k) {
    const int64_t s = slot_of_row[per_row == 0 ? 0 : k / per_row];
    if (!applies(s)) continue;
    const auto& row_of = slots_[size_t(s)].row_of;
    auto it = row_of.find(host[k]);
    if (it == row_of.end()) continue;
    const int64_t block = std::find(out.slots.begin(), out.slots.end(), s) - out.slots.begin();
    pos[k] = block * max_tokens_ + it->second;
    replace[k] = 1;
  }
  Shape mask_shape = ids.shape();
  mask_shape.push_back(1);
  out.pos = from_vector<int64_t>(pos, ids.shape()).to(ids.device());
  out.replace = from_vector<int64_t>(replace, mask_shape).to(DType::Bool).to(ids.device());
  out.replaced = std::move(replace);
  return true;
}

Tensor TokenEmbedding::forward(const Tensor& ids) {
  const Tensor y = embedding(ids, weight.whole_local(type_name(), "weight"));
  Lookup lk;
  if (!lookup(ids, lk)) return y;
  std::vector<Tensor> parts;
  for (int64_t s : lk.slots)
    parts.push_back(
        trainable_tokens_delta(s).whole_local(type_name(), "token_adapter.trainable_tokens_delta"));
  const Tensor rows = embedding(lk.pos, parts.size() == 1 ? parts[0] : cat(parts, 0));
  return where(lk.replace, rows, y);
}

DTensor TokenEmbedding::forward_dtensor(const DTensor& ids) {
  const DeviceMesh& mesh = ids.mesh();
  if (routing_->sample_slots)
    for (int64_t m = 0; m < mesh.ndim(); ++m)
      TESSERA_CHECK(!ids.placements()[size_t(m)].is_shard(0) || mesh.size(m) == 1,
                    "trainable tokens: a mixed batch routes this rank's samples, but the ids ",
                    ids.str(), " are split on their samples over mesh dim ", m);
  const DTensor y = embedding(ids, weight.on_mesh(mesh));
  Lookup lk;
  if (!lookup(ids.to_local(), lk)) return y;
  const DTensor pos = DTensor::from_local(lk.pos, mesh, ids.placements(), ids.shape());
  Shape mask_shape = ids.shape();
  mask_shape.push_back(1);
  const DTensor replace = DTensor::from_local(lk.replace, mesh, ids.placements(), mask_shape);
  std::vector<DTensor> parts;
  for (int64_t s : lk.slots)
    parts.push_back(trainable_tokens_delta(s).on_mesh(mesh));
  const DTensor rows = embedding(pos, parts.size() == 1 ? parts[0] : cat(parts, 0));
  bool partial = false;
  for (const Placement& p : y.placements())
    partial |= p.is_partial();
  if (!partial) return where(replace, rows, y);
  // y is a partial sum over the ranks that split the vocabulary. Zeroing the replaced ids' rows
  // keeps it one (a sum of zeros), and the new rows, replicated, join it on one rank of each
  // group (add makes a replicated addend partial): the output leaves in the table's one
  // reduction.
  std::vector<int64_t> kept(lk.replaced.size());
  for (size_t k = 0; k < kept.size(); ++k)
    kept[k] = 1 - lk.replaced[k];
  const Tensor kept_local =
      from_vector<int64_t>(kept, lk.replace.shape()).to(DType::Bool).to(lk.replace.device());
  const DTensor keep = DTensor::from_local(kept_local, mesh, ids.placements(), mask_shape);
  return add(mul(y, cast(keep, y.dtype())), masked_fill(rows, keep, 0.0));
}

const TokenEmbedding::Slot& TokenEmbedding::vocab_map(int64_t s, Device device) {
  Slot& slot = slots_[size_t(s)];
  if (!slot.vocab_rows.defined()) {
    std::vector<int64_t> rows(size_t(num_embeddings()), 0), replaced(rows.size(), 0);
    for (size_t j = 0; j < slot.indices.size(); ++j) {
      rows[size_t(slot.indices[j])] = int64_t(j);
      replaced[size_t(slot.indices[j])] = 1;
    }
    slot.vocab_rows = from_vector<int64_t>(rows).to(device);
    slot.vocab_replaced =
        from_vector<int64_t>(replaced, {num_embeddings(), 1}).to(DType::Bool).to(device);
  }
  return slot;
}

Tensor TokenEmbedding::output_projection(const Tensor& h) {
  const Tensor& w = weight.local();
  auto rows_of = [&](int64_t s) {
    return trainable_tokens_delta(s).whole_local(type_name(),
                                                 "token_adapter.trainable_tokens_delta");
  };
  if (!routing_->sample_slots) {
    const int64_t s = routing_->active_slot;
    if (!applies(s)) return Embedding::output_projection(h);
    const Slot& slot = vocab_map(s, w.device());
    // PEFT's W.index_copy(0, indices, delta), whose gradient reaches delta's rows.
    return linear(h, where(slot.vocab_replaced, embedding(slot.vocab_rows, rows_of(s)), w));
  }
  // A mixed batch: the plain projection, then for each adapter with rows here its ids' columns
  // of its samples (h delta^T, spread over the vocabulary and picked where they belong), so that
  // no sample reads another adapter's rows.
  const std::vector<int64_t>& per_sample = *routing_->sample_slots;
  const int64_t samples = h.dim() >= 2 ? h.size(0) : 1;
  TESSERA_CHECK(int64_t(per_sample.size()) == samples, "trainable tokens: the mixed batch routes ",
                per_sample.size(), " samples, but the output layer's input ", h.str(), " holds ",
                samples);
  Tensor out = Embedding::output_projection(h);
  std::vector<int64_t> done;
  for (int64_t s : per_sample) {
    if (!applies(s) || std::find(done.begin(), done.end(), s) != done.end()) continue;
    done.push_back(s);
    const Slot& slot = vocab_map(s, w.device());
    const int64_t n = int64_t(slot.indices.size());
    const Tensor cols = linear(h, kernels::narrow(rows_of(s), 0, 0, n));        // [..., n]
    const Tensor spread = index_select(cols, cols.dim() - 1, slot.vocab_rows);  // [..., vocab]
    // Its samples' flags [samples, 1, ..., 1] and the replaced ids [vocab]: where a sample is
    // not the adapter's, the flag itself (false) is picked, so the pick is their product.
    Shape shape(size_t(std::max<int64_t>(h.dim(), 1)), 1);
    shape.front() = samples;
    std::vector<int64_t> mine(size_t(samples), 0);
    for (int64_t r = 0; r < samples; ++r)
      mine[size_t(r)] = per_sample[size_t(r)] == s;
    const Tensor flags = from_vector<int64_t>(mine, shape).to(DType::Bool).to(w.device());
    const Tensor ids = kernels::reshape(slot.vocab_replaced, {num_embeddings()});
    const Tensor pick = kernels::where(flags, ids, flags);
    out = where(pick, spread, out);
  }
  return out;
}

}  // namespace tessera
