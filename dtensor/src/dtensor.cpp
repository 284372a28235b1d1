#include "tessera/dtensor/dtensor.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "agreement.h"
#include "ops/dispatch.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/comm/agree.h"
#include "tessera/comm/backend.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/digest.h"
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
    mesh.host_group(m)->all_reduce(f, ReduceOp::Max)->wait();
  return f.item<int64_t>() != 0;
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
  TESSERA_CHECK(local_.device().type == spec_->mesh.device_type(), "DTensor: local tensor ",
                local_.str(), " is on ", local_.device().str(), " but ", spec_->mesh.str(),
                " holds its pieces on ", spec_->mesh.device().str(),
                " (from_local and distribute_tensor move a tensor there)");
}

const DTensorSpec& DTensor::spec() const {
  TESSERA_CHECK(spec_ != nullptr, "operation on an undefined DTensor");
  return *spec_;
}

int64_t DTensor::size(int64_t d) const {
  return shape()[size_t(wrap_dim(d, dim(), "size"))];
}

namespace {

// The global shape from_local works with: the given one, or this rank's piece scaled by the mesh
// dims that shard it (even sharding).
Shape from_local_global_shape(const Tensor& local, const DeviceMesh& mesh,
                              const Placements& placements,
                              const std::optional<Shape>& global_shape) {
  if (global_shape) return *global_shape;
  Shape gs = local.shape();
  for (int64_t m = 0; m < mesh.ndim() && m < int64_t(placements.size()); ++m) {
    const Placement& p = placements[size_t(m)];
    if (!p.is_shard()) continue;
    int64_t d = wrap_dim(p.dim(), local.dim(), "from_local");
    gs[size_t(d)] *= mesh.size(m);
  }
  return gs;
}

// The spec of this rank's piece, checked against the piece's shape (no communication).
std::shared_ptr<const DTensorSpec> from_local_spec(const Tensor& local, const DeviceMesh& mesh,
                                                   const Placements& placements, const Shape& gs) {
  auto spec = std::make_shared<const DTensorSpec>(mesh, placements, gs, local.dtype());
  Shape expect = spec->local_layout().local_shape;
  TESSERA_CHECK(local.shape() == expect, "from_local: local tensor of shape ",
                shape_str(local.shape()), " on mesh coordinate ", coord_str(mesh.coordinate()),
                " but global shape ", shape_str(gs), " under ", placements_str(spec->placements),
                " gives this rank a piece of shape ", shape_str(expect));
  return spec;
}

// Whether the ranks of a Replicate mesh dim hold different values (a collective; the ranks have
// agreed on dtype and shapes before). Bit patterns are compared with the first rank's, so equal
// NaNs are equal and integers beyond 2^53 are told apart (a float64 max/min comparison did
// neither).
bool replicas_differ(const Tensor& local, const DeviceMesh& mesh, const Placements& placements) {
  bool values_differ = false;
  const Tensor mine = local.contiguous().to(Device::cpu());
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (!placements[size_t(m)].is_replicate()) continue;
    Tensor first = local.clone();  // on the mesh's device: its group may move nothing else
    mesh.group(m)->broadcast(first, 0)->wait();
    const Tensor got = first.to(Device::cpu());
    values_differ =
        values_differ || std::memcmp(got.raw_data(), mine.raw_data(), mine.nbytes()) != 0;
  }
  return any_rank(mesh, values_differ);
}

}  // namespace

