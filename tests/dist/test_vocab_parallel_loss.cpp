// Loss-parallel cross-entropy against plain cross_entropy on the full logits, on every world size
// (uneven and empty vocabulary shards, ignored rows, nested shards on a 2-D mesh); and the
// decoder under the tensor-parallel plan, whose attention must find its local heads from its
// local weights at every degree.
#include <gtest/gtest.h>

#include <cmath>
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

namespace {

Tensor full_like_scalar(double v, DType dtype) {
  return full({}, v, TensorOptions(dtype));
}

struct MeshCase {
  DeviceMesh mesh;
  Placements placements;
};

std::vector<MeshCase> mesh_cases() {
  const int n = world_size();
  DeviceMesh tp(Shape{n}, {"tp"});
  std::vector<MeshCase> out = {{tp, {Shard(-1)}}, {tp, {Replicate()}}};
  if (n == 4) {
    DeviceMesh m2(Shape{2, 2}, {"dp", "tp"});
    out.push_back({m2, {Replicate(), Shard(-1)}});
    out.push_back({m2, {Shard(-1), Replicate()}});
    out.push_back({m2, {Shard(-1), Shard(-1)}});  // nested: four vocabulary slices
  }
  return out;
}

// Loss and logits gradient of the vocab-parallel loss against the plain loss on one rank.
void check_against_plain(const Shape& shape, DType dtype, int64_t ignore_index, double tol,
                         kernels::Reduction reduction = kernels::Reduction::Mean,
                         double label_smoothing = 0.0, bool weighted = false) {
  const int64_t vocab = shape.back();
  // Positive class weights of the logits' dtype, unlike one another, so that a slice taken at the
  // wrong offset shows.
  const Tensor weight =
      weighted ? add(random_tensor({vocab}, 37, DType::Float64).to(dtype), 1.5) : Tensor();
  Shape rows(shape.begin(), shape.end() - 1);
  Tensor full = random_tensor(shape, 31, dtype).to(dtype);
  Tensor target = targets(rows, vocab, ignore_index, 32);
  // A gradient that differs per row, so a per-row loss's backward shows any row mixed up.
  const Tensor upstream = reduction == kernels::Reduction::None
                              ? random_tensor(rows, 33, dtype).to(dtype)
                              : full_like_scalar(1.75, dtype);
  const Shape loss_shape = reduction == kernels::Reduction::None ? rows : Shape{};

  Tensor ref_in = full.clone().set_requires_grad(true);
  Tensor ref = cross_entropy(ref_in, target, ignore_index, reduction, label_smoothing, weight);
  backward(sum(mul(ref, upstream)));

  for (const MeshCase& mc : mesh_cases()) {
    const std::string what = "logits " + shape_str(shape) + " " + dtype_name(dtype) + " on " +
                             mc.mesh.str() + " " + placements_str(mc.placements) +
                             " label_smoothing " + std::to_string(label_smoothing) +
                             (weighted ? " weighted" : "");
    DTensor logits = distribute_tensor(full, mc.mesh, mc.placements);
    logits.set_requires_grad(true);
    DTensor loss = vocab_parallel_cross_entropy(logits, target, ignore_index, reduction,
                                                label_smoothing, weight);
    EXPECT_EQ(loss.shape(), loss_shape) << what;
    EXPECT_EQ(loss.placements(), Placements(mc.placements.size(), Replicate())) << what;
    EXPECT_EQ(loss.dtype(), dtype) << what;
    expect_close(loss.to_local(), ref.detach(), tol, what + ": loss");
    backward(sum(mul(loss.to_local(), upstream)));
    ASSERT_TRUE(logits.grad().defined()) << what;
    EXPECT_EQ(logits.grad().placements(), logits.placements()) << what;
    expect_close(logits.grad().full_tensor(), ref_in.grad(), tol, what + ": grad");
  }
}

}  // namespace

TEST(VocabParallelLoss, MatchesPlainCrossEntropyWithUnevenVocabulary) {
  // 13 classes: 7,6 / 5,5,3 / 4,4,4,1 per rank.
  check_against_plain({3, 5, 13}, DType::Float64, -100, 1e-12);
  check_against_plain({4, 13}, DType::Float32, -100, 1e-5);
}

