// A decoder trained on cuda:0 tensors gives the CPU run's losses and parameters bit for bit. The
// device is testing::TestDevice: a real GPU where there is one, else the stand-in, whose memory
// the CPU may not touch. Every kernel runs on host copies there (KernelsOn::HostCopies, on a GPU
// too), so what this proves is the plumbing: every tensor of forward, backward,
// loss and AdamW is made on, and stays on, the parameters' device, and nothing reads device
// memory from the CPU (that would crash).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/affine_batch.h"
#include "common/small_decoder.h"
#include "tessera/core/detail/emulated_kernels.h"
#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"
#include "tessera/testing/stand_in_device.h"

using namespace tessera;
using tessera::testing::affine_batch;
using tessera::testing::Batch;
using tessera::testing::small_decoder_config;
using tessera::testing::TestDevice;

namespace {

struct TrainingRun {
  std::vector<float> losses;
  std::map<std::string, Tensor> final_state;
};

TrainingRun train(Device device, bool tied, int steps) {
  DecoderConfig cfg = small_decoder_config();
  cfg.tie_embeddings = tied;
  auto net = std::make_shared<Decoder>(cfg);
  net->to(device);
  for (Parameter* p : net->parameters())
    EXPECT_EQ(p->stored().device(), device) << p->str();
  AdamW opt(net->parameters(), AdamWOptions{.lr = 3e-3, .weight_decay = 0.1});
  TrainingRun run;
  for (int s = 0; s < steps; ++s) {
    Batch b = affine_batch(s, 4, 8, cfg.vocab_size);
    opt.zero_grad();
    Tensor logits = (*net)(b.ids.to(device));
    EXPECT_EQ(logits.device(), device);
    Tensor loss = cross_entropy(logits, b.targets.to(device));
    backward(loss);
    for (Parameter* p : net->parameters())
      EXPECT_EQ(p->grad().device(), device) << p->str();
    clip_grad_norm_(net->parameters(), 1.0);
    opt.step();
    run.losses.push_back(loss.to(Device::cpu()).item<float>());
  }
  for (auto& [name, t] : net->state_dict())
    run.final_state[name] = t.to(Device::cpu());
  return run;
}

void expect_same_run(const TrainingRun& device, const TrainingRun& cpu) {
  EXPECT_EQ(device.losses, cpu.losses);
  ASSERT_EQ(device.final_state.size(), cpu.final_state.size());
  for (const auto& [name, t] : cpu.final_state) {
    ASSERT_TRUE(device.final_state.count(name)) << name;
    EXPECT_EQ(device.final_state.at(name).to_vector<float>(), t.to_vector<float>()) << name;
  }
}

}  // namespace

TEST(DeviceTraining, DecoderOnTheDeviceMatchesTheCpuBitForBit) {
  const TrainingRun cpu = train(Device::cpu(), false, 4);
  TestDevice device;
  const TrainingRun cuda = train(Device::cuda(0), false, 4);
  expect_same_run(cuda, cpu);
  EXPECT_GT(memory_stats(Device::cuda(0)).num_allocations, 0) << device.str();
}

TEST(DeviceTraining, TiedEmbeddingsMoveOnceAndTrainAlike) {
  const TrainingRun cpu = train(Device::cpu(), true, 3);
  TestDevice device;
  expect_same_run(train(Device::cuda(0), true, 3), cpu);
}

// Weights tied by assignment (two Parameters holding one tensor, as PyTorch's
// `lm_head.weight = embed.weight`) stay one tensor on the device: moved once, given to both.
TEST(DeviceTraining, WeightsTiedByAssignmentStayTiedWhenMoved) {
  struct TiedLm : Module {
    explicit TiedLm(Generator& gen)
        : Module("TiedLm"),
          embed(std::make_shared<Embedding>(6, 4, gen)),
          head(std::make_shared<Linear>(4, 6, false, gen)) {
      head->weight = embed->weight;
      register_module("embed", embed);
      register_module("head", head);
    }
    std::shared_ptr<Embedding> embed;
    std::shared_ptr<Linear> head;
  };
  TestDevice device;
  Generator gen(3);
  auto net = std::make_shared<TiedLm>(gen);
  net->to(Device::cuda(0));
  EXPECT_EQ(net->embed->weight.stored().device(), Device::cuda(0));
  EXPECT_TRUE(net->head->weight.stored().is_same(net->embed->weight.stored())) << "untied by to()";
  EXPECT_EQ(net->parameters().size(), 1u);
}

