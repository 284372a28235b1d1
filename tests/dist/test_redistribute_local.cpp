// The crossings between local and global tensors other than redistribute: from_local (with and
// without a global shape, with run_check), copy_from_full, to_local and redistribute_local (a
// piece of the wrong shape refused); and what a redistribute's output shares with its input
// (R -> P copies, steps over one rank copy nothing, a plan's output is its own), Partials that do
// not commute refused.
#include <gtest/gtest.h>

#include <functional>

#include "tessera/tessera.h"
#include "test_redistribute_reference.h"

using namespace tessera;
using namespace tessera::test_ref;

namespace {

std::vector<DeviceMesh> meshes() {
  std::vector<DeviceMesh> out;
  out.emplace_back(Shape{world_size()}, std::vector<std::string>{"x"});
  if (world_size() == 4) out.emplace_back(Shape{2, 2}, std::vector<std::string>{"dp", "tp"});
  if (world_size() == 8) out.emplace_back(Shape{2, 4}, std::vector<std::string>{"dp", "tp"});
  return out;
}

// Shard placements for each mesh: every mesh dim shards, dim 0 then dim 1 alternately.
Placements sharded(const DeviceMesh& mesh) {
  Placements p;
  for (int64_t m = 0; m < mesh.ndim(); ++m)
    p.push_back(Shard(m % 2));
  return p;
}

}  // namespace

TEST(FromLocal, EvenShardsInferTheGlobalShape) {
  for (const DeviceMesh& mesh : meshes()) {
    const auto coord = mesh_coordinate(world_rank(), mesh.shape());
    const Placements p = sharded(mesh);
    // Each mesh dim cuts its tensor dim into equal pieces of 3 rows / 2 columns.
    Shape shape = {3, 2};
    for (int64_t m = 0; m < mesh.ndim(); ++m)
      shape[size_t(m % 2)] *= mesh.size(m);
    const Tensor global = dyadic_tensor(shape, 1);
    Tensor local = cut_window(global, reference_window(shape, mesh.shape(), coord, p));
    DTensor d = DTensor::from_local(local, mesh, p);
    EXPECT_EQ(d.shape(), shape) << mesh.str();
    EXPECT_EQ(tensor_mismatch(d.full_tensor(), global), "") << mesh.str();
    EXPECT_TRUE(d.to_local().is_same(local)) << "from_local must wrap the piece, not copy it";
    // The same with run_check: every rank agrees, so no error.
    EXPECT_EQ(error_of([&] { DTensor::from_local(local, mesh, p, std::nullopt, true); }), "");
  }
}

TEST(FromLocal, UnevenShardsNeedTheGlobalShape) {
  for (const DeviceMesh& mesh : meshes()) {
    const auto coord = mesh_coordinate(world_rank(), mesh.shape());
    const Placements p = sharded(mesh);
    const Shape shape = {7, 5};
    const Tensor global = dyadic_tensor(shape, 2);
    Tensor local = cut_window(global, reference_window(shape, mesh.shape(), coord, p));
    DTensor d = DTensor::from_local(local, mesh, p, shape, /*run_check=*/true);
    EXPECT_EQ(d.shape(), shape);
    EXPECT_EQ(tensor_mismatch(d.full_tensor(), global), "") << mesh.str();
    if (mesh.size() == 1) continue;
    // Without it each rank guesses from its own piece; ranks holding short pieces guess a
    // different global shape, which run_check must catch on every rank.
    const std::string msg =
        error_of([&] { DTensor::from_local(local, mesh, p, std::nullopt, true); });
    TESSERA_EXPECT_CONTAINS(msg, "differ in global shape");
  }
}

TEST(FromLocal, PartialTermsSumToTheFullTensor) {
  for (const DeviceMesh& mesh : meshes()) {
    const Shape shape = {3, 4};
    Placements p(size_t(mesh.ndim()), Partial());
    Tensor want = zeros(shape, DType::Float64);
    for (int r = 0; r < world_size(); ++r)
      want = add(want, dyadic_tensor(shape, 100 + uint64_t(r)));
    DTensor d = DTensor::from_local(dyadic_tensor(shape, 100 + uint64_t(world_rank())), mesh, p);
    EXPECT_EQ(d.shape(), shape);
    EXPECT_EQ(tensor_mismatch(d.full_tensor(), want), "") << mesh.str();
  }
}

