#pragma once
// The pair sweep shared by the redistribute tests: for every source and target placement list
// and shape, distribute_tensor gives each rank the reference block, redistribute gives the
// reference block of the target, the full tensor comes back exactly, and the gradient through
// redistribute lands in the source's grad placements. Values are multiples of 1/4 so that all
// comparisons are exact.
#include <gtest/gtest.h>

#include "tessera/tessera.h"
#include "test_redistribute_reference.h"

namespace tessera::test_ref {

// Which pairs a sweep runs. Pairs whose plans cut pieces down to nothing next to a shard of the
// other dim, or turn one shard into another under a later shard of the target dim, take the
// least-trodden paths of the planner; a failure there can leave ranks out of step (a hang, or
// an MPI error), so those pairs run in the last tests of the binary, after every other result
// is in.
struct Partition {
  enum class Kind { All, Plain, Risky } kind = Kind::All;
  static Partition all() { return {Kind::All}; }
  static Partition plain() { return {Kind::Plain}; }
  static Partition risky() { return {Kind::Risky}; }
  bool includes(const DeviceMesh& mesh, const Placements& src, const Placements& dst,
                const Shape& shape) const {
    if (kind == Kind::All) return true;
    return is_risky(mesh, src, dst, shape) == (kind == Kind::Risky);
  }

  static bool is_risky(const DeviceMesh& mesh, const Placements& src, const Placements& dst,
                       const Shape& shape) {
    // S(a) -> S(b) on a mesh dim that a later mesh dim nests another shard of b inside.
    for (size_t m = 0; m < src.size(); ++m) {
      if (src[m].kind() != Placement::Kind::Shard || dst[m].kind() != Placement::Kind::Shard ||
          src[m].dim() == dst[m].dim())
        continue;
      for (size_t k = m + 1; k < dst.size(); ++k)
        if (dst[k].is_shard(dst[m].dim())) return true;
    }
    // Some rank holds no rows while another mesh dim shards the columns.
    bool cols_sharded = false;
    for (const Placements* p : {&src, &dst})
      for (const Placement& q : *p)
        cols_sharded = cols_sharded || q.is_shard(1);
    if (!cols_sharded) return false;
    for (int64_t r = 0; r < mesh.size(); ++r)
      for (const Placements* p : {&src, &dst})
        if (reference_window(shape, mesh.shape(), mesh_coordinate(r, mesh.shape()), *p).shape[0] ==
            0)
          return true;
    return false;
  }
};

inline const std::vector<Shape> kShapes = {{8, 12}, {7, 5}, {3, 2}, {1, 9}};

inline bool holds_zero_for_partial(const Placements& p, const std::vector<int64_t>& coord) {
  for (size_t m = 0; m < p.size(); ++m)
    if (p[m].is_partial() && coord[m] != 0) return true;
  return false;
}

// distribute_tensor's documented layout: the reference block, zeros off coordinate 0 of partial
// mesh dims.
inline Tensor distributed_reference(const Tensor& global, const DeviceMesh& mesh,
                                    const std::vector<int64_t>& coord, const Placements& p) {
  Tensor want = cut_window(global, reference_window(global.shape(), mesh.shape(), coord, p));
  if (holds_zero_for_partial(p, coord)) want.zero_();
  return want;
}

inline void run_pairs(const DeviceMesh& mesh, const std::vector<Placements>& srcs,
                      const std::vector<Placements>& dsts, const std::vector<Shape>& shapes,
                      const Partition& part = Partition::all()) {
  const std::vector<int64_t> coord = mesh_coordinate(world_rank(), mesh.shape());
  ASSERT_EQ(mesh.coordinate(), coord) << mesh.str() << " is not row-major over the world";
  const int root = world_size() - 1;
  Failures f;
  uint64_t seed = 1000;
  for (const Shape& shape : shapes) {
    const Tensor global = dyadic_tensor(shape, ++seed), weight = dyadic_tensor(shape, ++seed);
    for (const Placements& src : srcs) {
      const std::string at = mesh.str() + " " + shape_str(shape) + " " + placements_str(src) +
                             " at " + coordinate_str(coord);
      DTensor x0;
      f.check("distribute_tensor", at, error_of([&] {
                x0 = distribute_tensor(global, mesh, src);
                f.check("distribute_tensor local", at,
                        tensor_mismatch(x0.to_local(),
                                        distributed_reference(global, mesh, coord, src)));
                DTensor x1 =
                    distribute_tensor(world_rank() == root ? global : Tensor(), mesh, src, root);
                f.check("distribute_tensor from rank " + std::to_string(root), at,
                        tensor_mismatch(x1.to_local(), x0.to_local()));
              }));
      if (!x0.defined()) continue;
      for (const Placements& dst : dsts) {
        if (!part.includes(mesh, src, dst, shape)) continue;
        const std::string ctx = at + " -> " + placements_str(dst);
        f.check("redistribute", ctx, error_of([&] {
                  DTensor x = DTensor::from_local(x0.to_local().clone(), mesh, src, shape);
                  x.set_requires_grad(true);
                  DTensor y = x.redistribute(dst);
                  f.check("placements", ctx,
                          y.placements() == dst ? "" : "got " + placements_str(y.placements()));
                  // A Partial target may split the value any way: local_mismatch checks the sum.
                  f.check("local piece", ctx, local_mismatch(y, global));
                  Tensor full = y.full_tensor();
                  f.check("full_tensor", ctx, tensor_mismatch(full, global));
                  backward(sum(mul(full, weight)));
                  Window gw = reference_window(shape, mesh.shape(), coord, grad_placements(src));
                  f.check("source gradient", ctx,
                          tensor_mismatch(x.to_local().grad(), cut_window(weight, gw)));
                  DTensor g = x.grad();
                  f.check("grad placements", ctx,
                          g.defined() && g.placements() == grad_placements(src)
                              ? ""
                              : "got " + (g.defined() ? placements_str(g.placements()) : "none"));
                }));
      }
    }
  }
  f.summarize();
}

// FSDP over TP on dim 0: [StridedShard(0, tp), Shard(0)] against the layouts it is gathered into
// or cut from.
inline std::vector<Placements> strided_lists(const DeviceMesh& mesh) {
  const Placement R = Replicate(), S0 = Shard(0), S1 = Shard(1);
  return {{StridedShard(0, mesh.size(1)), S0}, {R, R}, {S0, R}, {R, S0}, {S1, S0}};
}

}  // namespace tessera::test_ref
