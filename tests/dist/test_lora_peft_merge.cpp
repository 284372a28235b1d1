// PEFT's merges and unloads under every parallelism: merges under FSDP reaching the next
// forward, adapters added while FSDP holds the weights gathered, gradients reduced for the
// adapters only, merge_and_unload, unload, disable_adapter, safe_merge, trainable parameter
// counts, and what deleting or unloading may not break. Part of the test_lora_peft binary.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

// A merge after a forward that left the weights gathered (an FSDP root, grad mode on) reaches
// the next forward: the merged model computes what the adapter did, not the bare base.
TEST(LoraPeft, MergeUnderFsdpReachesTheNextForward) {
  const DecoderConfig cfg = lora_decoder_config();
  auto m = std::make_shared<Decoder>(cfg);
  auto lora = apply_lora(m, lora_test_config(LoraInit::Random));
  auto state = fully_shard(m, DeviceMesh(Shape{world_size()}, {"dp"}));
  const Batch b = affine_batch(0, 2, cfg.max_seq_len, cfg.vocab_size);
  const Tensor with_adapter = (*m)(b.ids);
  ASSERT_TRUE(state->is_unsharded());
  lora->merge_adapter("default");
  expect_close((*m)(b.ids), with_adapter, 1e-5, "merged");
  lora->unmerge_adapter("default");
  expect_close((*m)(b.ids), with_adapter, 1e-5, "unmerged");
}

// An adapter added while FSDP holds the weights gathered (kept after a forward by
// reshard_after_forward off, or after a step by reshard_after_backward off) gets the values a
// plain model's gets, and the next forward computes with them: its draws used to land in the
// gathered copy, which the next gather overwrote (A stayed zero), or to throw for a plain-tensor
// gathered parameter. (Between a forward and its backward the write is refused by the backward,
// as any write to the parameters there.)
TEST(LoraPeft, AnAdapterAddedWhileFsdpHoldsTheWeightsGatheredKeepsItsValues) {
  const DecoderConfig cfg = lora_decoder_config();
  LoraConfig second = lora_test_config(LoraInit::Gaussian);
  second.seed = 5;
  const LoraSlots slots{.max_adapters = 2, .max_rank = 4};
  auto plain = std::make_shared<Decoder>(cfg);
  auto plain_lora = apply_lora(plain, lora_test_config(LoraInit::Random), "default", slots);
  plain_lora->add_adapter("b", second);
  plain_lora->set_adapter("b");
  const Batch b = affine_batch(0, 2, cfg.max_seq_len, cfg.vocab_size);
  const Tensor want = (*plain)(b.ids);
  for_each_gathered_lora(
      lora_test_config(LoraInit::Random), slots, b.ids,
      [&](GatheredLora& g, const std::string& what) {
        g.lora->add_adapter("b", second);
        for (const auto& [key, t] : plain_lora->read_adapter("b"))
          expect_identical(g.lora->read_adapter("b").at(key), t, what + ": " + key);
        g.lora->set_adapter("b");
        NoGradGuard no_grad;
        expect_close((*g.model)(b.ids), want, 1e-5, what + ": forward with the added adapter");
      });
}

// Under FSDP a block's frozen base takes no room in the reduce-scatter or in the buffer its
// adapters' gradients live in: they hold the adapters' share of the block, not the whole block.
TEST(LoraPeft, FsdpReducesAndKeepsTheAdaptersGradientsOnly) {
  const DecoderConfig cfg = lora_decoder_config();
  auto m = std::make_shared<Decoder>(cfg);
  auto lora = apply_lora(m, lora_test_config(LoraInit::Random));
  lora_shard(m, DeviceMesh(Shape{world_size()}, {"dp"}));
  const Batch b = affine_batch(0, 2, cfg.max_seq_len, cfg.vocab_size);
  backward(cross_entropy((*m)(b.ids), b.targets));
  int64_t base = 0, adapters = 0;
  for (auto& [name, p] : m->named_parameters())
    if (name.rfind("layers.0.", 0) == 0)
      (p->requires_grad() ? adapters : base) += p->stored().numel();
  ASSERT_GT(adapters, 0);
  for (auto& [name, p] : m->named_parameters()) {
    if (name.rfind("layers.0.", 0) != 0 || !p->requires_grad()) continue;
    ASSERT_TRUE(p->grad().defined()) << name;
    const int64_t held = int64_t(p->grad().storage().nbytes() / sizeof(float));
    // The adapters' pieces, padded to whole chunks, and a flag per parameter.
    EXPECT_LT(held, 2 * adapters + 64)
        << name << ": the block's frozen " << base << " elements are in its gradient's buffer";
  }
}

