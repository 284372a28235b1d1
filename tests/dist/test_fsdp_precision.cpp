// fully_shard's dtypes: mixed precision (gather and compute dtype, reduce dtype, float32 masters,
// input and output casts) and a module whose parameters have several dtypes (one group each).
// One test binary with test_fsdp.cpp and test_fsdp_state.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dist/fsdp_mlp.h"
#include "dist/fsdp_parity.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::fsdp_test;
using tessera::testing::expect_close;
using tessera::testing::expect_error;

namespace {

TEST(FullyShard, MixedPrecisionComputesInParamDtypeAndKeepsFloat32Masters) {
  DeviceMesh mesh = dp_mesh();
  const std::vector<double> want = train_mlp(std::make_shared<Mlp>(), 10, 0, 1);
  // reduce_dtype unset reduces in param_dtype (bfloat16); float32 reduces in full precision.
  for (std::optional<DType> reduce :
       {std::optional<DType>(), std::optional<DType>(DType::Float32)}) {
    SCOPED_TRACE(reduce ? "reduce float32" : "reduce bfloat16");
    FSDPOptions opts;
    opts.mp_policy.param_dtype = DType::BFloat16;
    opts.mp_policy.reduce_dtype = reduce;
    auto net = std::make_shared<Mlp>();
    auto s0 = fully_shard(net->b0, mesh, opts);
    fully_shard(net->b1, mesh, opts);
    // Only the root's output goes back to float32: the blocks feed bfloat16 to the head.
    opts.mp_policy.output_dtype = DType::Float32;
    fully_shard(net, mesh, opts);
    int checked = 0;
    // Runs after fully_shard's pre-hook: the block computes with gathered bfloat16 weights on a
    // bfloat16 input, while the stored shards stay float32.
    net->b0->register_forward_pre_hook([&](Module&, const Tensor& x) {
      EXPECT_EQ(x.dtype(), DType::BFloat16);
      for (Parameter* p : s0->parameters()) {
        EXPECT_TRUE(p->is_unsharded());
        EXPECT_EQ(p->local().dtype(), DType::BFloat16);
        EXPECT_EQ(p->local().shape(), p->global_shape());
        EXPECT_EQ(p->stored().dtype(), DType::Float32);
      }
      ++checked;
      return Tensor();
    });
    std::vector<double> got = train_mlp(net, 10, mesh.local_rank(0), world_size(), [&](Mlp& m) {
      for (Parameter* p : m.parameters()) {
        ASSERT_TRUE(p->grad().defined());
        EXPECT_EQ(p->grad().dtype(), DType::Float32);
        EXPECT_EQ(p->stored().dtype(), DType::Float32);
      }
    });
    EXPECT_EQ(checked, 10);
    // bfloat16 keeps about 3 significant digits.
    for (size_t s = 0; s < want.size(); ++s)
      EXPECT_NEAR(got[s], want[s], 3e-2 * want[s]) << "step " << s;
    for (const auto& [name, t] : net->state_dict())
      EXPECT_EQ(t.dtype(), DType::Float32) << name;
  }
}

// Micro-batch gradients summed while sync is off stay in reduce_dtype (float32), as synced
// ones do: the sum of kMicro bfloat16 gradients agrees with syncing after every micro-batch to
// float32 rounding, where a sum kept in bfloat16 is off by its ~3 significant digits.
TEST(FullyShard, UnsyncedGradientsAccumulateInTheReduceDtype) {
  DeviceMesh mesh = dp_mesh();
  constexpr int kMicro = 8;
  auto grads = [&](bool sync_each) {
    FSDPOptions opts;
    opts.mp_policy.param_dtype = DType::BFloat16;
    opts.mp_policy.reduce_dtype = DType::Float32;
    auto net = std::make_shared<Mlp>();
    fully_shard(net->b0, mesh, opts);
    fully_shard(net->b1, mesh, opts);
    opts.mp_policy.output_dtype = DType::Float32;
    auto root = fully_shard(net, mesh, opts);
    for (int m = 0; m < kMicro; ++m) {
      root->set_requires_gradient_sync(sync_each || m == kMicro - 1);
      Generator gen(uint64_t(300 + 17 * m + world_rank()));
      // Micro-batches of very different scale, so that a 16-bit running sum rounds visibly.
      Tensor x = mul(randn({4, 16}, gen), double(1 + 3 * m)), t = randn({4, 5}, gen);
      backward(mean(square(sub((*net)(x), t))));
    }
    std::map<std::string, Tensor> out;
    for (auto& [name, p] : net->named_parameters())
      out[name] = p->grad_dtensor().full_tensor();
    return out;
  };
  const auto synced = grads(true), accumulated = grads(false);
  for (const auto& [name, want] : synced)
    expect_close(accumulated.at(name), want, 1e-5, name);
}

// A float16 reduction divides the terms before summing, by a power of two near sqrt(ranks) as
// PyTorch's FSDP2 does: every rank's gradient fits float16 (up to 65504) and so does the sum of
// the divided terms, but not the plain sum (80000 over 2 ranks; 120000 and more over 4 and 8).
TEST(FullyShard, Float16ReductionsDoNotOverflowOnTheSum) {
  if (world_size() == 1) GTEST_SKIP() << "one term: no sum";
  FSDPOptions opts;
  opts.mp_policy.reduce_dtype = DType::Float16;
  Generator gen(3);
  auto net = std::make_shared<Linear>(4, 2, false, gen);
  fully_shard(net, dp_mesh(), opts);
  const double each = world_size() == 2 ? 40000 : 30000;
  Tensor x = full(Shape{4, 4}, each / 4, DType::Float32);  // the same rows on every rank
  backward(sum((*net)(x)));
  const std::vector<float> g = net->weight.grad_dtensor().full_tensor().to_vector<float>();
  for (float v : g)
    EXPECT_EQ(v, float(each)) << "the mean of every rank's " << each;
}

// The mixed-precision figure: the decoder gathered and computed in bfloat16, gradients
// reduced in float32, float32 masters: the loss curve stays within 2% of float32 for 30 steps.
TEST(FullyShard, DecoderInBfloat16StaysWithinTwoPercentOfFloat32) {
  DeviceMesh mesh = dp_mesh();
  FSDPOptions opts;
  opts.mp_policy.param_dtype = DType::BFloat16;
  opts.mp_policy.reduce_dtype = DType::Float32;
  auto net = std::make_shared<Decoder>(small_decoder_config());
  for (auto& layer : net->layers)
    fully_shard(layer, mesh, opts);
  opts.mp_policy.output_dtype = DType::Float32;
  fully_shard(net, mesh, opts);
  int bf16_blocks = 0;
  net->layers[0]->register_forward_hook([&](Module&, const Tensor& x, const Tensor& y) {
    bf16_blocks += x.dtype() == DType::BFloat16 && y.dtype() == DType::BFloat16;
    return Tensor();
  });
  Trajectory run = train(net, 30, world_rank(), world_size());
  EXPECT_EQ(bf16_blocks, 30) << "the blocks did not compute in bfloat16";
  const Trajectory& ref = reference_run();
  double worst = 0;
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    const double rel = std::abs(run.losses[s] - ref.losses[s]) / ref.losses[s];
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 0.02) << "step " << s << ": " << run.losses[s] << " vs " << ref.losses[s];
  }
  if (world_rank() == 0)
    std::printf("[mixed precision] bf16 params, fp32 reduce, 30 steps: worst loss |d|/|ref| %.2e\n",
                worst);
  for (const auto& [name, t] : final_state(run))
    EXPECT_EQ(t.dtype(), DType::Float32) << name;
}

