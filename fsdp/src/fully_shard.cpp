#include "tessera/fsdp/fully_shard.h"

#include "schedule.h"

#include <algorithm>
#include <map>

#include "tessera/autograd/grad_mode.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/layout.h"

namespace tessera {

namespace {

// Which state owns each module and parameter. Weak, so a destroyed model frees its entries
// (its hooks own the states).
std::map<const Module*, std::weak_ptr<FSDPState>>& module_registry() {
  static std::map<const Module*, std::weak_ptr<FSDPState>> r;
  return r;
}
std::map<const Parameter*, std::weak_ptr<FSDPState>>& param_registry() {
  static std::map<const Parameter*, std::weak_ptr<FSDPState>> r;
  return r;
}

bool claimed(const Parameter* p) {
  auto it = param_registry().find(p);
  return it != param_registry().end() && !it->second.expired();
}

// A duplicate of `pg` for one kind of FSDP collective, shared by every group on `pg` while any
// holds it. Creating one is collective over `pg`; every rank shards the same modules in the same
// order, so every rank finds or creates the same duplicates.
ProcessGroupPtr dedicated_group(const ProcessGroupPtr& pg, const std::string& role) {
  struct Entry {
    std::weak_ptr<ProcessGroup> source, dup;
    std::string role;
  };
  static std::vector<Entry> cache;
  std::erase_if(cache, [](const Entry& e) { return e.source.expired() || e.dup.expired(); });
  for (const Entry& e : cache)
    if (e.role == role && e.source.lock() == pg) return e.dup.lock();
  ProcessGroupPtr dup = pg->split(0, pg->rank(), pg->name() + "." + role);
  cache.push_back({pg, dup, role});
  return dup;
}

// FSDP x TP: the mesh whose leading dims are the FSDP mesh (dp, or replicate and shard for
// HSDP) and whose last dim is `tp`, checked against both.
DeviceMesh combined_mesh(const DeviceMesh& dp, const DeviceMesh& tp, const std::string& what) {
  TESSERA_CHECK(tp.ndim() == 1, "fully_shard: ", what, " is a DTensor on ", tp.str(),
                "; FSDP x TP needs a 1-D TP mesh");
  TESSERA_CHECK(dp.size() * tp.size() == world_size(), "fully_shard: ", what, " on TP mesh ",
                tp.str(), " with FSDP mesh ", dp.str(), ": the two must tile the ", world_size(),
                " world ranks");
  const std::string tp_name = tp.dim_names()[0];
  Shape shape = dp.shape();
  std::vector<std::string> names = dp.dim_names();
  for (const std::string& n : names)
    TESSERA_CHECK(n != tp_name, "fully_shard: FSDP mesh ", dp.str(), " and TP mesh ", tp.str(),
                  " of ", what, " share the dim name '", n, "'");
  shape.push_back(tp.size());
  names.push_back(tp_name);
  DeviceMesh m(shape, names);
  std::vector<std::string> dp_names(names.begin(), names.end() - 1);
  const DeviceMesh dp_part = dp_names.size() == 1 ? m[dp_names[0]] : m[dp_names];
  TESSERA_CHECK(
      dp_part.world_ranks() == dp.world_ranks() && m[tp_name].world_ranks() == tp.world_ranks(),
      "fully_shard: FSDP mesh ", dp.str(), " and TP mesh ", tp.str(), " of ", what,
      " are not the leading dims and the last dim of one row-major world mesh ", m.str());
  return m;
}

// The members of one group, checked and laid out: each parameter's dim-0 piece padded to
// ceil(rows / k) rows in the per-rank flat buffer, and where each rank's pieces land when the
// group is gathered (the parameters one after another, each whole, so that every leaf is a view
// of the gathered buffer).
struct Layout {
  std::vector<Tensor> sources;
  std::optional<DeviceMesh> dp_tp_mesh;
  DType dtype = DType::Float32;
};

}  // namespace

// Builds the groups of one fully_shard call (a friend of FSDPState).
struct detail::FSDPGroupBuilder {
  static Layout lay_out(FSDPState& state, const Module& module, const DeviceMesh& mesh,
                        const std::vector<std::pair<std::string, Parameter*>>& params, int64_t k) {
    Layout out;
    std::optional<DeviceMesh> tp_mesh;
    for (const auto& [name, p] : params) {
      FSDPState::ParamInfo i;
      i.param = p;
      i.name = name;
      Tensor src = p->stored().detach();
      if (p->is_dtensor()) {
        const DTensor& d = p->stored_dtensor();
        TESSERA_CHECK(d.mesh() != mesh, "fully_shard(", module.type_name(), "): parameter '", name,
                      "' is already sharded on ", mesh.str(), " (", d.str(), ")");
        if (!tp_mesh) {
          tp_mesh = d.mesh();
          out.dp_tp_mesh = combined_mesh(mesh, d.mesh(), "parameter '" + name + "'");
        }
        TESSERA_CHECK(d.mesh() == *tp_mesh, "fully_shard(", module.type_name(),
                      "): parameters on different TP meshes (", tp_mesh->str(), " and ",
                      d.mesh().str(), " for '", name, "')");
        i.tp_mesh = d.mesh();
        i.tp_placements = d.placements();
        i.tp_global_shape = d.shape();
        for (const Placement& pl : d.placements())
          TESSERA_CHECK(!pl.is_partial(), "fully_shard: parameter '", name, "' is ", d.str(),
                        "; a Partial parameter cannot be sharded");
      }
      // The mesh's process groups run over MPI on host memory.
      TESSERA_CHECK(src.device().type == DeviceType::CPU, "fully_shard(", module.type_name(),
                    "): parameter '", name, "' is on ", src.device().str(), " but mesh ",
                    mesh.str(),
                    " communicates CPU tensors (MPI); move the module to the CPU first");
      i.unsharded_shape = src.shape();
      TESSERA_CHECK(src.dim() >= 1, "fully_shard(", module.type_name(), "): parameter '", name,
                    "' is 0-dimensional; FSDP shards dim 0");
      out.dtype = src.dtype();
      i.rows = src.size(0);
      i.row_numel = i.rows == 0 ? 0 : src.numel() / i.rows;
      if (i.rows == 0) i.row_numel = shape_numel(Shape(src.shape().begin() + 1, src.shape().end()));
      i.chunk_rows = (i.rows + k - 1) / k;
      i.offset = state.padded_size_;
      state.padded_size_ += i.chunk_rows * i.row_numel;
      state.params_.push_back(std::move(i));
      out.sources.push_back(src);
    }
    state.gather_runs_.assign(size_t(k), {});
    for (FSDPState::ParamInfo& i : state.params_) {
      i.base = state.unsharded_numel_;
      state.unsharded_numel_ += shape_numel(i.unsharded_shape);
      for (int64_t r = 0; r < k; ++r) {
        const Chunk c = chunk_of(i.rows, k, r);
        if (c.length > 0)
          state.gather_runs_[size_t(r)].push_back(
              {i.offset, i.base + c.start * i.row_numel, c.length * i.row_numel});
      }
    }
    return out;
  }