// A free adapter slot (its matrices trainable, used by no forward) does not hold a block's
// reduce-scatter back to the end of backward: the block reduces, and frees its gathered weights,
// as soon as its backward is done, before the block before it runs its own.
TEST(LoraPeft, FreeSlotsDoNotHoldBackTheFsdpReduce) {
  const DecoderConfig cfg = lora_decoder_config();
  auto m = std::make_shared<Decoder>(cfg);
  apply_lora(m, lora_test_config(), "default", {.max_adapters = 2});
  const DeviceMesh mesh(Shape{world_size()}, {"dp"});
  std::vector<std::shared_ptr<FSDPState>> blocks;
  for (auto& layer : m->layers)
    blocks.push_back(fully_shard(layer, mesh));
  fully_shard(m, mesh);
  bool reached = false, second_still_gathered = true;
  m->layers[1]->register_forward_pre_hook([&](Module&, const Tensor& x) {
    register_hook(x, [&](const Tensor&) {  // block 1's backward is done
      reached = true;
      second_still_gathered = blocks[1]->is_unsharded();
      return Tensor();
    });
    return Tensor();
  });
  const Batch b = affine_batch(0, 2, cfg.max_seq_len, cfg.vocab_size);
  backward(cross_entropy((*m)(b.ids), b.targets));
  EXPECT_TRUE(reached);
  EXPECT_FALSE(second_still_gathered) << "block 1 waited for its free slot's gradients";
  for (auto& [name, p] : m->named_parameters()) {
    if (name.find("lora_") == std::string::npos) continue;
    EXPECT_EQ(p->grad().defined(), name.find(".0.weight") != std::string::npos) << name;
  }
}

// PEFT's merge_and_unload and unload: plain Linears back in place of the wrapped layers (tensor
// parallel ones stay so), the base model's keys only, and the outputs of the merged adapter or
// of the base model; refused under fully_shard.
TEST(LoraPeft, MergeAndUnloadGiveBackAPlainModel) {
  const DecoderConfig cfg = lora_decoder_config();
  const Batch b = affine_batch(0, 2, cfg.max_seq_len, cfg.vocab_size);
  const auto base_keys = std::make_shared<Decoder>(cfg)->state_dict();
  for (const LoraLayout& l : lora_layouts()) {
    for (bool merge : {true, false}) {
      LoraRun run = l.build(cfg, lora_test_config(LoraInit::Random));
      bool sharded = false;
      for (auto& [name, p] : run.model->named_parameters())
        sharded |= is_fully_sharded(*p);
      if (sharded) {
        expect_error([&] { run.lora->merge_and_unload(); },
                     {"merge_and_unload", "is sharded by fully_shard"});
        continue;
      }
      const Tensor with_adapter = run.logits(b.ids);
      run.lora->set_adapter("");
      const Tensor base = run.logits(b.ids);
      run.lora->set_adapter("default");
      ModulePtr plain = merge ? run.lora->merge_and_unload() : run.lora->unload();
      const std::string what = l.name + (merge ? " merge_and_unload" : " unload");
      EXPECT_EQ(plain, ModulePtr(run.model)) << what;
      EXPECT_TRUE(run.lora->layers().empty() && run.lora->adapters().empty()) << what;
      EXPECT_EQ(run.model->get_submodule("layers.0.attention.wq")->type_name(), "Linear") << what;
      const auto keys = run.model->state_dict();
      EXPECT_EQ(keys.size(), base_keys.size()) << what;
      for (const auto& [key, t] : keys)
        EXPECT_TRUE(base_keys.count(key)) << what << ": " << key;
      expect_close(run.logits(b.ids), merge ? with_adapter : base, 1e-5, what);
    }
  }
}

