// Optimizers on DTensor parameters and clip_grad_norm_ over mixed placements, on 1-D and 2-D
// meshes: every update and every norm equals the same computation on one rank with plain
// tensors. Part of the test_nn_dtensor binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "dist/nn_dtensor_util.h"
#include "tessera/dtensor/nn_ops.h"
#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::expect_close;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;
using namespace tessera::nn_dtensor_test;

// --- optimizers ---

TEST(NnDTensor, AdamWOnDTensorParametersMatchesPlain) {
  DeviceMesh mesh = world_mesh();
  Generator g1(50), g2(50);
  auto ref_ptr = std::make_shared<Linear>(6, 10, true, g1);
  auto mod_ptr = std::make_shared<Linear>(6, 10, true, g2);
  Linear& ref = *ref_ptr;
  Linear& lin = *mod_ptr;
  to_float64(ref);
  to_float64(lin);
  distribute(lin.weight, mesh, {Shard(0)});
  distribute(lin.bias, mesh, {Shard(0)});
  lin.set_dtensor_io({mesh, {Replicate()}, {Replicate()}, {Replicate()}});
  AdamWOptions o{.lr = 0.05, .weight_decay = 0.1};
  AdamW opt(lin.parameters(), o), ref_opt(ref.parameters(), o);
  for (int step = 0; step < 3; ++step) {
    Tensor x = random_tensor({4, 6}, 60 + uint64_t(step), DType::Float64);
    Tensor t = random_tensor({4, 10}, 70 + uint64_t(step), DType::Float64);
    backward(sum(square(sub(lin(x), t))));
    backward(sum(square(sub(ref(x), t))));
    opt.step();
    ref_opt.step();
    opt.zero_grad();
    ref_opt.zero_grad();
    const std::string s = " after step " + std::to_string(step + 1);
    expect_close(lin.weight.full(), ref.weight.full(), 1e-12, "weight" + s);
    expect_close(lin.bias.full(), ref.bias.full(), 1e-12, "bias" + s);
  }
  // Sharded parameters have sharded state.
  EXPECT_EQ(opt.exp_avg()[0].shape(), lin.weight.local().shape());
  expect_close(gather(opt.exp_avg()[0], mesh, {Shard(0)}, {10, 6}), ref_opt.exp_avg()[0], 1e-12,
               "exp_avg");
}

TEST(NnDTensor, SGDMomentumOnDTensorParametersMatchesPlain) {
  DeviceMesh mesh = world_mesh();
  Generator g1(51), g2(51);
  auto ref_ptr = std::make_shared<Linear>(8, 3, true, g1);
  auto mod_ptr = std::make_shared<Linear>(8, 3, true, g2);
  Linear& ref = *ref_ptr;
  Linear& lin = *mod_ptr;
  to_float64(ref);
  to_float64(lin);
  distribute(lin.weight, mesh, {Shard(1)});
  lin.set_dtensor_io({mesh, {Replicate()}, {Shard(-1)}, {Replicate()}});
  SGDOptions o{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01};
  SGD opt(lin.parameters(), o), ref_opt(ref.parameters(), o);
  for (int step = 0; step < 3; ++step) {
    Tensor x = random_tensor({5, 8}, 80 + uint64_t(step), DType::Float64);
    backward(sum(square(lin(x))));
    backward(sum(square(ref(x))));
    opt.step();
    ref_opt.step();
    opt.zero_grad();
    ref_opt.zero_grad();
    expect_close(lin.weight.full(), ref.weight.full(), 1e-12, "weight");
    expect_close(lin.bias.full(), ref.bias.full(), 1e-12, "bias");
  }
}

// --- clip_grad_norm_ ---