DTensor DTensor::from_local(const Tensor& given, const DeviceMesh& mesh,
                            const Placements& placements, const std::optional<Shape>& global_shape,
                            bool run_check) {
  // As PyTorch's from_local, a piece on another device type moves to the mesh's device.
  const Tensor local = given.defined() && given.device().type != mesh.device_type()
                           ? to_device(given, mesh.device())
                           : given;
  if (!run_check) {
    TESSERA_CHECK(local.defined(), "from_local: undefined local tensor");
    Shape gs = from_local_global_shape(local, mesh, placements, global_shape);
    return DTensor(from_local_spec(local, mesh, placements, gs), local);
  }
  // With run_check every rank checks its own piece, then the ranks agree on what they passed
  // before any of them throws, and before the values of Replicate dims are compared (which
  // would move pieces of different dtypes or shapes between the ranks).
  std::shared_ptr<const DTensorSpec> spec;
  std::string error, gs_text = "unknown";
  try {
    TESSERA_CHECK(local.defined(), "from_local: undefined local tensor");
    Shape gs = from_local_global_shape(local, mesh, placements, global_shape);
    gs_text = shape_str(gs);
    spec = from_local_spec(local, mesh, placements, gs);
  } catch (...) {
    error = current_error_text();
  }
  const detail::CallDescription desc = {
      {"dtype", local.defined() ? dtype_name(local.dtype()) : "an undefined tensor"},
      {"placements", placements_str(placements)},
      {"mesh", detail::mesh_description(mesh)},
      {"global shape", gs_text}};
  detail::agree_on_call(mesh, "from_local(run_check)", desc, error,
                        "every rank must pass a piece of the same dtype, under the same "
                        "placements and mesh, of the same global shape");
  TESSERA_CHECK(!replicas_differ(local, mesh, spec->placements),
                "from_local(run_check): values differ across ranks of a Replicate mesh dim of ",
                mesh.str(), " (placements ", placements_str(spec->placements), ")");
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

Tensor DTensor::to_local(const Placements& grad_placements) const {
  const Placements usual = spec().grad_placements();
  auto refuse = [&](const std::string& why) {
    TESSERA_FAIL("DTensor to_local: grad_placements ", placements_str(grad_placements), " for ",
                 str(), ": ", why, " (they may differ from the gradient's usual ",
                 placements_str(usual),
                 " only by Partial() where that is Replicate: a gradient each rank holds a "
                 "term of)");
  };
  if (int64_t(grad_placements.size()) != mesh().ndim())
    refuse("one placement per mesh dim is needed, the mesh " + mesh().str() + " has " +
           std::to_string(mesh().ndim()));
  std::vector<int64_t> sum_dims;
  for (int64_t m = 0; m < mesh().ndim(); ++m) {
    // Shard(-1) names the same dim as the spec's normalized Shard(ndim - 1).
    const Placement want = grad_placements[size_t(m)].is_shard()
                               ? grad_placements[size_t(m)].normalized(int64_t(shape().size()))
                               : grad_placements[size_t(m)];
    if (want == usual[size_t(m)]) continue;
    if (!want.is_partial() || !usual[size_t(m)].is_replicate())
      refuse("mesh dim " + std::to_string(m) + " has " + want.str() + " where the gradient is " +
             usual[size_t(m)].str());
    if (want.reduce_op() != ReduceOp::Sum)
      refuse("mesh dim " + std::to_string(m) + " has " + want.str() +
             "; only terms of a sum are taken");
    if (mesh().size(m) > 1) sum_dims.push_back(m);
  }
  if (sum_dims.empty() || !local_.requires_grad() || !grad_enabled()) return local_;
  return dtensor_ops::sum_grad_over(local_, mesh(), std::move(sum_dims));
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

namespace {

constexpr int kMaxHeaderDims = 10;

// src_rank is kEveryRank (every rank holds the tensor) or a world rank of the mesh.
void check_src_rank(const DeviceMesh& mesh, int src_rank) {
  if (src_rank == kEveryRank) return;
  const std::vector<int>& ranks = mesh.world_ranks();
  TESSERA_CHECK(std::find(ranks.begin(), ranks.end(), src_rank) != ranks.end(),
                "distribute_tensor: src_rank ", src_rank,
                " is neither kMeshFirstRank (-2), kEveryRank (-1, every rank passes the global "
                "tensor) nor a world rank of ",
                detail::mesh_description(mesh));
}

std::string tensor_description(const Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::string s = dtype_name(t.dtype());
  s += ' ';
  s += shape_str(t.shape());
  if (t.requires_grad()) s += " requiring grad";
  return s;
}

// The digest of a host tensor's values as the ranks compare it (kEveryRank: a local shard passed
// as the global tensor, or replicas that drifted apart, would be cut into a tensor no rank
// holds). Device tensors are not read back for it.
std::string values_description(const Tensor& t) {
  if (!t.defined()) return "none";
  // The device's type only: ranks on cuda:0 and cuda:1 hold their tensors alike.
  if (!t.device().is_cpu()) return "on a device, not compared";
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)values_digest(t));
  return std::string("digest ") + hex;
}

// distribute_tensor's result: a new leaf that requires grad where the global tensor did, as
// PyTorch's.
DTensor distributed_leaf(std::shared_ptr<const DTensorSpec> spec, Tensor local,
                         bool requires_grad) {
  if (zero_for_partial(*spec)) local.zero_();
  DTensor out(std::move(spec), local);
  if (requires_grad) out.set_requires_grad(true);
  return out;
}

// This rank's window of `global` under `spec`, cut locally.
DTensor cut_window(const Tensor& global, std::shared_ptr<const DTensorSpec> spec) {
  const Tensor window = window_of(global, spec->local_layout());
  // Only the window moves when the global tensor is on another device type than the mesh.
  Tensor local = window.device().type == spec->mesh.device_type()
                     ? window.clone()
                     : window.contiguous().to(spec->mesh.device());
  return distributed_leaf(std::move(spec), local, global.requires_grad());
}

// The source sends each other mesh rank its window (the windows are checked consistent first).
DTensor send_windows(const Tensor& global, std::shared_ptr<const DTensorSpec> spec, int src_rank,
                     int data_tag, bool requires_grad) {
  const DeviceMesh& mesh = spec->mesh;
  ProcessGroupPtr world = world_group(mesh.device_type());
  Tensor local = empty(spec->local_layout().local_shape, TensorOptions(spec->dtype, mesh.device()));
  if (world->rank() == src_rank) {
    std::vector<WorkPtr> pending;
    std::vector<Tensor> keep;
    for (int r : mesh.world_ranks()) {
      Tensor w = window_of(global, spec->local_layout_at(mesh.coordinate_of(r))).contiguous();
      if (w.device().type != mesh.device_type()) w = w.to(mesh.device());
      if (r == src_rank) {
        local.copy_(w);
      } else if (w.numel() > 0) {
        keep.push_back(w);
        pending.push_back(world->send(w, r, data_tag));
      }
    }
    for (auto& w : pending)
      w->wait();
  } else if (local.numel() > 0) {
    world->recv(local, src_rank, data_tag)->wait();
  }
  return distributed_leaf(std::move(spec), local, requires_grad);
}

// The source sends every other mesh rank the global shape, dtype and whether it requires grad, each
// rank checks its own tensor against them, and the ranks agree on the outcome before the source
// sends the windows.
DTensor distribute_from(const Tensor& global, const DeviceMesh& mesh, const Placements& placements,
                        int src_rank) {
  ProcessGroupPtr world = world_group();
  constexpr int kHeaderTag = 0x7e51, kDataTag = 0x7e52;
  const int me = world->rank();
  Tensor header = zeros({kMaxHeaderDims + 3}, DType::Int64);
  if (me == src_rank) {
    int64_t* h = header.data<int64_t>();
    h[0] = global.dim();
    h[1] = int64_t(global.dtype());
    h[kMaxHeaderDims + 2] = global.requires_grad() ? 1 : 0;
    for (int64_t d = 0; d < global.dim(); ++d)
      h[2 + d] = global.size(d);
    for (int r : mesh.world_ranks())
      if (r != me) world->send(header, r, kHeaderTag)->wait();
  } else {
    world->recv(header, src_rank, kHeaderTag)->wait();
  }
  const int64_t* h = header.data<int64_t>();
  const Shape gs(h + 2, h + 2 + h[0]);
  const DType dt = DType(h[1]);
  std::string error;
  if (me != src_rank && global.defined() && (global.shape() != gs || global.dtype() != dt))
    error = detail::concat("[rank ", me, "] passed ", global.str(), " but the source rank ",
                           src_rank, " holds ", dtype_name(dt), " ", shape_str(gs),
                           "; ranks other than the source pass an undefined tensor or one of the "
                           "source's shape and dtype");
  detail::agree_on_call(mesh, "distribute_tensor", {}, error);
  return send_windows(global, std::make_shared<const DTensorSpec>(mesh, placements, gs, dt),
                      src_rank, kDataTag, h[kMaxHeaderDims + 2] != 0);
}

}  // namespace