// PEFT's disable_adapter: the base model while the guard lives, a merged adapter unmerged first;
// afterwards the active adapter (unmerged now) and a mixed batch apply again.
TEST(LoraPeft, DisableAdapterGivesTheBaseModelForTheGuardsLife) {
  const DecoderConfig cfg = lora_decoder_config();
  for (const LoraLayout& l : lora_layouts({.max_adapters = 2, .max_rank = 4})) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(cfg, lora_test_config(LoraInit::Random));
    LoraConfig b = lora_test_config(LoraInit::Random);
    b.seed = 17;
    run.lora->add_adapter("b", b);
    const Batch batch = affine_batch(4, 4, cfg.max_seq_len, cfg.vocab_size);
    std::map<std::string, Tensor> alone;
    for (const std::string name : {"default", "b", ""}) {
      run.lora->set_adapter(name);
      alone[name] = run.logits(batch.ids);
    }
    run.lora->set_adapter("default");
    run.lora->merge_adapter("default");
    {
      auto off = run.lora->disable_adapter();
      EXPECT_EQ(run.lora->active_adapter(), "");
      expect_close(run.logits(batch.ids), alone[""], 1e-5, "disabled, merged before");
    }
    EXPECT_EQ(run.lora->active_adapter(), "default");
    for (const auto& [path, layer] : run.lora->layers())
      EXPECT_FALSE(layer->slot(run.lora->adapter_id("default")).merged) << "merged again: " << path;
    expect_close(run.logits(batch.ids), alone["default"], 1e-5, "after the guard");
    // A mixed batch is set aside and comes back.
    const std::vector<int64_t> ids = {0, 1, -1, 1};
    run.lora->set_batch_adapters(from_vector<int64_t>(ids, {4}));
    const Tensor mixed = run.logits(batch.ids);
    EXPECT_GT(max_abs_diff(mixed, alone[""]), 1e-3);
    {
      auto off = run.lora->disable_adapter();
      expect_close(run.logits(batch.ids), alone[""], 1e-5, "disabled, mixed batch before");
    }
    expect_close(run.logits(batch.ids), mixed, 0, "the mixed batch after the guard");
    // Adapters changed meanwhile: nothing comes back, not even into a reused slot.
    {
      auto off = run.lora->disable_adapter();
      run.lora->delete_adapter("b");
      run.lora->add_adapter("c", b);  // b's slot
    }
    EXPECT_EQ(run.lora->active_adapter(), "");
    expect_close(run.logits(batch.ids), alone[""], 1e-5, "after replacing an adapter");
    // The routing changed meanwhile: the guard leaves it as set.
    {
      auto off = run.lora->disable_adapter();
      run.lora->set_adapter("default");
    }
    EXPECT_EQ(run.lora->active_adapter(), "default");
  }
}

// PEFT's safe_merge: a merge that would put a NaN or an infinity into some weight is refused,
// naming the layer, on every rank (here only rank 0's window of w1 holds the broken row under TP
// and FSDP), before any weight changes; a sound adapter merges as without it.
TEST(LoraPeft, SafeMergeRefusesABrokenAdapterOnEveryRankAndChangesNothing) {
  const DecoderConfig cfg = lora_decoder_config();
  const Batch batch = affine_batch(2, 4, cfg.max_seq_len, cfg.vocab_size);
  for (const LoraLayout& l : lora_layouts()) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(cfg, lora_test_config(LoraInit::Random));
    const Tensor unmerged = run.logits(batch.ids);
    run.lora->merge_adapter("default", /*safe_merge=*/true);
    expect_close(run.logits(batch.ids), unmerged, 1e-5, "safely merged");
    run.lora->unmerge_adapter("default");

    const auto base = base_weights(*run.model);
    auto values = run.lora->read_adapter("default");
    Tensor b = values.at("layers.1.feed_forward.w1.lora_B.weight").clone();
    b.data<float>()[0] = std::numeric_limits<float>::infinity();  // row 0 of w1's update
    values["layers.1.feed_forward.w1.lora_B.weight"] = b;
    run.lora->write_adapter("default", values);
    expect_error([&] { run.lora->merge_adapter("default", /*safe_merge=*/true); },
                 {"merge_adapter 'default' (safe_merge)", "layers.1.feed_forward.w1",
                  "NaN or infinite", "nothing was merged"});
    EXPECT_EQ(largest_change(*run.model, base), 0.0) << "the refused merge changed a weight";
    for (const auto& [path, layer] : run.lora->layers())
      EXPECT_FALSE(layer->slot(run.lora->adapter_id("default")).merged) << path;
    if (world_size() == 1) {
      expect_error([&] { run.lora->merge_and_unload(/*safe_merge=*/true); },
                   {"safe_merge", "layers.1.feed_forward.w1"});
      EXPECT_EQ(run.lora->layers().size(), 14u) << "merge_and_unload unwrapped after refusing";
    }
  }
}