TEST(VocabParallelLoss, SumAndPerRowReductionsMatchPlainCrossEntropy) {
  for (kernels::Reduction r : {kernels::Reduction::Sum, kernels::Reduction::None}) {
    check_against_plain({3, 5, 13}, DType::Float64, -100, 1e-12, r);
    check_against_plain({4, 13}, DType::Float32, -100, 1e-5, r);
    check_against_plain({6, 3}, DType::Float64, -1, 1e-12, r);  // an empty slice at 4 ranks
  }
}

// label_smoothing as the plain loss's (itself checked against PyTorch's closed form), loss and
// gradient, with uneven and empty vocabulary slices.
TEST(VocabParallelLoss, LabelSmoothingMatchesPlainCrossEntropy) {
  for (kernels::Reduction r :
       {kernels::Reduction::Mean, kernels::Reduction::Sum, kernels::Reduction::None}) {
    for (double eps : {0.1, 1.0}) {
      check_against_plain({3, 5, 13}, DType::Float64, -100, 1e-12, r, eps);
      check_against_plain({4, 13}, DType::Float32, -100, 1e-5, r, eps);
      check_against_plain({6, 3}, DType::Float64, -1, 1e-12, r, eps);
    }
  }
  const DeviceMesh tp(Shape{world_size()}, {"tp"});
  const DTensor logits =
      distribute_tensor(random_tensor({2, 5}, 34, DType::Float64), tp, {Shard(-1)});
  expect_error(
      [&] {
        vocab_parallel_cross_entropy(logits, from_vector<int64_t>({0, 1}, {2}), -100,
                                     kernels::Reduction::Mean, 1.5);
      },
      "label_smoothing must be in [0, 1], got 1.5");
}

// Class weights as the plain loss's (PyTorch's): each row scaled by weight[target], a mean over
// the kept rows' weights, the smoothing term weighted per class; loss and gradient, with ignored
// rows, uneven and empty vocabulary slices and nested shards.
TEST(VocabParallelLoss, ClassWeightsMatchPlainCrossEntropy) {
  for (kernels::Reduction r :
       {kernels::Reduction::Mean, kernels::Reduction::Sum, kernels::Reduction::None}) {
    for (double eps : {0.0, 0.1, 1.0}) {
      check_against_plain({3, 5, 13}, DType::Float64, -100, 1e-12, r, eps, true);
      check_against_plain({4, 13}, DType::Float32, -100, 1e-5, r, eps, true);
      check_against_plain({6, 3}, DType::Float64, -1, 1e-12, r, eps, true);
      check_against_plain({2, 2, 2}, DType::Float64, 0, 1e-12, r, eps, true);
    }
  }
}

// A weight that cannot be the whole vocabulary's, or that differs between the ranks (given on
// one only, or another value on one), fails every rank before the loss's first all-reduce.
TEST(VocabParallelLoss, ClassWeightsMustBeGlobalAndAgreed) {
  DeviceMesh mesh(Shape{world_size()}, {"tp"});
  DTensor logits = distribute_tensor(random_tensor({4, 13}, 12, DType::Float64), mesh, {Shard(1)});
  const Tensor good = from_vector<int64_t>({0, 3, 2, 1}, {4});
  const Tensor weight = add(random_tensor({13}, 13, DType::Float64), 1.0);
  const auto loss_with = [&](const Tensor& w) {
    return vocab_parallel_cross_entropy(logits, good, -100, kernels::Reduction::Mean, 0.0, w);
  };
  expect_error([&] { loss_with(zeros({5}, DType::Float64)); },
               "weight of shape [5] must hold one weight per class of the global logits [4, 13]");
  expect_error([&] { loss_with(weight.to(DType::Float32)); }, "must have the logits' dtype");
  expect_error([&] { loss_with(weight.clone().set_requires_grad(true)); },
               "class weights receive no gradient");
  if (world_size() > 1) {
    const bool last = world_rank() == world_size() - 1;
    expect_error([&] { loss_with(last ? Tensor() : weight); },
                 {"the ranks of " + mesh.str() + " pass different class weights",
                  last ? "this rank: none" : "this rank: a weight"});
    expect_error([&] { loss_with(last ? add(weight, 1.0) : weight); },
                 "the ranks of " + mesh.str() + " pass different class weights");
    expect_error([&] { loss_with(last ? zeros({5}, DType::Float64) : weight); },
                 last ? "weight of shape [5] must hold one weight per class"
                      : "another rank's target is out of range");
  }
  // Afterwards the loss runs (no collective was left half done).
  expect_close(
      loss_with(weight).to_local(),
      cross_entropy(logits.full_tensor(), good, -100, kernels::Reduction::Mean, 0.0, weight), 1e-12,
      "weighted loss after the errors");
}

