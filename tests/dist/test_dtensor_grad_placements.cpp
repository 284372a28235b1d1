// to_local(grad_placements) and full_tensor(grad_placements), PyTorch's: a gradient that each
// rank holds one term of (each rank computed something of its own from the piece or the whole
// tensor) is summed by the backward, on every mesh and every placement list.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// Each rank's own coefficients, seeded by its world rank.
Tensor coefficients(const Shape& shape, int rank) {
  return random_tensor(shape, uint64_t(100 + rank), DType::Float64);
}

// The gradient's usual placements with Partial() wherever they are Replicate.
Placements terms_of(const DTensor& d) {
  Placements p = d.spec().grad_placements();
  for (Placement& q : p)
    if (q.is_replicate()) q = Partial();
  return p;
}

}  // namespace

// Each rank takes the whole tensor and weighs it with its own coefficients: the loss is the sum
// of the ranks' terms, so the gradient is the sum of their coefficients, on every rank's window.
// Without grad_placements each rank keeps its own term's gradient, as documented (and as in
// PyTorch).
TEST(DTensorGradPlacements, FullTensorSumsTheRanksTerms) {
  const Shape shape{5, 6};
  Tensor total = zeros(shape, DType::Float64);
  for (int r = 0; r < world_size(); ++r)
    total = add(total, coefficients(shape, r));
  const Tensor global = random_tensor(shape, 7, DType::Float64);
  for (const DeviceMesh& mesh : device_meshes(2))
    for (const Placements& p : placement_lists(mesh.shape(), 2, {.strided = true})) {
      const std::string what = mesh.str() + " " + placements_str(p);
      DTensor w = distribute_tensor(global, mesh, p);
      w.set_requires_grad(true);
      backward(sum(mul(w.full_tensor(Placements(size_t(mesh.ndim()), Partial())),
                       coefficients(shape, world_rank()))));
      EXPECT_EQ(local_mismatch(w.grad(), total), "") << what;

      DTensor own = distribute_tensor(global, mesh, p);
      own.set_requires_grad(true);
      backward(sum(mul(own.full_tensor(), coefficients(shape, world_rank()))));
      const Tensor unsummed = own.grad().full_tensor();  // collective: every rank
      if (world_size() > 1) {
        EXPECT_GT(max_abs_diff(unsummed, total), 1e-6)
            << what << ": without grad_placements the terms are not summed";
      }
    }
}

// A piece used on each rank's own data (a replicated weight in a data-parallel computation):
// the gradient sums over the mesh dims where the tensor is replicated, and only those.
TEST(DTensorGradPlacements, ToLocalSumsOverTheReplicatedMeshDims) {
  const Shape shape{6, 4};
  const Tensor global = random_tensor(shape, 9, DType::Float64);
  for (const DeviceMesh& mesh : device_meshes(2))
    for (const Placements& p : placement_lists(mesh.shape(), 2)) {
      const std::string what = mesh.str() + " " + placements_str(p);
      DTensor w = distribute_tensor(global, mesh, p);
      w.set_requires_grad(true);
      const Tensor local = w.to_local(terms_of(w));
      backward(sum(mul(local, coefficients(local.shape(), world_rank()))));
      // The sum of the coefficients of the ranks that hold the same window: those that differ
      // from this one only along the mesh dims where the gradient is Replicate.
      Tensor want = zeros(local.shape(), DType::Float64);
      const std::vector<int64_t> mine = mesh.coordinate();
      for (int r = 0; r < world_size(); ++r) {
        const std::vector<int64_t> theirs = mesh.coordinate_of(r);
        bool same = true;
        for (int64_t m = 0; m < mesh.ndim(); ++m)
          same = same && (w.spec().grad_placements()[size_t(m)].is_replicate() ||
                          theirs[size_t(m)] == mine[size_t(m)]);
        if (same) want = add(want, coefficients(local.shape(), r));
      }
      expect_close(w.grad().to_local(), want, 1e-12, what);
    }
}