  // Moves each parameter's piece into the flat buffer and makes it a DTensor over the data-parallel
  // mesh (HSDP replicates over its leading dim; FSDP x TP adds the TP placement last).
  static void shard_parameters(const std::shared_ptr<FSDPState>& state, const DeviceMesh& mesh,
                               const Layout& layout, int64_t k, int64_t my, bool hsdp) {
    NoGradGuard no_grad;
    state->flat_ = zeros(Shape{state->padded_size_}, layout.dtype);
    for (size_t n = 0; n < state->params_.size(); ++n) {
      FSDPState::ParamInfo& i = state->params_[n];
      Parameter& p = *i.param;
      const Chunk c = chunk_of(i.rows, k, my);
      Shape local_shape = i.unsharded_shape;
      local_shape[0] = c.length;
      Tensor view = kernels::view(
          kernels::narrow(state->flat_, 0, i.offset, c.length * i.row_numel), local_shape);
      view.copy_(kernels::narrow(layout.sources[n], 0, c.start, c.length));
      Placements placements;
      if (hsdp) placements.push_back(Replicate());
      if (i.tp_mesh) {
        // TP split dim 0 first, so FSDP's shard nests inside it: StridedShard.
        const Placement& tp = i.tp_placements[0];
        placements.push_back(tp.is_shard(0) ? StridedShard(0, i.tp_mesh->size()) : Shard(0));
        placements.push_back(tp);
      } else {
        placements.push_back(Shard(0));
        // A parameter TP left whole, in a group with TP parameters: replicated over tp, like
        // PyTorch, so the whole group lives on one mesh.
        if (layout.dp_tp_mesh) placements.push_back(Replicate());
      }
      const DTensor dt =
          DTensor::from_local(view, layout.dp_tp_mesh ? *layout.dp_tp_mesh : mesh, placements,
                              i.tp_mesh ? i.tp_global_shape : i.unsharded_shape);
      const bool rg = p.requires_grad();
      p = Parameter(dt, rg);
      TESSERA_CHECK(p.stored().storage().is_same(state->flat_.storage()),
                    "fully_shard: the stored shard of '", i.name,
                    "' is not a view of the flat buffer");
      param_registry()[&p] = state;
    }
  }

