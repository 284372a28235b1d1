#include "tessera/dtensor/dtensor.h"

#include "tessera/comm/runtime.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"

namespace tessera {

namespace {

std::string coord_str(const std::vector<int64_t>& c) {
  std::string s = "(";
  for (size_t i = 0; i < c.size(); ++i)
    s += (i ? ", " : "") + std::to_string(c[i]);
  return s + ")";
}

// The window of `global` this rank holds under `spec` (a view).
Tensor window_of(const Tensor& global, const LocalLayout& l) {
  Tensor w = global;
  for (size_t d = 0; d < l.local_shape.size(); ++d)
    w = kernels::narrow(w, int64_t(d), l.global_offset[d], l.local_shape[d]);
  return w;
}

// True on every rank of the mesh when `flag` is true on any of them, so that a check failing on
// some ranks makes all of them throw instead of leaving the others in the next collective.
bool any_rank(const DeviceMesh& mesh, bool flag) {
  Tensor f = from_vector<int64_t>({flag ? 1 : 0});
  for (int64_t m = 0; m < mesh.ndim(); ++m)
    mesh.group(m)->all_reduce(f, ReduceOp::Max)->wait();
  return f.item<int64_t>() != 0;
}

// Whether every rank of the mesh holds the same `desc` (compared through max and min).
bool same_on_every_rank(const DeviceMesh& mesh, const std::vector<int64_t>& desc) {
  bool same = true;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    Tensor mx = from_vector<int64_t>(desc), mn = mx.clone();
    mesh.group(m)->all_reduce(mx, ReduceOp::Max)->wait();
    mesh.group(m)->all_reduce(mn, ReduceOp::Min)->wait();
    same = same && mx.to_vector<int64_t>() == desc && mn.to_vector<int64_t>() == desc;
  }
  return !any_rank(mesh, !same);
}

// Sum-partial dims keep the value on coordinate 0 only.
bool zero_for_partial(const DTensorSpec& spec) {
  for (int64_t m = 0; m < spec.mesh.ndim(); ++m) {
    const Placement& p = spec.placements[size_t(m)];
    if (p.is_partial() && p.reduce_op() == ReduceOp::Sum && spec.mesh.coordinate()[size_t(m)] != 0)
      return true;
  }
  return false;
}

}  // namespace

DTensor::DTensor(std::shared_ptr<const DTensorSpec> spec, Tensor local)
    : spec_(std::move(spec)), local_(std::move(local)) {
  TESSERA_CHECK(spec_ && local_.defined(), "DTensor: needs a spec and a local tensor");
  Shape expect = spec_->local_layout().local_shape;
  TESSERA_CHECK(local_.shape() == expect, "DTensor: local tensor ", local_.str(),
                " does not have the shape ", shape_str(expect), " that mesh coordinate ",
                coord_str(spec_->mesh.coordinate()), " holds of ", spec_->str());
  TESSERA_CHECK(local_.dtype() == spec_->dtype, "DTensor: local dtype ", dtype_name(local_.dtype()),
                " differs from ", spec_->str());
}

const DTensorSpec& DTensor::spec() const {
  TESSERA_CHECK(spec_ != nullptr, "operation on an undefined DTensor");
  return *spec_;
}

int64_t DTensor::size(int64_t d) const {
  return shape()[size_t(wrap_dim(d, dim(), "size"))];
}

DTensor DTensor::from_local(const Tensor& local, const DeviceMesh& mesh,
                            const Placements& placements, const std::optional<Shape>& global_shape,
                            bool run_check) {
  TESSERA_CHECK(local.defined(), "from_local: undefined local tensor");
  Shape gs;
  if (global_shape) {
    gs = *global_shape;
  } else {
    gs = local.shape();
    for (int64_t m = 0; m < mesh.ndim() && m < int64_t(placements.size()); ++m) {
      const Placement& p = placements[size_t(m)];
      if (!p.is_shard()) continue;
      int64_t d = wrap_dim(p.dim(), local.dim(), "from_local");
      gs[size_t(d)] *= mesh.size(m);
    }
  }
  auto spec = std::make_shared<const DTensorSpec>(mesh, placements, gs, local.dtype());
  Shape expect = spec->local_layout().local_shape;
  const bool shape_ok = local.shape() == expect;
  auto shape_error = [&] {
    return detail::concat(
        "from_local: local tensor of shape ", shape_str(local.shape()), " on mesh coordinate ",
        coord_str(mesh.coordinate()), " but global shape ", shape_str(gs), " under ",
        placements_str(spec->placements), " gives this rank a piece of shape ", shape_str(expect));
  };
  if (!run_check) {
    TESSERA_CHECK(shape_ok, shape_error());
    return DTensor(std::move(spec), local);
  }
  // With run_check every rank takes part in every check before any of them throws.
  if (any_rank(mesh, !shape_ok)) {
    TESSERA_CHECK(shape_ok, shape_error());
    TESSERA_FAIL("from_local(run_check): another rank's local piece does not fit global shape ",
                 shape_str(gs), " under ", placements_str(spec->placements));
  }
  std::vector<int64_t> desc = {int64_t(gs.size())};
  desc.insert(desc.end(), gs.begin(), gs.end());
  TESSERA_CHECK(same_on_every_rank(mesh, desc), "from_local(run_check): ranks of ", mesh.str(),
                " disagree on the global shape (this rank: ", shape_str(gs), ")");
  bool values_differ = false;
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (!placements[size_t(m)].is_replicate()) continue;
    Tensor hi = local.to(DType::Float64).clone(), lo = hi.clone();
    mesh.group(m)->all_reduce(hi, ReduceOp::Max)->wait();
    mesh.group(m)->all_reduce(lo, ReduceOp::Min)->wait();
    values_differ = values_differ || hi.to_vector<double>() != lo.to_vector<double>();
  }
  TESSERA_CHECK(!any_rank(mesh, values_differ), "from_local(run_check): values differ across ",
                "ranks of a Replicate mesh dim of ", mesh.str(), " (placements ",
                placements_str(spec->placements), ")");
  return DTensor(std::move(spec), local);
}