// On a 1-D mesh only: on a 2-D mesh a difference seen by some mesh-dim-0 groups and not others
// hangs run_check (see test_dtensor_misuse, NeverHangs.RunCheckWithOneDifferentReplica...).
TEST(FromLocal, RunCheckCatchesDifferentReplicatedValues) {
  if (world_size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  {
    const DeviceMesh mesh({world_size()}, {"x"});
    Placements p(size_t(mesh.ndim()), Replicate());
    Tensor same = dyadic_tensor({2, 3}, 3);
    EXPECT_EQ(error_of([&] { DTensor::from_local(same, mesh, p, std::nullopt, true); }), "");
    // The last rank's copy differs in one element.
    Tensor mine = same.clone();
    if (world_rank() == world_size() - 1) mine.data<double>()[4] += 1;
    const std::string msg =
        error_of([&] { DTensor::from_local(mine, mesh, p, std::nullopt, true); });
    TESSERA_EXPECT_CONTAINS(msg, "values differ across ranks");
    TESSERA_EXPECT_CONTAINS(msg, "Replicate");
  }
}

TEST(FromLocal, RunCheckCatchesShapesThatDisagree) {
  if (world_size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  DeviceMesh mesh({world_size()}, {"x"});
  // Each rank holds a replicated tensor of a different shape.
  Tensor local = zeros({2, 1 + world_rank()}, DType::Float64);
  const std::string msg =
      error_of([&] { DTensor::from_local(local, mesh, {Replicate()}, std::nullopt, true); });
  TESSERA_EXPECT_CONTAINS(msg, "differ in global shape");
  TESSERA_EXPECT_CONTAINS(msg, shape_str(local.shape()));
}

TEST(FromLocal, GradientReachesTheWrappedPiece) {
  for (const DeviceMesh& mesh : meshes()) {
    const auto coord = mesh_coordinate(world_rank(), mesh.shape());
    const Placements p = sharded(mesh);
    const Shape shape = {7, 5};
    const Tensor global = dyadic_tensor(shape, 4), weight = dyadic_tensor(shape, 5);
    const Window w = reference_window(shape, mesh.shape(), coord, p);
    Tensor piece = cut_window(global, w).set_requires_grad(true);
    DTensor d = DTensor::from_local(piece, mesh, p, shape);
    backward(sum(mul(d.full_tensor(), weight)));
    EXPECT_EQ(tensor_mismatch(piece.grad(), cut_window(weight, w)), "") << mesh.str();
  }
}

TEST(CopyFromFull, EachRankCopiesItsWindow) {
  const Placement S0 = Shard(0), S1 = Shard(1), R = Replicate(), P = Partial();
  for (const DeviceMesh& mesh : meshes()) {
    const auto coord = mesh_coordinate(world_rank(), mesh.shape());
    std::vector<Placements> lists;
    if (mesh.ndim() == 1) {
      lists = {{S0}, {S1}, {R}, {P}};
    } else {
      lists = {{S0, S1}, {S0, S0}, {R, S1}, {P, S0}, {S1, P}, {StridedShard(0, mesh.size(1)), S0}};
    }
    for (const Shape& shape : std::vector<Shape>{{8, 12}, {7, 5}, {1, 9}}) {
      const Tensor global = dyadic_tensor(shape, 6);
      for (const Placements& p : lists) {
        DTensor d = distribute_tensor(zeros(shape, DType::Float64), mesh, p);
        Tensor before = d.to_local();
        d.copy_from_full(global);
        EXPECT_TRUE(d.to_local().is_same(before)) << "copy_from_full must fill the piece in place";
        Tensor want = cut_window(global, reference_window(shape, mesh.shape(), coord, p));
        bool off_partial = false;
        for (size_t m = 0; m < p.size(); ++m)
          off_partial = off_partial || (p[m].is_partial() && coord[m] != 0);
        if (off_partial) want.zero_();
        EXPECT_EQ(tensor_mismatch(d.to_local(), want), "")
            << mesh.str() << " " << shape_str(shape) << " " << placements_str(p);
        EXPECT_EQ(tensor_mismatch(d.full_tensor(), global), "")
            << mesh.str() << " " << shape_str(shape) << " " << placements_str(p);
      }
    }
  }
}

TEST(ToLocal, IsTheDifferentiablePiece) {
  for (const DeviceMesh& mesh : meshes()) {
    const auto coord = mesh_coordinate(world_rank(), mesh.shape());
    const Placements p = sharded(mesh);
    Placements rep(size_t(mesh.ndim()), Replicate());
    const Shape shape = {7, 5};
    const Tensor global = dyadic_tensor(shape, 7), weight = dyadic_tensor(shape, 8);
    DTensor x = distribute_tensor(global, mesh, p);
    x.set_requires_grad(true);
    // A loss on every rank's replicated local piece: the gradient of a Replicate tensor is the
    // same on every rank, so the source's gradient is its block of the weight.
    DTensor y = x.redistribute(rep);
    EXPECT_EQ(tensor_mismatch(y.to_local(), global), "");
    backward(sum(mul(y.to_local(), weight)));
    EXPECT_EQ(tensor_mismatch(x.to_local().grad(),
                              cut_window(weight, reference_window(shape, mesh.shape(), coord, p))),
              "")
        << mesh.str();
  }
}

// A piece whose shape is not the one its placements give this rank is refused, naming both
// shapes, before any collective: on some routes it would lose or invent elements.
TEST(RedistributeLocal, APieceOfTheWrongShapeIsRefused) {
  const DeviceMesh mesh({world_size()}, {"x"});
  const DTensorSpec spec(mesh, {Shard(0)}, {4 * world_size(), 4}, DType::Float32);
  const Tensor piece = dyadic_tensor({3, 4}, 9);
  for (const Placements& dst : {Placements{Shard(1)}, Placements{Replicate()}})
    tessera::testing::expect_error([&] { redistribute_local(piece, spec, dst); },
                                   {"redistribute_local to " + placements_str(dst),
                                    "the local piece is [3, 4]", "a piece of [4, 4]"});
}

// Partials on two mesh dims with reduce ops that do not commute have no single value: refused.
// Sums with averages, and max with max, are layouts.
TEST(RedistributeLocal, PartialsThatDoNotCommuteAreRefused) {
  const DeviceMesh mesh({1, world_size()}, {"a", "b"});
  tessera::testing::expect_error(
      [&] {
        DTensorSpec(mesh, {Partial(), Partial(ReduceOp::Max)}, {4, 4}, DType::Float32);
      },
      {"[P(sum), P(max)]", "no single value"});
  EXPECT_NO_THROW(DTensorSpec(mesh, {Partial(), Partial(ReduceOp::Avg)}, {4, 4}, DType::Float32));
  EXPECT_NO_THROW(
      DTensorSpec(mesh, {Partial(ReduceOp::Max), Partial(ReduceOp::Max)}, {4, 4}, DType::Float32));
}

// R -> P writes a copy: an in-place write to the Partial output leaves the Replicate input as it
// was on every rank (a sum's coordinate 0 used to hand back the input itself).
TEST(RedistributeLocal, ReplicateToPartialIsACopy) {
  const DeviceMesh mesh({world_size()}, {"x"});
  const Tensor global = dyadic_tensor({4, 6}, 10);
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
    DTensor x = distribute_tensor(global, mesh, {Replicate()});
    DTensor y = x.redistribute({Partial(op)});
    Tensor local = y.to_local();
    local.fill_(100.0);
    EXPECT_EQ(tensor_mismatch(x.to_local(), global), "") << reduce_op_name(op);
  }
}

// Steps on mesh dims of one rank only relabel: they copy nothing, and the output is still a
// tensor of its own (one copy in all), on one rank as on many.
TEST(RedistributeLocal, StepsOnMeshDimsOfOneRankCopyOnce) {
  const DeviceMesh mesh({1, 1, world_size()}, {"a", "b", "x"});
  const Tensor global = dyadic_tensor({6, 8}, 11);
  DTensor x = distribute_tensor(global, mesh, {Shard(0), Shard(1), Replicate()});
  const auto allocated_by = [](const std::function<void()>& f) {
    const int64_t before = memory_stats().total_allocated_bytes;
    f();
    return memory_stats().total_allocated_bytes - before;
  };
  DTensor y;
  const int64_t one_copy = allocated_by([&] { (void)x.to_local().clone(); });
  EXPECT_EQ(allocated_by([&] {
              y = x.redistribute({Replicate(), Replicate(), Replicate()});
            }),
            one_copy)
      << "two steps over one rank each made a copy";
  EXPECT_FALSE(y.to_local().storage().is_same(x.to_local().storage()));
  EXPECT_EQ(tensor_mismatch(y.to_local(), global), "");
  Tensor full = x.full_tensor();
  full.fill_(7.0);
  EXPECT_EQ(tensor_mismatch(x.to_local(), global), "") << "full_tensor() shared the DTensor's data";
}
