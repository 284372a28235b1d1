// vocab_parallel_cross_entropy's cross-rank agreement: every rank of the logits' mesh checks
// that it passes the same targets, weight and options, at the cost the tests count. Part of the
// test_vocab_parallel_loss binary.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dist/vocab_parallel_util.h"
#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::expect_close;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;
using tessera::testing::targets;

// Sharded logits with Replicate mesh dims besides the vocabulary's: ranks that differ only along
// a Replicate dim share no vocabulary group, yet each returns the loss marked Replicate over it,
// so they agree too. The odd ones are a whole slice along the Replicate dim (each vocabulary
// group within itself consistent): a target, weight or option that differs there fails every
// rank, rather than the two slices each computing another loss. On a (2, 1, 2) world the logits'
// mesh is the 2-rank sub-mesh (a, b), which spans no world group of its own.
TEST(VocabParallelLoss, ShardedLogitsAgreeAlongTheirReplicateMeshDims) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const Tensor full = random_tensor({4, 13}, 16, DType::Float64);
  const Tensor good = from_vector<int64_t>({0, 3, 2, 1}, {4});
  const Tensor weight = add(random_tensor({13}, 17, DType::Float64), 1.0);
  const DeviceMesh m2(Shape{2, 2}, {"dp", "tp"});
  const DeviceMesh m3(Shape{2, 1, 2}, {"a", "b", "c"});
  struct Case {
    DeviceMesh mesh;
    Placements placements;
    int64_t replicate_dim;
  };
  const std::vector<Case> cases = {
      {m2, {Replicate(), Shard(-1)}, 0},
      {m2, {Shard(-1), Replicate()}, 1},
      {m3[std::vector<std::string>{"a", "b"}], {Replicate(), Shard(-1)}, 0}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.mesh.str() + " " + placements_str(c.placements));
    const DTensor logits = distribute_tensor(full, c.mesh, c.placements);
    const bool odd = c.mesh.coordinate()[size_t(c.replicate_dim)] == 1;
    const auto loss_with = [&](const Tensor& t, const Tensor& w, double eps = 0.0) {
      return vocab_parallel_cross_entropy(logits, t, -100, kernels::Reduction::Mean, eps, w);
    };
    expect_error(
        [&] {
          loss_with(from_vector<int64_t>({0, 3, 2, odd ? 1 : 4}, {4}), weight);
        },
        "the ranks of " + c.mesh.str() + " pass different targets");
    expect_error([&] { loss_with(good, odd ? add(weight, 1.0) : weight); },
                 "the ranks of " + c.mesh.str() + " pass different class weights");
    expect_error([&] { loss_with(good, odd ? Tensor() : weight); },
                 {"pass different class weights", odd ? "this rank: none" : "this rank: a weight"});
    expect_error([&] { loss_with(good, weight, odd ? 0.2 : 0.1); },
                 {"pass different ignore_index, reduction or label_smoothing",
                  odd ? "label_smoothing 0.2" : "label_smoothing 0.1"});
    expect_error(
        [&] {
          loss_with(from_vector<int64_t>({0, odd ? 13 : 3, 2, 1}, {4}), weight);
        },
        odd ? "target 13 at row 1 is out of range" : "another rank's target is out of range");
    // Afterwards the loss runs (no collective was left half done).
    expect_close(loss_with(good, weight).to_local(),
                 cross_entropy(full, good, -100, kernels::Reduction::Mean, 0.0, weight), 1e-12,
                 "weighted loss after the errors");
  }
}

// What one call costs in collectives, forward and backward: the agreement is one all-reduce over
// every rank of the logits' mesh (the mesh's own group on one dim, the world's when the mesh
// spans it), then the row max and the row statistics over each vocabulary mesh dim, with or
// without a weight and smoothing. Only a mesh of several dims that spans no group (a sub-mesh of
// a larger world) agrees one mesh dim at a time.
TEST(VocabParallelLoss, CollectivesPerCall) {
  const Tensor full = random_tensor({4, 13}, 18, DType::Float64);
  const Tensor target = from_vector<int64_t>({0, 3, -100, 1}, {4});
  const Tensor weight = add(random_tensor({13}, 19, DType::Float64), 1.0);
  struct Case {
    DeviceMesh mesh;
    Placements placements;
    int64_t all_reduces;
  };
  const DeviceMesh tp(Shape{world_size()}, {"tp"});
  std::vector<Case> cases = {{tp, {Shard(-1)}, 3}, {tp, {Replicate()}, 1}};
  if (world_size() == 4) {
    const DeviceMesh m2(Shape{2, 2}, {"dp", "tp"});
    cases.push_back({m2, {Replicate(), Shard(-1)}, 3});
    cases.push_back({m2, {Shard(-1), Replicate()}, 3});
    cases.push_back({m2, {Shard(-1), Shard(-1)}, 5});
    cases.push_back({m2, {Replicate(), Replicate()}, 1});
    const DeviceMesh m3(Shape{2, 1, 2}, {"a", "b", "c"});
    cases.push_back({m3[std::vector<std::string>{"a", "b"}], {Replicate(), Shard(-1)}, 4});
  }
  for (const Case& c : cases) {
    for (const bool weighted : {false, true}) {
      const std::string what = c.mesh.str() + " " + placements_str(c.placements) +
                               (weighted ? " weighted, smoothed" : "");
      DTensor logits = distribute_tensor(full, c.mesh, c.placements);
      logits.set_requires_grad(true);
      world_group()->barrier()->wait();
      reset_comm_op_counts();
      const DTensor loss = weighted
                               ? vocab_parallel_cross_entropy(logits, target, -100,
                                                              kernels::Reduction::Mean, 0.1, weight)
                               : vocab_parallel_cross_entropy(logits, target);
      backward(loss.to_local());
      const auto counts = comm_op_counts();
      int64_t total = 0;
      for (const auto& [op, n] : counts)
        total += n;
      EXPECT_EQ(counts.count("all_reduce") ? counts.at("all_reduce") : 0, c.all_reduces) << what;
      EXPECT_EQ(total, c.all_reduces) << what;
    }
  }
}