// PEFT's get_nb_trainable_parameters counts whole parameters on every mesh: the test decoder's
// 22,688 base elements (embedding, 2 blocks of 4 x 32x32 attention, 3 x 32x64 feed-forward and
// 2 norms, the final norm and the output) and rank-4 slots for all 14 projections, 4,352
// elements per slot, whatever shards them.
TEST(LoraPeft, TrainableParameterCountsAreGlobal) {
  const DecoderConfig cfg = lora_decoder_config();
  for (const LoraLayout& l : lora_layouts({.max_adapters = 2, .max_rank = 4})) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(cfg, lora_test_config());
    EXPECT_EQ(run.lora->get_nb_trainable_parameters(),
              (std::pair<int64_t, int64_t>{2 * 4352, 22688 + 2 * 4352}));
    std::ostringstream line;
    run.lora->print_trainable_parameters(line);
    EXPECT_EQ(line.str(), "trainable params: 8,704 || all params: 31,392 || trainable%: 27.7268\n");
  }
}

// A mixed batch's ids are slots: deleting an adapter the batch routes samples to is refused
// (the slot's next adapter would take those samples over); a batch that does not name it is no
// obstacle, and neither is one cleared first.
TEST(LoraPeft, DeletingAnAdapterAMixedBatchRoutesToIsRefused) {
  const DecoderConfig cfg = lora_decoder_config();
  auto m = std::make_shared<Decoder>(cfg);
  auto lora = apply_lora(m, lora_test_config(), "x", {.max_adapters = 3, .max_rank = 4});
  lora->add_adapter("y", lora_test_config());
  lora->add_adapter("z", lora_test_config());
  lora->set_batch_adapters(
      from_vector<int64_t>({lora->adapter_id("x"), lora->adapter_id("y")}, {2}));
  expect_error([&] { lora->delete_adapter("y"); },
               {"delete_adapter 'y'", "the mixed batch", "set_batch_adapters(Tensor())"});
  EXPECT_EQ(lora->adapters(), (std::vector<std::string>{"x", "y", "z"}));
  lora->delete_adapter("z");  // not in the batch
  lora->set_batch_adapters(Tensor());
  lora->delete_adapter("y");
  EXPECT_EQ(lora->adapters(), (std::vector<std::string>{"x"}));
}

// merge_and_unload and unload check every layer before changing anything: a wrapped layer the
// user replaced makes them throw with the model, the adapters and the weights as they were.
TEST(LoraPeft, UnloadingAfterALayerWasReplacedChangesNothing) {
  const DecoderConfig cfg = lora_decoder_config();
  auto m = std::make_shared<Decoder>(cfg);
  auto lora = apply_lora(m, lora_test_config(LoraInit::Random));
  Generator gen(3);
  m->replace_submodule("layers.1.feed_forward.w2", std::make_shared<Linear>(64, 32, false, gen));
  const auto base = base_weights(*m);
  for (bool merge : {true, false}) {
    expect_error([&] { merge ? lora->merge_and_unload() : lora->unload(); },
                 {"layers.1.feed_forward.w2", "no longer holds the layer apply_lora put there"});
    EXPECT_EQ(lora->layers().size(), 14u);
    EXPECT_NE(std::dynamic_pointer_cast<LoraLinear>(m->get_submodule("layers.0.attention.wq")),
              nullptr);
    EXPECT_FALSE(lora->layers().front().second->slot(0).merged);
    EXPECT_EQ(largest_change(*m, base), 0.0) << "merging changed a weight before the error";
  }
}

// A mixed batch names this rank's rows, so an input whose batch dim is split over the layer's
// mesh is refused, naming the input, rather than masked with the wrong rows.
TEST(LoraPeft, AMixedBatchOverABatchShardedInputIsRefused) {
  auto routing = std::make_shared<LoraRouting>();
  Generator gen(4);
  auto layer = std::make_shared<LoraLinear>(Linear(8, 8, false, gen),
                                            LoraSlots{.max_adapters = 1, .max_rank = 4}, routing);
  layer->init_slot(0, "a", lora_test_config(LoraInit::Random), "layer");
  DeviceMesh mesh(Shape{world_size()}, {"tp"});
  const DTensor x = distribute_tensor(randn({2 * world_size(), 8}, gen), mesh, {Shard(0)});
  routing->sample_slots = std::vector<int64_t>(2, 0);
  expect_error([&] { layer->forward_dtensor(x); },
               {"a mixed batch", "needs the input's batch dim whole", "S(0)"});
  routing->sample_slots.reset();
  routing->active_slot = 0;
  EXPECT_EQ(layer->forward_dtensor(x).shape(), (Shape{2 * world_size(), 8}));
}