// A root holding parameters of two dtypes gets one group per dtype; they form one step: every
// trainable parameter's gradient is reduced (the second group's was lost when each group started
// a step of its own, with output_dtype set), and all of them reshard after backward.
TEST(FullyShard, RootWithTwoDtypesReducesEveryGroup) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Mlp>();
  net->head->bias = Parameter(net->head->bias.full().to(DType::BFloat16), true);
  FSDPOptions opts;
  opts.mp_policy.param_dtype = DType::BFloat16;
  FSDPOptions root = opts;
  root.mp_policy.output_dtype = DType::Float32;
  std::vector<std::shared_ptr<FSDPState>> states{fully_shard(net->b0, mesh, opts),
                                                 fully_shard(net->b1, mesh, opts),
                                                 fully_shard(net, mesh, root)};
  Generator gen(5);
  const Tensor x = randn({4, 16}, gen);
  for (int step = 0; step < 2; ++step) {
    backward(mean(square((*net)(x))));
    for (auto& [name, p] : net->named_parameters())
      EXPECT_TRUE(p->grad().defined()) << "step " << step << ": " << name << " has no gradient";
    for (const auto& s : states)
      EXPECT_FALSE(s->is_unsharded()) << "step " << step;
    for (Parameter* p : net->parameters())
      p->zero_grad();
  }
}