// Whether a rank passes a weight is agreed on its own, not read from the weight's digest: an
// empty weight (a vocabulary of no classes, every row ignored) has the digest of no bytes, yet
// one rank passing it while the others pass none still fails every rank.
TEST(VocabParallelLoss, AWeightIsAgreedOnEvenWhenItHoldsNothing) {
  if (world_size() == 1) GTEST_SKIP() << "needs several ranks";
  const DeviceMesh mesh(Shape{world_size()}, {"tp"});
  const Tensor ignored = from_vector<int64_t>({-100, -100}, {2});
  const bool last = world_rank() == world_size() - 1;
  for (const Placements& placements : {Placements{Shard(-1)}, Placements{Replicate()}}) {
    SCOPED_TRACE(placements_str(placements));
    const DTensor logits = distribute_tensor(zeros({2, 0}, DType::Float64), mesh, placements);
    expect_error(
        [&] {
          vocab_parallel_cross_entropy(logits, ignored, -100, kernels::Reduction::Sum, 0.0,
                                       last ? zeros({0}, DType::Float64) : Tensor());
        },
        {"the ranks of " + mesh.str() + " pass different class weights",
         last ? "this rank: a weight" : "this rank: none"});
    const Tensor weight = zeros({0}, DType::Float64);
    expect_close(
        vocab_parallel_cross_entropy(logits, ignored, -100, kernels::Reduction::Sum, 0.0, weight)
            .to_local(),
        zeros({}, DType::Float64), 0.0, "no classes, every row ignored");
  }
}

// Logits without a vocabulary-sharded mesh dim (every rank holds the whole vocabulary) take the
// plain loss, but the ranks still agree first, over every mesh dim: a weight, target or option
// that differs on one rank fails every rank rather than giving each rank another "replicated"
// loss. On a (2, 2) mesh the odd one is rank 0, so that the ranks outside its first dim's group
// must learn of it too.
TEST(VocabParallelLoss, ReplicatedLogitsAgreeAsShardedOnes) {
  if (world_size() == 1) GTEST_SKIP() << "needs several ranks";
  const Tensor full = random_tensor({4, 13}, 14, DType::Float64);
  const Tensor good = from_vector<int64_t>({0, 3, 2, 1}, {4});
  const Tensor weight = add(random_tensor({13}, 15, DType::Float64), 1.0);
  std::vector<MeshCase> cases = {{DeviceMesh(Shape{world_size()}, {"tp"}), {Replicate()}}};
  if (world_size() == 4)
    cases.push_back({DeviceMesh(Shape{2, 2}, {"a", "b"}), {Replicate(), Replicate()}});
  for (const MeshCase& mc : cases) {
    SCOPED_TRACE(mc.mesh.str());
    const DTensor logits = distribute_tensor(full, mc.mesh, mc.placements);
    const bool odd = mc.mesh.ndim() == 2 ? world_rank() == 0 : world_rank() == world_size() - 1;
    const auto loss_with = [&](const Tensor& t, const Tensor& w, double eps = 0.0) {
      return vocab_parallel_cross_entropy(logits, t, -100, kernels::Reduction::Mean, eps, w);
    };
    const std::string weights = "the ranks of " + mc.mesh.str() + " pass different class weights";
    expect_error([&] { loss_with(good, odd ? add(weight, 1.0) : weight); }, weights);
    expect_error([&] { loss_with(good, odd ? Tensor() : weight); },
                 {weights, odd ? "this rank: none" : "this rank: a weight"});
    expect_error(
        [&] {
          loss_with(from_vector<int64_t>({0, 3, 2, odd ? 1 : 4}, {4}), weight);
        },
        "the ranks of " + mc.mesh.str() + " pass different targets");
    expect_error([&] { loss_with(good, weight, odd ? 0.2 : 0.1); },
                 "pass different ignore_index, reduction or label_smoothing");
    expect_error(
        [&] {
          loss_with(from_vector<int64_t>({0, odd ? 13 : 3, 2, 1}, {4}), weight);
        },
        odd ? "target 13 at row 1 is out of range" : "another rank's target is out of range");
    // Afterwards the loss runs (no collective was left half done), as the plain loss.
    const DTensor loss = loss_with(good, weight);
    EXPECT_EQ(loss.placements(), Placements(mc.placements.size(), Replicate()));
    expect_close(loss.to_local(),
                 cross_entropy(full, good, -100, kernels::Reduction::Mean, 0.0, weight), 0.0,
                 "replicated weighted loss after the errors");
  }
}