namespace {

struct ClipCase {
  Shape shape;
  Placements placements;  // empty: plain parameter
};

void check_clip(const DeviceMesh* mesh, const std::vector<ClipCase>& cases, double max_norm,
                uint64_t seed, double norm_type = 2.0) {
  std::vector<Parameter> dist, plain;
  std::vector<Tensor> grads;
  for (size_t i = 0; i < cases.size(); ++i) {
    Tensor v = random_tensor(cases[i].shape, seed + 2 * i, DType::Float64);
    Tensor g = random_tensor(cases[i].shape, seed + 2 * i + 1, DType::Float64);
    grads.push_back(g);
    plain.emplace_back(v.clone());
    if (cases[i].placements.empty())
      dist.emplace_back(v);
    else
      dist.emplace_back(distribute_tensor(v, *mesh, cases[i].placements));
  }
  std::vector<Parameter*> dp, pp;
  for (size_t i = 0; i < cases.size(); ++i) {
    Tensor local = dist[i].is_dtensor()
                       ? distribute_tensor(grads[i], *mesh, cases[i].placements).to_local()
                       : grads[i].clone();
    Tensor leaf = dist[i].local();
    leaf.set_grad(local.clone());
    Tensor pleaf = plain[i].local();
    pleaf.set_grad(grads[i].clone());
    dp.push_back(&dist[i]);
    pp.push_back(&plain[i]);
  }
  const double want = clip_grad_norm_(pp, max_norm, norm_type);
  const double got = clip_grad_norm_(dp, max_norm, norm_type);
  EXPECT_NEAR(got, want, 1e-12 * want) << "norm_type " << norm_type;
  // Every rank computed the same norm, bit for bit.
  Tensor mine = from_vector<double>({got}), top = mine.clone(), bottom = mine.clone();
  world_group()->all_reduce(top, ReduceOp::Max)->wait();
  world_group()->all_reduce(bottom, ReduceOp::Min)->wait();
  EXPECT_EQ(top.item<double>(), bottom.item<double>()) << "norm_type " << norm_type;
  double direct = 0;
  for (const Tensor& g : grads)
    for (double v : g.to_vector<double>())
      direct = std::isinf(norm_type) ? std::max(direct, std::abs(v))
                                     : direct + std::pow(std::abs(v), norm_type);
  if (!std::isinf(norm_type)) direct = std::pow(direct, 1.0 / norm_type);
  EXPECT_NEAR(want, direct, 1e-12 * want) << "norm_type " << norm_type;
  for (size_t i = 0; i < cases.size(); ++i)
    expect_close(full_grad(dist[i]), plain[i].grad(), 1e-12, "clipped grad " + std::to_string(i));
}

}  // namespace

TEST(NnDTensor, ClipGradNormMixedPlacementsMatchesSingleRank) {
  DeviceMesh mesh = world_mesh();
  std::vector<ClipCase> cases = {
      {{10, 3}, {Shard(0)}},  // uneven
      {{4}, {Replicate()}},   // counted once
      {{5}, {}},              // plain
      {{3, 2}, {Shard(0)}},   // an empty shard on 4 ranks, same group as the first
      {{2, 7}, {Shard(1)}},
  };
  check_clip(&mesh, cases, 1.0, 90);  // clipped
  check_clip(&mesh, cases, 1e6, 91);  // not clipped
  // The largest magnitude is a max over the shards, not a sum; any p sums |g|^p.
  for (double p : {double(INFINITY), 1.0, 3.0}) {
    check_clip(&mesh, cases, 0.5, 92, p);
    check_clip(&mesh, cases, 1e6, 93, p);
  }
}

TEST(NnDTensor, ClipGradNormOnTwoDimMesh) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  std::vector<ClipCase> cases = {
      {{6, 5}, {Shard(0), Replicate()}}, {{6, 5}, {Replicate(), Shard(1)}},
      {{7, 3}, {Shard(0), Shard(0)}},    {{4, 4}, {Shard(1), Shard(0)}},
      {{3}, {Replicate(), Replicate()}}, {{2}, {}},
  };
  check_clip(&mesh, cases, 0.5, 100);
  check_clip(&mesh, cases, 0.5, 101, INFINITY);
  check_clip(&mesh, cases, 0.5, 102, 3.0);
}
