#include "tessera/dtensor/dtensor_spec.h"

#include "tessera/core/error.h"

namespace tessera {

DTensorSpec::DTensorSpec(DeviceMesh mesh_, Placements placements_, Shape global_shape_,
                         DType dtype_)
    : mesh(std::move(mesh_)),
      placements(std::move(placements_)),
      global_shape(std::move(global_shape_)),
      dtype(dtype_) {
  TESSERA_CHECK(int64_t(placements.size()) == mesh.ndim(), "placements ",
                placements_str(placements), " have ", placements.size(), " entries but ",
                mesh.str(), " has ", mesh.ndim(), " dims");
  for (auto& p : placements) {
    // A product has no way to hold one value on one coordinate (what distribute_tensor, random
    // fills and state-dict loads write): they would give x^n.
    TESSERA_CHECK(!p.is_partial() || p.reduce_op() != ReduceOp::Product, "placements ",
                  placements_str(placements),
                  ": Partial(product) is not supported (sum, avg, max and min are)");
    if (p.is_shard()) {
      TESSERA_CHECK(p.dim() >= -ndim() && p.dim() < ndim(), "placement ", p.str(),
                    " is invalid for a tensor of shape ", shape_str(global_shape), " (", ndim(),
                    " dims)");
      p = p.normalized(ndim());
    }
  }
  TESSERA_CHECK(partials_commute(placements), "placements ", placements_str(placements),
                ": Partials of these reduce ops on one tensor have no single value (the result "
                "would depend on which reduction runs first); reduce one before adding another");
  shard_application_order(global_shape, mesh.shape(), placements);  // validates nesting
}

LocalLayout DTensorSpec::local_layout() const {
  return local_layout_at(mesh.coordinate());
}

LocalLayout DTensorSpec::local_layout_at(const std::vector<int64_t>& coordinate) const {
  return compute_local_layout(global_shape, mesh.shape(), coordinate, placements);
}

bool DTensorSpec::has_partial() const {
  for (const auto& p : placements)
    if (p.is_partial()) return true;
  return false;
}

bool DTensorSpec::is_replicated() const {
  for (const auto& p : placements)
    if (!p.is_replicate()) return false;
  return true;
}

Placements DTensorSpec::grad_placements() const {
  Placements g = placements;
  for (auto& p : g)
    if (p.is_partial()) p = Replicate();
  return g;
}

std::string DTensorSpec::str() const {
  return "DTensorSpec(" + shape_str(global_shape) + " " + dtype_name(dtype) + " on " + mesh.str() +
         " " + placements_str(placements) + ")";
}

bool DTensorSpec::operator==(const DTensorSpec& o) const {
  return mesh == o.mesh && placements == o.placements && global_shape == o.global_shape &&
         dtype == o.dtype;
}

}  // namespace tessera