// int32 class indices are int64's, as in the plain cross_entropy: loss and gradient, sharded and
// replicated, smoothed or not.
TEST(VocabParallelLoss, Int32TargetsAreInt64s) {
  const Tensor full = random_tensor({2, 3, 13}, 35, DType::Float64);
  const Tensor target = targets({2, 3}, 13, -100, 36);
  for (const MeshCase& mc : mesh_cases()) {
    for (double eps : {0.0, 0.2}) {
      std::vector<Tensor> losses, grads;
      for (DType dt : {DType::Int64, DType::Int32}) {
        DTensor logits = distribute_tensor(full, mc.mesh, mc.placements);
        logits.set_requires_grad(true);
        const DTensor loss = vocab_parallel_cross_entropy(logits, target.to(dt), -100,
                                                          kernels::Reduction::Mean, eps);
        backward(loss.to_local());
        losses.push_back(loss.to_local());
        grads.push_back(logits.grad().full_tensor());
      }
      expect_close(losses[1], losses[0], 0.0, "int32 loss");
      expect_close(grads[1], grads[0], 0.0, "int32 grad");
      expect_close(
          losses[1],
          cross_entropy(full, target.to(DType::Int32), -100, kernels::Reduction::Mean, eps), 1e-12,
          "int32 against the plain loss");
    }
  }
}

TEST(VocabParallelLoss, EmptyVocabularyShardsAndCustomIgnoreIndex) {
  // 3 classes over 4 ranks leaves the last rank an empty slice.
  check_against_plain({6, 3}, DType::Float64, -1, 1e-12);
  check_against_plain({2, 2, 2}, DType::Float64, 0, 1e-12);  // class 0 is the ignored one
}

TEST(VocabParallelLoss, LargeLogitsStayFinite) {
  // Far beyond exp's range: only the shared max keeps the sum finite.
  Tensor full = kernels::binary_scalar(kernels::BinaryOp::Mul,
                                       random_tensor({5, 9}, 3, DType::Float64), 800.0);
  Tensor target = targets({5}, 9, -100, 4);
  Tensor ref = cross_entropy(full, target);
  DeviceMesh mesh(Shape{world_size()}, {"tp"});
  DTensor loss = vocab_parallel_cross_entropy(distribute_tensor(full, mesh, {Shard(1)}), target);
  ASSERT_TRUE(std::isfinite(loss.to_local().item<double>()));
  expect_close(loss.to_local(), ref, 1e-12, "large logits");
}

TEST(VocabParallelLoss, AllRowsIgnoredIsNanLikeCrossEntropy) {
  Tensor full = random_tensor({3, 7}, 5, DType::Float64);
  Tensor target = full_like(zeros({3}, DType::Int64), -100);
  DeviceMesh mesh(Shape{world_size()}, {"tp"});
  DTensor logits = distribute_tensor(full, mesh, {Shard(1)});
  logits.set_requires_grad(true);
  DTensor loss = vocab_parallel_cross_entropy(logits, target);
  EXPECT_TRUE(std::isnan(loss.to_local().item<double>()));
  EXPECT_TRUE(std::isnan(cross_entropy(full, target).item<double>()));
  backward(loss.to_local());
  for (double g : logits.grad().to_local().to_vector<double>())
    EXPECT_EQ(g, 0.0);
}

