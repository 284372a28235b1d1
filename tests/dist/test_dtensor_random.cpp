// Shard-invariant random DTensors: on every mesh and placement (uneven and empty shards,
// StridedShard, Partial) the full tensor is bit for bit the single-process draw with the same
// seed and offset, each rank holds exactly its window of it, and the generator advances by the
// global numel on every rank, so successive draws stay in step too.
#include <gtest/gtest.h>

#include "tessera/tessera.h"
#include "tessera/testing.h"
#include "test_redistribute_reference.h"

using namespace tessera;
using namespace tessera::test_ref;

namespace {

const std::vector<Shape> kShapes = {{8, 12}, {7, 5}, {1, 9}, {3, 2}};
constexpr uint64_t kSeed = 20240611;
constexpr uint64_t kStartOffset = 977;  // not 0, so a draw that ignores the offset shows

std::vector<Placements> placements_for(const DeviceMesh& mesh) {
  const Placement S0 = Shard(0), S1 = Shard(1), R = Replicate(), P = Partial();
  switch (mesh.ndim()) {
    case 1:
      return {{R}, {S0}, {S1}, {P}};
    case 2:
      return {{R, R},  {S0, S1}, {S0, S0}, {S1, S1},
              {S1, R}, {P, S0},  {S0, P},  {StridedShard(0, mesh.size(1)), S0}};
    default:
      return {{S0, S0, S0}, {S0, S1, R}, {R, P, S1}, {StridedShard(0, 2), S1, S0}, {P, P, R}};
  }
}

bool off_partial(const Placements& p, const std::vector<int64_t>& coord) {
  for (size_t m = 0; m < p.size(); ++m)
    if (p[m].is_partial() && coord[m] != 0) return true;
  return false;
}

// Compares a distributed draw with the single-process one: the full tensor, this rank's piece
// (zeros off coordinate 0 of a partial mesh dim) and the dtype.
void check_draw(Failures& f, const std::string& what, const std::string& at, const DTensor& got,
                const Tensor& want) {
  f.check(what + " dtype", at, got.dtype() == want.dtype() ? "" : "dtype differs");
  f.check(what + " full_tensor", at, tensor_mismatch(got.full_tensor(), want));
  const std::vector<int64_t> coord = mesh_coordinate(world_rank(), got.mesh().shape());
  Tensor piece =
      cut_window(want.to(DType::Float64),
                 reference_window(want.shape(), got.mesh().shape(), coord, got.placements()));
  if (off_partial(got.placements(), coord)) piece.zero_();
  f.check(what + " local piece", at, tensor_mismatch(got.to_local(), piece));
}

void check_offset(Failures& f, const std::string& what, const std::string& at, const Generator& got,
                  uint64_t want) {
  f.check(what + " generator offset", at,
          got.offset() == want
              ? ""
              : "offset " + std::to_string(got.offset()) + ", want " + std::to_string(want));
}

template <class Body>
void for_each_case(Body&& body) {
  Failures f;
  for (const DeviceMesh& mesh : device_meshes())
    for (const Placements& p : placements_for(mesh))
      for (const Shape& shape : kShapes) {
        const std::string at = mesh.str() + " " + placements_str(p) + " " + shape_str(shape) +
                               " at " + coordinate_str(mesh_coordinate(world_rank(), mesh.shape()));
        f.check("draw", at, error_of([&] { body(f, mesh, p, shape, at); }));
      }
  f.summarize();
}

}  // namespace

TEST(DTensorRandom, RandAndRandnMatchTheSingleProcessDraw) {
  for_each_case([](Failures& f, const DeviceMesh& mesh, const Placements& p, const Shape& shape,
                   const std::string& at) {
    const uint64_t numel = uint64_t(shape_numel(shape));
    Generator gen(kSeed), ref(kSeed);
    gen.set_offset(kStartOffset);
    ref.set_offset(kStartOffset);
    DTensor u = rand(shape, mesh, p, gen);
    Tensor ru = rand(shape, ref);
    check_draw(f, "rand", at, u, ru);
    check_offset(f, "rand", at, gen, kStartOffset + numel);
    // A second draw from the advanced generator, in float64.
    DTensor n = randn(shape, mesh, p, gen, DType::Float64);
    Tensor rn = randn(shape, ref, DType::Float64);
    check_draw(f, "second draw (randn)", at, n, rn);
    check_offset(f, "randn", at, gen, kStartOffset + 2 * numel);
  });
}

