#pragma once
// Agreement across the ranks of a mesh on what they passed to a collective DTensor call, before
// any data moves: a rank whose inputs differ from the others' (dtype, placements, mesh, shape,
// source rank) or fail a local check makes every rank of the mesh throw the same error, instead
// of one rank throwing while the others wait in the next collective, or the data moving between
// buffers of different sizes.
#include <string>
#include <utility>
#include <vector>

#include "tessera/dtensor/device_mesh.h"

namespace tessera::detail {

// What one rank passed, field by field: {"dtype", "float32"}, {"placements", "[S(0)]"}, ... for
// "ranks 0 and 3 differ in dtype (rank 0: float32, rank 3: float64)".
using CallDescription = std::vector<std::pair<std::string, std::string>>;

// The mesh as a rank sees it: its shape and names and the world ranks it spans.
std::string mesh_description(const DeviceMesh& mesh);

// Collective over every rank of `mesh`. Throws on every rank, with `context` and `hint` and each
// difference naming the ranks, when the ranks' descriptions differ or any rank's `error` is not
// empty. Meshes that span the whole world are compared over the world group, so ranks that pass
// different such meshes are told so; a sub-mesh is compared over its own groups, which ranks
// passing sub-meshes over different rank sets do not share (that ends in the collective timeout).
void agree_on_call(const DeviceMesh& mesh, const std::string& context, const CallDescription& desc,
                   const std::string& error, const std::string& hint = "");

}  // namespace tessera::detail