TEST(VocabParallelLoss, ErrorsNameTheProblem) {
  DeviceMesh mesh(Shape{world_size()}, {"tp"});
  Tensor full = random_tensor({4, 13}, 6, DType::Float64);
  DTensor logits = distribute_tensor(full, mesh, {Shard(1)});
  Tensor target = targets({4}, 13, -100, 7);
  expect_error([&] { vocab_parallel_cross_entropy(logits, targets({5}, 13, -100, 7)); },
               "target [5] does not match logits [4, 13] (expected [4]");
  expect_error([&] { vocab_parallel_cross_entropy(logits, target.to(DType::Float32)); },
               "target must be int64 or int32 class indices, got");
  expect_error(
      [&] {
        vocab_parallel_cross_entropy(logits, from_vector<int64_t>({0, 13, 2, 1}, {4}));
      },
      "target 13 at row 1 is out of range for a vocabulary of 13");
  expect_error(
      [&] { vocab_parallel_cross_entropy(distribute_tensor(full, mesh, {Shard(0)}), target); },
      "every mesh dim must be Replicate or Shard(-1)");
  DTensor partial = DTensor::from_local(full, mesh, {Partial()});
  expect_error([&] { vocab_parallel_cross_entropy(partial, target); }, "redistribute Partial");
}

// Targets that differ between the ranks of the logits' mesh (a data-loader bug): an
// out-of-range one on the last rank only, different rows, or another shape on one rank, fail
// every rank before the loss's first all-reduce, which the others would otherwise wait in.
TEST(VocabParallelLoss, RanksWithDifferentTargetsFailTogether) {
  if (world_size() == 1) GTEST_SKIP() << "needs several ranks";
  DeviceMesh mesh(Shape{world_size()}, {"tp"});
  DTensor logits = distribute_tensor(random_tensor({4, 13}, 10, DType::Float64), mesh, {Shard(1)});
  const bool last = world_rank() == world_size() - 1;
  expect_error(
      [&] {
        vocab_parallel_cross_entropy(logits, from_vector<int64_t>({0, last ? 13 : 3, 2, 1}, {4}));
      },
      last ? "target 13 at row 1 is out of range" : "another rank's target is out of range");
  expect_error(
      [&] {
        vocab_parallel_cross_entropy(logits,
                                     from_vector<int64_t>({0, 3, 2, int64_t(world_rank())}, {4}));
      },
      "the ranks of " + mesh.str() + " pass different targets");
  // A target of another shape on the last rank only (its last batch short): every rank fails.
  expect_error(
      [&] { vocab_parallel_cross_entropy(logits, targets({last ? 3 : 4}, 13, -100, 7)); },
      last ? "target [3] does not match logits [4, 13]"
           : "another rank's target is out of range, or not an int64 or int32 tensor of the "
             "logits' rows");
  // An argument refused on the last rank only, or arguments that differ: every rank fails.
  const Tensor good = from_vector<int64_t>({0, 3, 2, 1}, {4});
  expect_error(
      [&] {
        vocab_parallel_cross_entropy(logits, good, -100, kernels::Reduction::Mean,
                                     last ? 1.5 : 0.1);
      },
      last ? "label_smoothing must be in [0, 1], got 1.5"
           : "another rank's target is out of range");
  const std::string theirs = "the ranks of " + mesh.str() +
                             " pass different ignore_index, "
                             "reduction or label_smoothing (this rank: ignore_index ";
  expect_error(
      [&] {
        vocab_parallel_cross_entropy(logits, good, -100, kernels::Reduction::Mean,
                                     last ? 0.2 : 0.1);
      },
      {theirs, last ? "label_smoothing 0.2" : "label_smoothing 0.1"});
  expect_error(
      [&] {
        vocab_parallel_cross_entropy(logits, good, -100,
                                     last ? kernels::Reduction::Sum : kernels::Reduction::Mean);
      },
      {theirs, last ? "reduction sum" : "reduction mean"});
  expect_error([&] { vocab_parallel_cross_entropy(logits, good, last ? -1 : -100); },
               {theirs, last ? "ignore_index -1," : "ignore_index -100,"});
  // Afterwards the loss runs (no collective was left half done).
  EXPECT_TRUE(vocab_parallel_cross_entropy(logits, good).to_local().defined());
}