// Two uses of one replicated piece, each with its own terms: the gradient is the sum of both
// uses' sums (the deferred reduction adds the terms first and reduces once).
TEST(DTensorGradPlacements, TermsOfTwoUsesAddUp) {
  const DeviceMesh mesh(Shape{world_size()}, {"dp"});
  const Shape shape{3, 4};
  DTensor w = distribute_tensor(random_tensor(shape, 3, DType::Float64), mesh, {Replicate()});
  w.set_requires_grad(true);
  const Tensor a = w.to_local({Partial()}), b = w.to_local({Partial()});
  backward(add(sum(mul(a, coefficients(shape, world_rank()))),
               sum(mul(b, coefficients(shape, 50 + world_rank())))));
  Tensor want = zeros(shape, DType::Float64);
  for (int r = 0; r < world_size(); ++r)
    want = add(want, add(coefficients(shape, r), coefficients(shape, 50 + r)));
  expect_close(w.grad().to_local(), want, 1e-12, "two uses");
}

TEST(DTensorGradPlacements, LayoutsThatCannotDescribeTheGradientAreRefused) {
  const DeviceMesh mesh(Shape{world_size()}, {"dp"});
  DTensor w = distribute_tensor(zeros({4, 4}, DType::Float64), mesh, {Shard(0)});
  w.set_requires_grad(true);
  expect_error(
      [&] {
        (void)w.to_local({Partial(), Partial()});
      },
      {"DTensor to_local: grad_placements [P(sum), P(sum)]", "one placement per mesh dim"});
  expect_error([&] { (void)w.to_local({Partial()}); },
               {"mesh dim 0 has P(sum) where the gradient is S(0)"});
  expect_error([&] { (void)w.to_local({Shard(1)}); },
               {"mesh dim 0 has S(1) where the gradient is S(0)"});
  DTensor r = distribute_tensor(zeros({4, 4}, DType::Float64), mesh, {Replicate()});
  expect_error([&] { (void)r.full_tensor({Partial(ReduceOp::Max)}); },
               {"only terms of a sum are taken"});
  EXPECT_TRUE(w.to_local({Shard(0)}).is_same(w.to_local())) << "the usual layout: the piece";
  // A negative dim names the same layout, as in the placements the DTensor was made with.
  DTensor last = distribute_tensor(zeros({4, 4}, DType::Float64), mesh, {Shard(-1)});
  last.set_requires_grad(true);
  EXPECT_TRUE(last.to_local({Shard(-1)}).is_same(last.to_local()));
  EXPECT_TRUE(last.to_local({Shard(1)}).is_same(last.to_local()));
}

// autograd::grad takes a DTensor leaf's gradient where a backward would accumulate it: reduced
// the same way (the ranks' terms summed), with nothing accumulated into .grad.
TEST(DTensorGradPlacements, AutogradGradReducesAsBackwardDoes) {
  const Shape shape{5, 6};
  const Tensor global = random_tensor(shape, 7, DType::Float64);
  for (const DeviceMesh& mesh : device_meshes(2))
    for (const Placements& p : placement_lists(mesh.shape(), 2)) {
      const std::string what = mesh.str() + " " + placements_str(p);
      auto loss_of = [&](const DTensor& w) {
        return sum(mul(w.full_tensor(Placements(size_t(mesh.ndim()), Partial())),
                       coefficients(shape, world_rank())));
      };
      DTensor w = distribute_tensor(global, mesh, p);
      w.set_requires_grad(true);
      backward(loss_of(w));
      DTensor v = distribute_tensor(global, mesh, p);
      v.set_requires_grad(true);
      const Tensor taken = autograd::grad({loss_of(v)}, {v.to_local()})[0];
      EXPECT_FALSE(v.to_local().grad().defined()) << what;
      ASSERT_TRUE(taken.defined()) << what;
      EXPECT_EQ(max_abs_diff(taken, w.grad().to_local()), 0.0) << what;
    }
}
