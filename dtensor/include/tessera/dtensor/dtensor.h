#pragma once
// A global (logical) array described by a DTensorSpec, of which this rank holds one local piece.
// There is no implicit conversion from or to Tensor; the crossings are the named calls below.
//
// Autograd runs on the local tensors. The gradient of a DTensor has its placements with Partial
// replaced by Replicate; every DTensor operation's backward produces its inputs' gradients in
// those placements (that is where replicated gradients get summed over the ranks that used them).
#include <memory>
#include <optional>

#include "tessera/core/tensor.h"
#include "tessera/dtensor/dtensor_spec.h"

namespace tessera {

class DTensor {
 public:
  DTensor() = default;
  // Wraps this rank's piece; no communication unless run_check. With global_shape given the
  // local shape is checked against it; without, it is inferred assuming every shard has the
  // local shape of this rank (even sharding) — pass it for uneven shapes. run_check verifies
  // across ranks, before any of them returns, that dtype, placements, mesh and global shape agree,
  // that every piece fits, and for Replicate mesh dims that the values agree; a failure on any
  // rank throws on every rank.
  static DTensor from_local(const Tensor& local, const DeviceMesh& mesh,
                            const Placements& placements,
                            const std::optional<Shape>& global_shape = std::nullopt,
                            bool run_check = false);
  // For library code that already has a validated spec and local tensor.
  DTensor(std::shared_ptr<const DTensorSpec> spec, Tensor local);

  bool defined() const { return spec_ != nullptr; }
  const DTensorSpec& spec() const;
  const std::shared_ptr<const DTensorSpec>& spec_ptr() const { return spec_; }
  const DeviceMesh& mesh() const { return spec().mesh; }
  const Placements& placements() const { return spec().placements; }
  const Shape& shape() const { return spec().global_shape; }  // global
  int64_t dim() const { return spec().ndim(); }
  int64_t size(int64_t d) const;
  int64_t numel() const { return shape_numel(shape()); }
  DType dtype() const { return spec().dtype; }

  // This rank's piece (the autograd graph lives on it; differentiable by construction). The
  // gradient it receives is taken to be laid out as this tensor's (its placements, Partial read
  // as Replicate): on a Replicate mesh dim, each rank's gradient as the whole gradient.
  const Tensor& to_local() const { return local_; }
  // PyTorch's to_local(grad_placements): the gradient the piece will receive is laid out as
  // `grad_placements` say. They may differ from this tensor's grad placements only by Partial
  // (sum) where those are Replicate: the local computation gives each rank one term of the
  // gradient, and the backward sums the terms over those mesh dims (a replicated weight used on
  // each rank's own data). Anything else is an error naming both.
  Tensor to_local(const Placements& grad_placements) const;
  // The global tensor on every rank (gathers; differentiable). Its gradient is taken to be the
  // same on every rank (Replicate).
  Tensor full_tensor() const;
  // The same with the gradient laid out as `grad_placements` say, as to_local's: [Partial()]
  // when each rank computes something of its own from the full tensor, whose gradients then sum.
  Tensor full_tensor(const Placements& grad_placements) const;
  // The same global tensor with other placements, by the cheapest plan (differentiable).
  DTensor redistribute(const Placements& placements) const;
  // Copies this rank's window of `full` (the global tensor, checked against the global shape)
  // into the local piece; no communication, no autograd.
  void copy_from_full(const Tensor& full);

  bool requires_grad() const { return local_.requires_grad(); }
  DTensor& set_requires_grad(bool r);
  // The gradient as a DTensor with grad placements (undefined before a backward).
  DTensor grad() const;
  DTensor detach() const;

  std::string str() const;

 private:
  std::shared_ptr<const DTensorSpec> spec_;
  Tensor local_;
};

// distribute_tensor's src_rank besides a world rank of the mesh (PyTorch's src_data_rank).
// The mesh's first rank, coordinate 0 on every dim (the default, as PyTorch's 0): the result is
// that rank's tensor whatever the others hold, so ranks that initialised differently still get
// one model.
inline constexpr int kMeshFirstRank = -2;
// Every rank holds the same `global` and cuts its own window, with no data moving (PyTorch's
// None); the ranks compare a digest of their (host) tensors' values first, so a local shard
// passed as the global tensor, or replicas that differ, are an error on every rank.
inline constexpr int kEveryRank = -1;

// Global -> DTensor. From a source rank only that rank's `global` is read (others pass an
// undefined tensor or one of its shape and dtype) and each rank receives its window. With
// kEveryRank each rank cuts its window from its own `global`. Before any data moves the ranks
// agree on src_rank, placements, mesh and (with kEveryRank) the tensor's shape, dtype and (for a
// host tensor) values; a wrong
// or differing input on any rank throws on every rank. A Partial(sum) dim keeps the value on
// its coordinate 0 and zeros elsewhere; Partial avg, max and min keep it on every coordinate.
// The result is a new leaf that requires grad where `global` (the source rank's) does, as in
// PyTorch.
DTensor distribute_tensor(const Tensor& global, const DeviceMesh& mesh,
                          const Placements& placements, int src_rank = kMeshFirstRank);

// Text table of which mesh coordinates hold which global block.
std::string visualize_sharding(const DTensor& dt);

}  // namespace tessera