// The vocabulary split over both dims of a (2, 2) mesh: a bad target on rank 0 fails all four,
// also the ranks that share no mesh-dim group with rank 0's first dim.
TEST(VocabParallelLoss, ABadTargetFailsEveryRankOfATwoDimVocabularySplit) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh(Shape{2, 2}, {"a", "b"});
  DTensor logits =
      distribute_tensor(random_tensor({4, 13}, 11, DType::Float64), mesh, {Shard(1), Shard(1)});
  const bool first = world_rank() == 0;
  expect_error(
      [&] {
        vocab_parallel_cross_entropy(logits, from_vector<int64_t>({0, first ? 13 : 3, 2, 1}, {4}));
      },
      first ? "target 13 at row 1 is out of range" : "another rank's target is out of range");
  EXPECT_TRUE(vocab_parallel_cross_entropy(logits, from_vector<int64_t>({0, 3, 2, 1}, {4}))
                  .to_local()
                  .defined());
}

// Logits wrapped by from_local without their global shape, on a vocabulary that does not split
// evenly: each rank guesses another size, and all must fail together (one alone would leave the
// others waiting in the loss's collectives).
TEST(VocabParallelLoss, RanksGuessingDifferentVocabularySizesFailTogether) {
  DeviceMesh mesh(Shape{world_size()}, {"tp"});
  if (world_size() == 1 || 13 % world_size() == 0) GTEST_SKIP() << "the vocabulary splits evenly";
  Tensor full = random_tensor({4, 13}, 8, DType::Float64);
  Tensor local = distribute_tensor(full, mesh, {Shard(1)}).to_local();
  DTensor guessed = DTensor::from_local(local, mesh, {Shard(1)});
  expect_error([&] { vocab_parallel_cross_entropy(guessed, targets({4}, 13, -100, 9)); },
               "the ranks disagree on the vocabulary size");
}

// Under the tensor-parallel plan wq/wk/wv hand the attention a slice of the heads and wo sums
// the ranks' outputs: the attention must find its local head counts from the local weights and
// give the unsplit module's output and gradients at every degree.
TEST(DecoderTensorParallel, AttentionDerivesLocalHeadsFromLocalWeights) {
  const int n = world_size();
  DeviceMesh mesh(Shape{n}, {"tp"});
  DecoderConfig c;
  c.dim = 48;
  c.n_heads = 24;  // head_dim 2; 12 kv heads split evenly over 1-4 ranks
  c.max_seq_len = 8;
  for (int64_t kv_heads : {int64_t(12), int64_t(24)}) {
    c.n_kv_heads = kv_heads;
    const std::string what =
        "attention split " + std::to_string(n) + " ways, " + std::to_string(kv_heads) + " kv heads";
    Generator g1(4), g2(4);
    auto full = std::make_shared<Attention>(c, g1);
    auto split = std::make_shared<Attention>(c, g2);
    auto col = std::make_shared<ColwiseParallel>();
    auto row = std::make_shared<RowwiseParallel>();
    parallelize_module(split, mesh, {{"wq", col}, {"wk", col}, {"wv", col}, {"wo", row}});
    ASSERT_TRUE(split->wq->weight.is_dtensor()) << what;
    EXPECT_EQ(split->wk->weight.local().size(0), kv_heads * 2 / n) << what;

    Tensor xg = random_tensor({2, 5, 48}, 8, DType::Float32);
    Tensor xf = xg.clone().set_requires_grad(true), xs = xg.clone().set_requires_grad(true);
    Tensor w = random_tensor({2, 5, 48}, 9, DType::Float32);
    Tensor yf = (*full)(xf), ys = (*split)(xs);
    expect_close(ys, yf, 1e-5, what + ": output");
    backward(sum(mul(yf, w)));
    backward(sum(mul(ys, w)));
    expect_close(xs.grad(), xf.grad(), 1e-5, what + ": input grad");
    auto fp = full->named_parameters(), sp = split->named_parameters();
    ASSERT_EQ(fp.size(), sp.size());
    for (size_t i = 0; i < fp.size(); ++i)
      expect_close(sp[i].second->grad_dtensor().full_tensor(), fp[i].second->grad(), 1e-5,
                   what + ": grad of " + fp[i].first);
  }
}

