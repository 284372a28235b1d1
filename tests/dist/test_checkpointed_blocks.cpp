// Activation checkpointing under tensor parallelism, FSDP, FSDP x TP and HSDP, with LoRA
// dropout: checkpointing every decoder block changes no gradient (the recomputation inside the
// backward runs the blocks' collectives again, and draws the adapters' dropout masks again from
// where their generators stood); a fully_shard'ed module inside a checkpointed region is refused
// on every rank.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

LoraConfig dropout_config() {
  LoraConfig c = lora_test_config(LoraInit::Random);
  c.lora_dropout = 0.2;
  return c;
}

// The loss on this rank's rows of one global batch, and every trainable parameter's global
// gradient after its backward.
double loss_and_grads(LoraRun& run, std::map<std::string, Tensor>& grads) {
  const DecoderConfig cfg = lora_decoder_config();
  Batch b = affine_batch(3, 8, cfg.max_seq_len, cfg.vocab_size);
  const int64_t rows = 8 / run.dp_size;
  Tensor ids = kernels::narrow(b.ids, 0, run.dp_rank * rows, rows).contiguous();
  Tensor targets = kernels::narrow(b.targets, 0, run.dp_rank * rows, rows).contiguous();
  Tensor loss = cross_entropy((*run.model)(ids), targets);
  backward(loss);
  for (auto& [name, p] : run.model->named_parameters())
    if (p->requires_grad())
      grads[name] = p->is_dtensor() ? p->grad_dtensor().full_tensor() : p->grad();
  return loss.item<float>();
}

}  // namespace

TEST(ActivationCheckpointDist, CheckpointedBlocksGiveTheSameGradientsUnderEveryLayout) {
  const DecoderConfig cfg = lora_decoder_config();
  for (const LoraLayout& l : lora_layouts()) {
    SCOPED_TRACE(l.name);
    std::map<std::string, Tensor> grads[2];
    double losses[2];
    for (int on : {0, 1}) {
      LoraRun run = l.build(cfg, dropout_config());
      if (on)
        for (auto& block : run.model->layers)
          checkpoint(block);
      losses[on] = loss_and_grads(run, grads[on]);
    }
    EXPECT_EQ(losses[1], losses[0]);
    ASSERT_EQ(grads[1].size(), grads[0].size());
    EXPECT_GT(grads[0].size(), 0u);
    for (const auto& [name, g] : grads[0])
      expect_close(grads[1].at(name), g, 1e-6, name);
  }
}

TEST(ActivationCheckpointDist, FullyShardedModulesInsideARegionAreRefusedOnEveryRank) {
  if (world_size() == 1) GTEST_SKIP() << "needs fully_shard over several ranks";
  const DecoderConfig cfg = lora_decoder_config();
  auto model = std::make_shared<Decoder>(cfg);
  lora_shard(model, DeviceMesh(Shape{world_size()}, {"dp"}));
  const Batch b = affine_batch(0, 2, cfg.max_seq_len, cfg.vocab_size);
  checkpoint(model);  // the root's own hooks stay outside, but the blocks' would run inside
  expect_error([&] { (*model)(b.ids); },
               {"fully_shard(DecoderBlock)", "inside an activation-checkpointed region",
                "checkpoint this module itself"});
  // Nothing is left half done: without the region the model trains.
  model->set_activation_checkpointing(false);
  for (auto& block : model->layers)
    checkpoint(block);
  backward(cross_entropy((*model)(b.ids), b.targets));
  EXPECT_TRUE(model->layers[0]->parameters().front()->grad().defined());
}
