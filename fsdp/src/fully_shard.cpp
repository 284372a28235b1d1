#include "tessera/fsdp/fully_shard.h"

#include <algorithm>

#include "fsdp_group.h"
#include "registry.h"
#include "schedule.h"

#include "tessera/autograd/grad_mode.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "tessera/dtensor/layout.h"

namespace tessera {

using detail::FSDPGroup;

namespace {

// FSDP x TP: the mesh whose leading dims are the FSDP mesh (dp, or replicate and shard for
// HSDP) and whose last dim is `tp`, checked against both.
DeviceMesh combined_mesh(const DeviceMesh& dp, const DeviceMesh& tp, const std::string& what) {
  TESSERA_CHECK(tp.ndim() == 1, "fully_shard: ", what, " is a DTensor on ", tp.str(),
                "; FSDP x TP needs a 1-D TP mesh");
  TESSERA_CHECK(dp.size() * tp.size() == world_size(), "fully_shard: ", what, " on TP mesh ",
                tp.str(), " with FSDP mesh ", dp.str(), ": the two must tile the ", world_size(),
                " world ranks");
  TESSERA_CHECK(dp.device_type() == tp.device_type(), "fully_shard: ", what, " on TP mesh ",
                tp.str(), " with FSDP mesh ", dp.str(),
                ": the two meshes are of different device types");
  const std::string tp_name = tp.dim_names()[0];
  Shape shape = dp.shape();
  std::vector<std::string> names = dp.dim_names();
  for (const std::string& n : names)
    TESSERA_CHECK(n != tp_name, "fully_shard: FSDP mesh ", dp.str(), " and TP mesh ", tp.str(),
                  " of ", what, " share the dim name '", n, "'");
  shape.push_back(tp.size());
  names.push_back(tp_name);
  DeviceMesh m(dp.device_type(), shape, names);
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

// Builds the groups of one fully_shard call.
struct GroupBuilder {
  static Layout lay_out(FSDPGroup& state, Module& module, const DeviceMesh& mesh,
                        const std::vector<std::pair<std::string, Parameter*>>& params, int64_t k) {
    Layout out;
    std::optional<DeviceMesh> tp_mesh;
    // Every slot, duplicates included: the ones holding a listed parameter's tensor are its
    // aliases.
    const auto slots = module.named_parameters(true, /*remove_duplicate=*/false);
    for (const auto& [name, p] : params) {
      FSDPGroup::ParamInfo i;
      i.param = p;
      i.name = name;
      i.original = p->stored().storage().weak_impl();
      for (const auto& [other_name, other] : slots)
        if (other != p && other->defined() && other->stored().is_same(p->stored()))
          i.aliases.push_back(other);
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
      // The flat shard lives on the mesh's device, where its groups communicate.
      TESSERA_CHECK(src.device() == mesh.device(), "fully_shard(", module.type_name(),
                    "): parameter '", name, "' is on ", src.device().str(), " but mesh ",
                    mesh.str(), " holds its shards on ", mesh.device().str(),
                    "; move the module there first (Module::to)");
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
    for (FSDPGroup::ParamInfo& i : state.params_) {
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
  static void shard_parameters(const std::shared_ptr<FSDPGroup>& state, const DeviceMesh& mesh,
                               const Layout& layout, int64_t k, int64_t my, bool hsdp) {
    NoGradGuard no_grad;
    state->flat_ = zeros(Shape{state->padded_size_}, TensorOptions(layout.dtype, mesh.device()));
    for (size_t n = 0; n < state->params_.size(); ++n) {
      FSDPGroup::ParamInfo& i = state->params_[n];
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
      FSDPGroup::sync_aliases(i);
      TESSERA_CHECK(p.stored().storage().is_same(state->flat_.storage()),
                    "fully_shard: the stored shard of '", i.name,
                    "' is not a view of the flat buffer");
    }
  }

  // A group laid out and checked, its parameters not yet touched.
  struct Planned {
    std::shared_ptr<FSDPGroup> group;
    Layout layout;
  };

  static Planned plan_group(const ModulePtr& module, const DeviceMesh& mesh,
                            const FSDPOptions& opts,
                            const std::vector<std::pair<std::string, Parameter*>>& params) {
    auto state = std::make_shared<FSDPGroup>();
    state->module_ = module;
    state->opts_ = opts;
    const bool hsdp = mesh.ndim() == 2;
    const ProcessGroupPtr& shard_pg = mesh.group(hsdp ? 1 : 0);
    state->gather_pg_ = detail::dedicated_group(shard_pg, "fsdp_all_gather");
    state->reduce_pg_ = detail::dedicated_group(shard_pg, "fsdp_reduce_scatter");
    if (hsdp) state->replicate_pg_ = detail::dedicated_group(mesh.group(0), "fsdp_replicate");
    state->shard_pg_ = shard_pg;
    Layout layout = lay_out(*state, *module, mesh, params, shard_pg->size());
    state->apply_reshard_after_forward(
        state->resolve_reshard_after_forward(opts.reshard_after_forward));
    return {std::move(state), std::move(layout)};
  }

  static std::shared_ptr<FSDPGroup> make_group(const Planned& plan, const DeviceMesh& mesh) {
    const bool hsdp = mesh.ndim() == 2;
    shard_parameters(plan.group, mesh, plan.layout, plan.group->gather_pg_->size(),
                     mesh.local_rank(hsdp ? 1 : 0), hsdp);
    detail::register_group(plan.group);
    return plan.group;
  }
};

// The call's unclaimed parameters, one list per dtype (a bfloat16 frozen base next to float32
// LoRA adapters): each becomes a group gathering in its own dtype. At least one list, so that a
// module without parameters of its own still gets a group (and its hooks).
// A slot still holding the tensor an earlier call sharded (a weight tied by assignment to one in a
// module sharded on its own) would be sharded again as a second, independent parameter: the tie
// would come apart, silently, in training and in checkpoints.
void check_not_tied_to_sharded(const Module& module, const std::string& name, const Parameter& p,
                               const std::vector<std::shared_ptr<FSDPGroup>>& live) {
  const StorageImpl* storage = p.stored().storage().impl();
  for (const auto& g : live)
    for (const FSDPGroup::ParamInfo& i : g->params_) {
      const auto original = i.original.lock();
      if (!original || original.get() != storage) continue;
      const auto owner = g->module_.lock();
      TESSERA_FAIL("fully_shard(", module.type_name(), "): parameter '", name,
                   "' holds the tensor that fully_shard(",
                   owner ? owner->type_name() : std::string("a module"), ") sharded as '", i.name,
                   "' (a weight tied across two fully_shard calls would come apart); shard both "
                   "uses in one call, on the module that holds both");
    }
}

std::vector<std::vector<std::pair<std::string, Parameter*>>> unclaimed_by_dtype(
    Module& module, const std::vector<std::shared_ptr<FSDPGroup>>& live) {
  std::vector<std::vector<std::pair<std::string, Parameter*>>> by_dtype;
  std::vector<DType> dtypes;
  for (auto& [name, p] : module.named_parameters()) {
    if (!p->defined() || detail::held_by(live, *p)) continue;
    check_not_tied_to_sharded(module, name, *p, live);
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
  return by_dtype;
}

// PyTorch's FSDP2 is applied bottom-up. A call on a module inside one already sharded finds its
// parameters taken by that module's group and would make a second root inside the first: an
// empty group with a schedule of its own, whose collectives can interleave with the outer
// root's on FSDP's communicators in an order that depends on timing.
void check_not_inside_a_sharded_module(Module& module,
                                       const std::vector<std::shared_ptr<FSDPGroup>>& live) {
  for (const auto& g : live) {
    const auto outer = g->module_.lock();
    if (!outer || outer.get() == &module) continue;
    for (const auto& [name, m] : outer->named_modules())
      TESSERA_CHECK(m.get() != &module, "fully_shard(", module.type_name(), "): the module is '",
                    name, "' inside fully_shard(", outer->type_name(),
                    "), whose group already holds its parameters; apply fully_shard bottom-up "
                    "(the modules inside first, then the one that holds them)");
  }
}

}  // namespace

bool is_fully_sharded(const Parameter& p) {
  return detail::held_by(detail::live_groups(), p);
}

std::shared_ptr<FSDPState> fully_shard(const ModulePtr& module, const DeviceMesh& mesh,
                                       FSDPOptions opts) {
  TESSERA_CHECK(module != nullptr, "fully_shard: null module");
  const auto live = detail::live_groups();
  TESSERA_CHECK(detail::groups_of(live, *module).empty(), "fully_shard: ", module->type_name(),
                " is already fully_shard'ed; call it once per module");
  check_not_inside_a_sharded_module(*module, live);
  const MixedPrecisionPolicy& mp = opts.mp_policy;
  for (const auto& [field, dtype] :
       {std::pair{"param_dtype", mp.param_dtype}, std::pair{"reduce_dtype", mp.reduce_dtype},
        std::pair{"output_dtype", mp.output_dtype}})
    TESSERA_CHECK(!dtype || is_floating(*dtype), "fully_shard(", module->type_name(),
                  "): MixedPrecisionPolicy::", field, " is ", dtype_name(*dtype),
                  "; it must be a floating dtype");
  TESSERA_CHECK(mesh.ndim() == 1 || mesh.ndim() == 2, "fully_shard(", module->type_name(),
                "): mesh ", mesh.str(),
                " must be 1-D (FSDP) or 2-D (HSDP: replicate dim 0, shard dim 1)");
  // Every dtype group is laid out and checked before any parameter is sharded: a call that is
  // refused changes nothing.
  std::vector<GroupBuilder::Planned> plans;
  for (const auto& params : unclaimed_by_dtype(*module, live))
    plans.push_back(GroupBuilder::plan_group(module, mesh, opts, params));
  std::vector<std::shared_ptr<FSDPGroup>> groups;
  for (const auto& plan : plans)
    groups.push_back(GroupBuilder::make_group(plan, mesh));
  // The call's groups share one schedule, and so does every group inside the module, whose
  // root this call now is.
  const auto schedule = std::make_shared<detail::FSDPSchedule>();
  for (const auto& g : groups) {
    g->schedule_ = schedule;
    g->starts_step_ = g == groups.front();
  }
  for (const auto& g : detail::groups_inside(live, *module)) {
    g->is_root_ = false;
    g->schedule_ = schedule;
  }
  // The hooks own the groups: they live as long as the module.
  for (const auto& g : groups) {
    module->register_forward_pre_hook([g](Module&, const Tensor& x) { return g->pre_forward(x); });
    module->register_forward_hook(
        [g](Module&, const Tensor&, const Tensor& y) { return g->post_forward(y); });
  }
  return std::make_shared<FSDPState>(std::move(groups));
}

}  // namespace tessera