// The whole decoder under the tensor-parallel plan with loss parallelism: the logits stay
// sharded on an uneven vocabulary and the loss-parallel cross-entropy gives the single-rank loss
// and gradients.
TEST(DecoderTensorParallel, LossParallelDecoderMatchesSingleRank) {
  const int n = world_size();
  DeviceMesh mesh(Shape{n}, {"tp"});
  DecoderConfig c;
  c.vocab_size = 13;
  c.dim = 48;
  c.n_layers = 2;
  c.n_heads = 24;
  c.n_kv_heads = 12;
  c.ffn_dim = 24;
  c.max_seq_len = 8;
  c.seed = 3;
  auto full = std::make_shared<Decoder>(c);
  auto split = std::make_shared<Decoder>(c);
  DecoderTPOptions opts;
  opts.loss_parallel = true;
  parallelize_module(split, mesh, decoder_tp_plan(c, mesh, opts));

  Tensor ids = from_vector<int64_t>({1, 5, 12, 0, 7, 7, 3, 2, 9, 11, 4, 6}, {2, 6});
  Tensor target = from_vector<int64_t>({5, 12, 0, 7, -100, 3, 2, 9, -100, 4, 6, 1}, {2, 6});
  Tensor ref = cross_entropy((*full)(ids), target);
  Tensor local_logits = (*split)(ids);
  EXPECT_EQ(local_logits.size(2), chunk_of(13, n, mesh.local_rank(0)).length);
  DTensor logits = DTensor::from_local(local_logits, mesh, {Shard(2)}, Shape{2, 6, 13});
  DTensor loss = vocab_parallel_cross_entropy(logits, target);
  expect_close(loss.to_local(), ref.detach(), 1e-5, "decoder loss");
  backward(ref);
  backward(loss.to_local());
  auto fp = full->named_parameters(), sp = split->named_parameters();
  ASSERT_EQ(fp.size(), sp.size());
  for (size_t i = 0; i < fp.size(); ++i) {
    ASSERT_EQ(fp[i].first, sp[i].first);
    Tensor g = sp[i].second->is_dtensor() ? sp[i].second->grad_dtensor().full_tensor()
                                          : sp[i].second->grad();
    expect_close(g, fp[i].second->grad(), 1e-4, "grad of " + fp[i].first);
  }
}

TEST(DecoderTensorParallel, TiedEmbeddingsMustStayReplicated) {
  DecoderConfig c;
  c.vocab_size = 10;
  c.dim = 8;
  c.n_layers = 1;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.ffn_dim = 8;
  c.tie_embeddings = true;
  auto dec = std::make_shared<Decoder>(c);
  DeviceMesh mesh(Shape{world_size()}, {"tp"});
  Tensor ids = from_vector<int64_t>({1, 2, 3, 4}, {1, 4});
  Tensor want = (*dec)(ids).detach();
  Tensor table = dec->tok_embeddings->weight.full();
  // Replicated: the same logits.
  dec->tok_embeddings->weight = Parameter(distribute_tensor(table, mesh, {Replicate()}));
  EXPECT_EQ((*dec)(ids).detach().to_vector<float>(), want.to_vector<float>());
  // Sharded on the vocabulary: the lookup runs vocab-parallel (the Embedding's DTensor path),
  // but the tied projection refuses the sharded table.
  dec->tok_embeddings->weight = Parameter(distribute_tensor(table, mesh, {Shard(0)}));
  dec->tok_embeddings->set_dtensor_io(DTensorIO{mesh, {Replicate()}, {}, {Replicate()}});
  expect_error([&] { (*dec)(ids); }, "tie_embeddings needs a replicated tok_embeddings.weight");
}