DTensor distribute_tensor(const Tensor& global, const DeviceMesh& mesh,
                          const Placements& placements, int src_rank) {
  if (src_rank == kMeshFirstRank) src_rank = mesh.world_ranks().front();
  // Every rank checks its own inputs, then the ranks agree on them, before any data moves: a
  // rank that passed something wrong or different makes every rank throw.
  const bool holds = src_rank == -1 || (world_size() > src_rank && world_rank() == src_rank);
  std::shared_ptr<const DTensorSpec> spec;
  std::string error;
  try {
    check_src_rank(mesh, src_rank);
    if (holds) {
      TESSERA_CHECK(global.defined(),
                    "distribute_tensor: ", src_rank == -1 ? "this rank" : "the source rank",
                    " passed an undefined tensor");
      TESSERA_CHECK(global.dim() <= kMaxHeaderDims, "distribute_tensor: ", global.str(),
                    " has more than ", kMaxHeaderDims, " dims");
      spec = std::make_shared<const DTensorSpec>(mesh, placements, global.shape(), global.dtype());
    }
  } catch (...) {
    error = current_error_text();
  }
  detail::CallDescription desc = {{"src_rank", std::to_string(src_rank)},
                                  {"placements", placements_str(placements)},
                                  {"mesh", detail::mesh_description(mesh)}};
  if (src_rank == -1) {
    desc.emplace_back("global tensor", tensor_description(global));
    desc.emplace_back("global tensor values", values_description(global));
  }
  detail::agree_on_call(mesh, "distribute_tensor", desc, error,
                        src_rank == -1 ? "with src_rank = -1 every rank must pass the same global "
                                         "tensor, placements and mesh"
                                       : "every rank must pass the same src_rank, placements "
                                         "and mesh");
  if (src_rank == -1) return cut_window(global, std::move(spec));
  return distribute_from(global, mesh, placements, src_rank);
}

}  // namespace tessera