// A group holding parameters of two dtypes is unsharded only when both are: in backward the
// bfloat16 group (fc2, whose gradients come first) reshards while the float32 one (fc1) is still
// to run, and is_unsharded() said what the first dtype group alone was. flat_buffer() names its
// dtype when there are two.
TEST(FullyShard, TwoDtypeGroupsAreUnshardedOnlyTogether) {
  DeviceMesh mesh = dp_mesh();
  auto net = std::make_shared<Mlp>();
  for (Parameter* p : {&net->b0->fc2->weight, &net->b0->fc2->bias})
    *p = Parameter(p->full().to(DType::BFloat16), true);
  FSDPOptions opts;
  opts.mp_policy.param_dtype = DType::Float32;
  auto b0 = fully_shard(net->b0, mesh, opts);
  fully_shard(net->b1, mesh, opts);
  fully_shard(net, mesh, opts);
  std::vector<std::pair<bool, bool>> seen;  // (every parameter unsharded, is_unsharded())
  auto record = [&] {
    bool all = true;
    for (Parameter* p : b0->parameters())
      all = all && p->is_unsharded();
    seen.emplace_back(all, b0->is_unsharded());
  };
  net->b0->fc1->register_forward_hook([&](Module&, const Tensor&, const Tensor& y) {
    if (grad_enabled())
      register_hook(y, [&](const Tensor&) {
        record();
        return Tensor();
      });
    return Tensor();
  });
  Generator gen(5);
  const Tensor x = randn({4, 16}, gen);
  Tensor loss = mean(square((*net)(x)));
  record();
  backward(loss);
  record();
  b0->unshard();
  record();
  ASSERT_EQ(seen.size(), 4u);
  for (size_t i = 0; i < seen.size(); ++i)
    EXPECT_EQ(seen[i].second, seen[i].first) << "point " << i;

  EXPECT_EQ(b0->flat_buffer(DType::BFloat16).dtype(), DType::BFloat16);
  EXPECT_EQ(b0->flat_buffer(DType::Float32).dtype(), DType::Float32);
  expect_error([&] { (void)b0->flat_buffer(); }, "float32");
  expect_error([&] { (void)b0->flat_buffer(DType::Float64); }, "no parameter of dtype float64");
}

// MixedPrecisionPolicy::cast_forward_inputs (default true) and its dtypes' checks.
TEST(FullyShard, MixedPrecisionCastsInputsUnlessToldNotTo) {
  Generator gen(5);
  const Tensor x = randn({4, 16}, gen);
  for (bool cast_inputs : {true, false}) {
    auto net = std::make_shared<Mlp>();
    FSDPOptions opts;
    opts.mp_policy.param_dtype = DType::BFloat16;
    opts.mp_policy.cast_forward_inputs = cast_inputs;
    fully_shard(net, dp_mesh(), opts);
    DType seen = DType::Float64;
    net->register_forward_pre_hook([&](Module&, const Tensor& in) {
      seen = in.dtype();
      return Tensor();
    });
    if (cast_inputs) {
      EXPECT_EQ((*net)(x).dtype(), DType::BFloat16);
    } else {
      expect_error([&] { (*net)(x); }, "dtype mismatch");
    }
    EXPECT_EQ(seen, cast_inputs ? DType::BFloat16 : DType::Float32);
  }
  auto net = std::make_shared<Mlp>();
  FSDPOptions bad;
  bad.mp_policy.reduce_dtype = DType::Int32;
  expect_error([&] { fully_shard(net, dp_mesh(), bad); },
               "MixedPrecisionPolicy::reduce_dtype is int32; it must be a floating dtype");
}

}  // namespace