TEST(DeviceTraining, InputsOnAnotherDeviceAreAnErrorNamingBoth) {
  TestDevice device;
  auto net = std::make_shared<Decoder>(small_decoder_config());
  net->to(Device::cuda(0));
  Batch b = affine_batch(0, 2, 8, small_decoder_config().vocab_size);
  tessera::testing::expect_error([&] { (*net)(b.ids); }, {"embedding", "cpu", "cuda:0"});
}

// The same decoder with the device's own kernels (KernelsOn::Device): on a GPU its CUDA kernels,
// on the stand-in that device code emulated on the host. None of its kernels runs on host copies,
// and the loss curve and the parameters follow the CPU's within 1e-4.
TEST(DeviceTraining, WithDeviceKernelsTheLossCurveFollowsTheCpu) {
  const TrainingRun cpu = train(Device::cpu(), false, 4);
  TestDevice device(tessera::testing::KernelsOn::Device);
  const int64_t launches = tessera::detail::emulated_launches();
  const int64_t fallbacks = kernels::host_fallback_calls();
  const TrainingRun cuda = train(Device::cuda(0), false, 4);
  EXPECT_EQ(kernels::host_fallback_calls(), fallbacks)
      << "every kernel of forward, loss, backward, clipping and AdamW has a device implementation";
  if (device.is_stand_in()) {
    EXPECT_GT(tessera::detail::emulated_launches(), launches + 100);
  }
  ASSERT_EQ(cuda.losses.size(), cpu.losses.size());
  for (size_t s = 0; s < cpu.losses.size(); ++s)
    EXPECT_NEAR(cuda.losses[s], cpu.losses[s], 1e-4 * std::abs(cpu.losses[s]))
        << "step " << s << " on " << device.str();
  for (const auto& [name, t] : cpu.final_state)
    tessera::testing::expect_close(cuda.final_state.at(name), t, 1e-4, name);
}

// label_smoothing's term is made of dispatching ops (log_softmax, sum, masked_fill) around the
// fused kernel: on the device's own kernels it gives the CPU's loss and gradient, without a
// kernel run on host copies.
TEST(DeviceTraining, LabelSmoothedCrossEntropyFollowsTheCpu) {
  const Tensor logits = tessera::testing::random_tensor({2, 3, 5}, 71, DType::Float32);
  const Tensor target = from_vector<int64_t>({0, 4, -100, 2, 1, -100}, {2, 3});
  for (Reduction red : {Reduction::None, Reduction::Mean, Reduction::Sum}) {
    auto run = [&](Device dev) {
      Tensor x = logits.clone().to(dev);  // a fresh leaf: to(cpu) of a CPU tensor is itself
      x.set_requires_grad(true);
      Tensor loss = cross_entropy(x, target.to(dev), -100, red, 0.2);
      backward(sum(loss));
      return std::make_pair(loss.detach().to(Device::cpu()), x.grad().to(Device::cpu()));
    };
    const auto cpu = run(Device::cpu());
    TestDevice device(tessera::testing::KernelsOn::Device);
    const int64_t fallbacks = kernels::host_fallback_calls();
    const auto dev = run(Device::cuda(0));
    EXPECT_EQ(kernels::host_fallback_calls(), fallbacks) << device.str();
    tessera::testing::expect_close(dev.first, cpu.first, 1e-6, "loss");
    tessera::testing::expect_close(dev.second, cpu.second, 1e-6, "grad");
  }
}