TEST(DTensorRandom, InitialisersUseTheGlobalFans) {
  for_each_case([](Failures& f, const DeviceMesh& mesh, const Placements& p, const Shape& shape,
                   const std::string& at) {
    const uint64_t numel = uint64_t(shape_numel(shape));
    Generator gen(kSeed + 1), ref(kSeed + 1);
    gen.set_offset(kStartOffset);
    ref.set_offset(kStartOffset);
    DTensor k = distribute_tensor(zeros(shape), mesh, p);
    kaiming_uniform_(k, gen);
    Tensor rk = zeros(shape);
    kaiming_uniform_(rk, ref);
    check_draw(f, "kaiming_uniform_", at, k, rk);
    kaiming_uniform_(k, gen, 0.0, FanMode::FanOut);
    kaiming_uniform_(rk, ref, 0.0, FanMode::FanOut);
    check_draw(f, "kaiming_uniform_(fan_out)", at, k, rk);
    xavier_uniform_(k, gen);
    xavier_uniform_(rk, ref);
    check_draw(f, "xavier_uniform_", at, k, rk);
    check_offset(f, "initialisers", at, gen, kStartOffset + 3 * numel);
    check_offset(f, "reference", at, ref, kStartOffset + 3 * numel);
  });
}

// The generator is the only state: a fresh one at the same (seed, offset) repeats a draw, and
// a draw on one layout equals the same draw on another after redistribution.
TEST(DTensorRandom, SameStateSameDrawOnAnyLayout) {
  for (const DeviceMesh& mesh : device_meshes()) {
    const std::vector<Placements> lists = placements_for(mesh);
    Placements rep(size_t(mesh.ndim()), Replicate());
    Generator first(kSeed + 2);
    first.set_offset(kStartOffset);
    const Tensor want = rand({7, 5}, mesh, rep, first, DType::Float64).to_local().clone();
    for (const Placements& p : lists) {
      Generator gen(kSeed + 2);
      gen.set_offset(kStartOffset);
      DTensor d = rand({7, 5}, mesh, p, gen, DType::Float64);
      EXPECT_EQ(tensor_mismatch(d.redistribute(rep).to_local(), want), "")
          << mesh.str() << " " << placements_str(p);
    }
  }
}

// Generators in different states (seeded by rank, or one rank having drawn more) would give each
// rank a window of a different draw: every rank fails instead, naming the states.
TEST(DTensorRandom, RanksWithDifferentGeneratorStatesFailTogether) {
  if (world_size() == 1) GTEST_SKIP() << "one rank cannot disagree with itself";
  DeviceMesh mesh({world_size()}, {"x"});
  Generator by_rank(kSeed + uint64_t(world_rank()));
  tessera::testing::expect_error(
      [&] {
        rand({4, 3}, mesh, {Replicate()}, by_rank);
      },
      {"rand on a DTensor over DeviceMesh(x=", "different generator states",
       "seed " + std::to_string(kSeed) + " to "});
  Generator ahead(kSeed);
  if (world_rank() == 1) ahead.set_offset(12);
  DTensor t = distribute_tensor(zeros({4, 3}), mesh, {Shard(0)});
  tessera::testing::expect_error([&] { normal_(t, 0.0, 1.0, ahead); },
                                 {"normal_ on a DTensor", "offset 0 to 12"});
  // The same state on every rank is fine, and the check moves no generator.
  Generator same(kSeed);
  EXPECT_NO_THROW(rand({4, 3}, mesh, {Replicate()}, same));
  EXPECT_EQ(same.offset(), 12u);
}

// On a mesh of two dims, ranks whose line along the first dim agrees and ranks whose line does
// not fail together too, none left waiting in the second dim's check for the others.
TEST(DTensorRandom, RanksWithDifferentGeneratorStatesFailTogetherOnATwoDimMesh) {
  if (world_size() != 4) GTEST_SKIP() << "a 2 x 2 mesh";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  Generator ahead(kSeed);
  if (world_rank() == 0) ahead.set_offset(12);  // rank 0's dp line {0, 2} disagrees, {1, 3} not
  tessera::testing::expect_error(
      [&] {
        rand({4, 4}, mesh, {Shard(0), Shard(1)}, ahead);
      },
      {"rand on a DTensor over DeviceMesh(dp=2, tp=2", "different generator states",
       "offset 0 to 12"});
}

TEST(DTensorRandom, BadArgumentsAreRefusedOnEveryRankBeforeTheGeneratorMoves) {
  DeviceMesh mesh({world_size()}, {"x"});
  DTensor t = distribute_tensor(zeros({5, 3}), mesh, {Shard(0)});
  Generator gen(kSeed);
  tessera::testing::expect_error([&] { uniform_(t, 1.0, -1.0, gen); },
                                 {"uniform_: expects a [low, high) range", "low=1, high=-1"});
  tessera::testing::expect_error([&] { normal_(t, 0.0, -2.0, gen); },
                                 {"normal_: expects std >= 0"});
  EXPECT_EQ(gen.offset(), 0u);
  DTensor none = distribute_tensor(zeros({4, 0}), mesh, {Shard(0)});
  EXPECT_NO_THROW(kaiming_uniform_(none, gen));
  EXPECT_EQ(gen.offset(), 0u);
}