  static std::shared_ptr<FSDPState> make_group(
      const ModulePtr& module, const DeviceMesh& mesh, const FSDPOptions& opts,
      const std::vector<std::pair<std::string, Parameter*>>& params) {
    std::shared_ptr<FSDPState> state(new FSDPState());
    state->module_ = module;
    state->opts_ = opts;
    state->schedule_ = std::make_shared<detail::FSDPSchedule>();
    const bool hsdp = mesh.ndim() == 2;
    const ProcessGroupPtr& shard_pg = mesh.group(hsdp ? 1 : 0);
    state->gather_pg_ = dedicated_group(shard_pg, "fsdp_all_gather");
    state->reduce_pg_ = dedicated_group(shard_pg, "fsdp_reduce_scatter");
    if (hsdp) state->replicate_pg_ = dedicated_group(mesh.group(0), "fsdp_replicate");
    const int64_t k = shard_pg->size();
    const Layout layout = lay_out(*state, *module, mesh, params, k);
    shard_parameters(state, mesh, layout, k, mesh.local_rank(hsdp ? 1 : 0), hsdp);
    return state;
  }
};

bool is_fully_sharded(const Parameter& p) {
  return claimed(&p);
}

std::shared_ptr<FSDPState> fully_shard(const ModulePtr& module, const DeviceMesh& mesh,
                                       FSDPOptions opts) {
  TESSERA_CHECK(module != nullptr, "fully_shard: null module");
  {
    auto it = module_registry().find(module.get());
    TESSERA_CHECK(it == module_registry().end() || it->second.expired(),
                  "fully_shard: ", module->type_name(),
                  " is already fully_shard'ed; call it once per module");
  }
  TESSERA_CHECK(mesh.ndim() == 1 || mesh.ndim() == 2, "fully_shard(", module->type_name(),
                "): mesh ", mesh.str(),
                " must be 1-D (FSDP) or 2-D (HSDP: replicate dim 0, shard dim 1)");
  // One group per dtype among the unclaimed parameters (a bfloat16 frozen base next to float32
  // LoRA adapters): each gathers in its own dtype. The first is what this call returns; the
  // others are its siblings and follow it.
  std::vector<std::vector<std::pair<std::string, Parameter*>>> by_dtype;
  std::vector<DType> dtypes;
  for (auto& [name, p] : module->named_parameters()) {
    if (!p->defined() || claimed(p)) continue;
    const DType dt = p->stored().dtype();
    auto it = std::find(dtypes.begin(), dtypes.end(), dt);
    if (it == dtypes.end()) {
      dtypes.push_back(dt);
      by_dtype.emplace_back();
      it = dtypes.end() - 1;
    }
    by_dtype[size_t(it - dtypes.begin())].emplace_back(name, p);
  }
  if (by_dtype.empty()) by_dtype.emplace_back();
  std::vector<std::shared_ptr<FSDPState>> groups;
  for (const auto& params : by_dtype)
    groups.push_back(detail::FSDPGroupBuilder::make_group(module, mesh, opts, params));
  const std::shared_ptr<FSDPState>& state = groups.front();
  for (size_t g = 1; g < groups.size(); ++g) {
    groups[g]->schedule_ = state->schedule_;
    state->siblings_.push_back(groups[g]);
  }

  // Every fully_shard'ed module inside this one now has an outer root.
  for (auto& [name, m] : module->named_modules()) {
    if (m.get() == module.get()) continue;
    auto it = module_registry().find(m.get());
    if (it == module_registry().end()) continue;
    if (auto s = it->second.lock()) {
      for (FSDPState* member : s->members()) {
        member->is_root_ = false;
        member->schedule_ = state->schedule_;
      }
    }
  }
  module_registry()[module.get()] = state;

  for (const auto& g : groups) {
    module->register_forward_pre_hook([g](Module&, const Tensor& x) { return g->pre_forward(x); });
    module->register_forward_hook(
        [g](Module&, const Tensor&, const Tensor& y) { return g->post_forward(y); });
  }
  return state;
}

}  // namespace tessera