void DTensor::copy_from_full(const Tensor& full) {
  const DTensorSpec& s = spec();
  TESSERA_CHECK(full.defined() && full.shape() == s.global_shape, "copy_from_full: got ",
                full.str(), " but the DTensor's global shape is ", shape_str(s.global_shape),
                " (was a local piece passed where the full tensor belongs?)");
  if (zero_for_partial(s)) {
    local_.zero_();
    return;
  }
  local_.copy_(window_of(full, s.local_layout()));
}

DTensor& DTensor::set_requires_grad(bool r) {
  local_.set_requires_grad(r);
  return *this;
}

DTensor DTensor::grad() const {
  Tensor g = local_.grad();
  if (!g.defined()) return DTensor();
  auto gs = std::make_shared<const DTensorSpec>(mesh(), spec().grad_placements(), shape(), dtype());
  return DTensor(gs, g.dtype() == dtype() ? g : g.to(dtype()));
}

DTensor DTensor::detach() const {
  return DTensor(spec_, local_.detach());
}

std::string DTensor::str() const {
  if (!defined()) return "DTensor(undefined)";
  return "DTensor(" + shape_str(shape()) + " " + dtype_name(dtype()) + " " + mesh().str() + " " +
         placements_str(placements()) + ", local " + shape_str(local_.shape()) + ")";
}

DTensor distribute_tensor(const Tensor& global, const DeviceMesh& mesh,
                          const Placements& placements, int src_rank) {
  if (src_rank < 0) {
    TESSERA_CHECK(global.defined(), "distribute_tensor: undefined tensor");
    // Every rank claims to hold the whole tensor: make sure they agree on its shape, so a rank
    // that passes its local shard fails loudly instead of being sharded a second time.
    std::vector<int64_t> desc = {int64_t(global.dim()), int64_t(global.dtype())};
    desc.insert(desc.end(), global.shape().begin(), global.shape().end());
    desc.resize(12, -1);
    TESSERA_CHECK(same_on_every_rank(mesh, desc), "distribute_tensor: ranks of ", mesh.str(),
                  " pass tensors of different shapes or dtypes (this rank: ", global.str(),
                  "); with src_rank = -1 every rank must pass the same global tensor");
    auto spec =
        std::make_shared<const DTensorSpec>(mesh, placements, global.shape(), global.dtype());
    Tensor local = window_of(global, spec->local_layout()).clone();
    if (zero_for_partial(*spec)) local.zero_();
    return DTensor(std::move(spec), local);
  }

  // From one source rank: it sends each mesh rank its header and window point to point.
  ProcessGroupPtr world = world_group();
  constexpr int kHeaderTag = 0x7e51, kDataTag = 0x7e52;
  const int me = world->rank();
  bool in_mesh = false;
  for (int r : mesh.world_ranks())
    in_mesh = in_mesh || r == src_rank;
  TESSERA_CHECK(in_mesh, "distribute_tensor: src_rank ", src_rank, " is not part of ", mesh.str());
  Tensor header = zeros({12}, DType::Int64);
  if (me == src_rank) {
    TESSERA_CHECK(global.defined() && global.dim() <= 10, "distribute_tensor: the source rank ",
                  src_rank, " must pass a tensor of at most 10 dims, got ", global.str());
    int64_t* h = header.data<int64_t>();
    h[0] = global.dim();
    h[1] = int64_t(global.dtype());
    for (int64_t d = 0; d < global.dim(); ++d)
      h[2 + d] = global.size(d);
    for (int r : mesh.world_ranks())
      if (r != me) world->send(header, r, kHeaderTag)->wait();
  } else {
    world->recv(header, src_rank, kHeaderTag)->wait();
  }
  const int64_t* h = header.data<int64_t>();
  Shape gs(h + 2, h + 2 + h[0]);
  DType dt = DType(h[1]);
  if (me != src_rank && global.defined())
    TESSERA_CHECK(global.shape() == gs, "distribute_tensor: this rank passed ", global.str(),
                  " but the source rank ", src_rank, " holds shape ", shape_str(gs));
  auto spec = std::make_shared<const DTensorSpec>(mesh, placements, gs, dt);
  Tensor local = empty(spec->local_layout().local_shape, dt);
  if (me == src_rank) {
    std::vector<WorkPtr> pending;
    std::vector<Tensor> keep;
    for (int r : mesh.world_ranks()) {
      Tensor w = window_of(global, spec->local_layout_at(mesh.coordinate_of(r))).contiguous();
      if (r == me) {
        local.copy_(w);
      } else if (w.numel() > 0) {
        keep.push_back(w);
        pending.push_back(world->send(w, r, kDataTag));
      }
    }
    for (auto& w : pending)
      w->wait();
  } else if (local.numel() > 0) {
    world->recv(local, src_rank, kDataTag)->wait();
  }
  if (zero_for_partial(*spec)) local.zero_();
  return DTensor(std::move(spec), local);
}

}  // namespace tessera
