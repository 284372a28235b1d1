// Where LoRA must read as PEFT does: which modules target_modules names, what a second
// apply_lora or add_adapter may change, initial values and dropout streams that depend on the
// adapter alone, the PEFT config fields that cannot load, and merges under FSDP.
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

namespace {

std::vector<std::string> wrapped(const LoraModel& lora) {
  std::vector<std::string> out;
  for (const auto& [path, l] : lora.layers())
    out.push_back(path);
  return out;
}

LoraConfig targeting(std::vector<std::string> targets, LoraInit init = LoraInit::Kaiming) {
  LoraConfig c = lora_test_config(init);
  c.target_modules = std::move(targets);
  return c;
}

// One Linear, "proj".
class Holder : public Module {
 public:
  explicit Holder(Generator& gen) : Module("Holder") {
    proj = std::make_shared<Linear>(8, 4, false, gen);
    register_module("proj", proj);
  }
  Tensor forward(const Tensor& x) override { return (*proj)(x); }
  std::shared_ptr<Linear> proj;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

// PEFT's rule for a list: an entry names the modules whose path equals it or ends in "." + it.
TEST(LoraPeft, DottedTargetsMatchAsPathSuffixes) {
  const DecoderConfig cfg = lora_decoder_config();
  auto m = std::make_shared<Decoder>(cfg);
  EXPECT_EQ(wrapped(*apply_lora(m, targeting({"attention.wq"}))),
            (std::vector<std::string>{"layers.0.attention.wq", "layers.1.attention.wq"}));
  m = std::make_shared<Decoder>(cfg);
  EXPECT_EQ(wrapped(*apply_lora(m, targeting({"layers.1.attention.wq", "feed_forward.w[12]"}))),
            (std::vector<std::string>{"layers.0.feed_forward.w1", "layers.0.feed_forward.w2",
                                      "layers.1.attention.wq", "layers.1.feed_forward.w1",
                                      "layers.1.feed_forward.w2"}));
  // A suffix starts at a '.': "ttention.wq" is no module's.
  m = std::make_shared<Decoder>(cfg);
  expect_error([&] { apply_lora(m, targeting({"ttention.wq"})); },
               {"target module 'ttention.wq' matches no module of Decoder"});
}

// Linears named as nn.Sequential names them, "0" and "1".
class Numbered : public Module {
 public:
  explicit Numbered(Generator& gen) : Module("Numbered") {
    first = std::make_shared<Linear>(8, 8, false, gen);
    second = std::make_shared<Linear>(8, 4, false, gen);
    register_module("0", first);
    register_module("1", second);
  }
  Tensor forward(const Tensor& x) override { return (*second)((*first)(x)); }
  std::shared_ptr<Linear> first, second;
};

// An entry names the model's modules, not the adapter slots LoRA adds ("0.lora_A.0" ends in
// ".0"): targets "0" and "1" of a Sequential-like model wrap those layers, adapters are added
// there, and a second apply_lora on "1" passes over the first's slots.
TEST(LoraPeft, TargetsNeverNameTheAdapterSlots) {
  Generator gen(5);
  auto m = std::make_shared<Numbered>(gen);
  auto lora = apply_lora(m, targeting({"0"}), "a", {.max_adapters = 2, .max_rank = 4});
  EXPECT_EQ(wrapped(*lora), (std::vector<std::string>{"0"}));
  lora->add_adapter("b", targeting({"0"}));
  EXPECT_EQ(lora->adapters(), (std::vector<std::string>{"a", "b"}));
  auto second = apply_lora(m, targeting({"1"}), "c");
  EXPECT_EQ(wrapped(*second), (std::vector<std::string>{"1"}));
  EXPECT_EQ((*m)(ones({2, 8})).shape(), (Shape{2, 4}));
}

// A float64 base merges in float64: merging an adapter whose B is zero leaves W as it was, bit for
// bit, and merge then unmerge of a drawn one gives W back to float64 rounding (both went
// through float32, which rounded every element of W).
TEST(LoraPeft, AFloat64BaseMergesInFloat64) {
  for (LoraInit init : {LoraInit::Kaiming, LoraInit::Random}) {
    Generator gen(5);
    auto m = std::make_shared<Holder>(gen);
    // Values float32 cannot hold.
    m->proj->weight = Parameter(mul(m->proj->weight.full().to(DType::Float64), 1.0 + 1e-9), false);
    const Tensor w0 = m->proj->weight.full().clone();
    auto lora = apply_lora(m, targeting({"proj"}, init));
    const Parameter& w = lora->layers()[0].second->weight;
    lora->merge_adapter("default");
    EXPECT_EQ(w.dtype(), DType::Float64);
    if (init == LoraInit::Kaiming) expect_identical(w.full(), w0, "W with a zero B merged");
    lora->unmerge_adapter("default");
    expect_close(w.full(), w0, 1e-12, "W after merge and unmerge");
    lora->merge_adapter("default", /*safe_merge=*/true);
    lora->unmerge_adapter("default");
  }
}

// PEFT's "wq" means every wq: an adapter that would sit on some of them only is refused, naming
// the modules without slots.
TEST(LoraPeft, AddAdapterRefusesTargetsWithoutSlots) {
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora =
      apply_lora(m, targeting({"layers.0.attention.wq"}), "a", {.max_adapters = 2, .max_rank = 4});
  expect_error([&] { lora->add_adapter("b", targeting({"wq"})); },
               {"target module 'wq' names layers.1.attention.wq", "apply_lora put no slots"});
  EXPECT_EQ(lora->adapters(), (std::vector<std::string>{"a"}));
  lora->add_adapter("b", targeting({"layers.0.attention.wq"}));
  EXPECT_EQ(lora->adapters(), (std::vector<std::string>{"a", "b"}));
}

// A second apply_lora (on other modules) freezes the base only: the first one's adapters train on.
TEST(LoraPeft, SecondApplyKeepsTheFirstAdaptersTrainable) {
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto first = apply_lora(m, targeting({"wq"}));
  auto second = apply_lora(m, targeting({"w1"}), "ffn");
  for (Parameter* p : first->parameters())
    EXPECT_TRUE(p->requires_grad()) << p->str();
  for (Parameter* p : second->parameters())
    EXPECT_TRUE(p->requires_grad()) << p->str();
  for (auto& [name, p] : m->named_parameters())
    EXPECT_EQ(p->requires_grad(), name.find("lora_") != std::string::npos) << name;
}

// Initial values depend on (seed, adapter, path) only, not on how wide the slots are: B's draw
// (init_lora_weights false) used to start where the padded A's ended.
TEST(LoraPeft, InitialValuesDoNotDependOnMaxRank) {
  const LoraConfig cfg = lora_test_config(LoraInit::Random);
  auto narrow_slots = std::make_shared<Decoder>(lora_decoder_config());
  auto wide_slots = std::make_shared<Decoder>(lora_decoder_config());
  const auto want = apply_lora(narrow_slots, cfg)->read_adapter("default");
  const auto got = apply_lora(wide_slots, cfg, "default", {.max_rank = 8})->read_adapter("default");
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [key, t] : want)
    expect_identical(got.at(key), t, key);
}

// Each adapter has its own dropout stream: adding another adapter leaves the masks of the one
// training as they were (it used to restart the layer's one stream).
TEST(LoraPeft, AddingAnAdapterLeavesAnothersDropoutMasks) {
  const DecoderConfig dc = lora_decoder_config();
  LoraConfig cfg = lora_test_config(LoraInit::Random);
  cfg.lora_dropout = 0.5;
  auto build = [&] {
    auto m = std::make_shared<Decoder>(dc);
    return std::make_pair(m, apply_lora(m, cfg, "a", {.max_adapters = 2, .max_rank = 4}));
  };
  auto [m1, l1] = build();
  auto [m2, l2] = build();
  const Batch b = affine_batch(0, 2, dc.max_seq_len, dc.vocab_size);
  NoGradGuard no_grad;
  expect_identical((*m2)(b.ids), (*m1)(b.ids), "first forward");
  l2->add_adapter("b", lora_test_config());
  expect_identical((*m2)(b.ids), (*m1)(b.ids), "the forward after adding 'b'");
}

// Under a bfloat16 base with float32 adapters the dropout multiplier 1/(1-p) stays float32 (x is
// cast to the adapters' dtype first, as PEFT does): A's gradient, sum over rows of kept x times
// 1/(1-p), is a whole multiple of 1/(1-p), which a bfloat16-rounded multiplier is not.
TEST(LoraPeft, DropoutScaleStaysExactUnderABfloat16Base) {
  Generator gen(1);
  auto holder = std::make_shared<Holder>(gen);
  holder->proj->weight = Parameter(holder->proj->weight.full().to(DType::BFloat16), false);
  LoraConfig cfg = targeting({"proj"}, LoraInit::Random);
  cfg.r = 2;
  cfg.lora_alpha = 2;
  cfg.lora_dropout = 0.1;
  auto lora = apply_lora(holder, cfg);
  const double keep = 1.0 / (1.0 - 0.1);
  lora->write_adapter("default", {{"proj.lora_A.weight", full({2, 8}, 1.0)},
                                  {"proj.lora_B.weight", full({4, 2}, 1.0)}});
  const Tensor x = full({16, 8}, 1.0, DType::BFloat16);
  backward(sum(cast((*holder)(x), DType::Float32)));
  // dL/dA[j, k] = sum over rows of (B^T 1)[j] * xl[row, k] = 4 * keep * (rows kept in column k).
  const std::vector<float> g = lora->layers().front().second->lora_A(0).grad().to_vector<float>();
  for (size_t i = 0; i < g.size(); ++i) {
    const double kept = double(g[i]) / (4.0 * keep);
    EXPECT_NEAR(kept, std::round(kept), 1e-5) << "A.grad[" << i << "] = " << g[i];
  }
}

// An adapter made with patterns is saved with the paths they matched (PEFT reads names and
// dotted suffixes, not patterns); plain names stay as given.
TEST(LoraPeft, PatternTargetsAreSavedAsThePathsTheyMatched) {
  const std::string dir = scratch_dir("lora_peft_targets_np" + std::to_string(world_size()));
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, targeting({"layers.*.attention.wq", "w2"}));
  lora->save_adapter(dir + "/adapter", "default");
  const std::string text = read_text(dir + "/adapter/adapter_config.json");
  EXPECT_NE(text.find("\"layers.0.attention.wq\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"layers.1.attention.wq\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"w2\""), std::string::npos) << text;
  EXPECT_EQ(text.find('*'), std::string::npos) << text;
  // ... and loads back as PEFT's list.
  auto again = std::make_shared<Decoder>(lora_decoder_config());
  auto l2 = apply_lora(again, targeting({"wq", "w2"}), "default", {.max_adapters = 2});
  l2->load_adapter(dir + "/adapter", "loaded");
  const auto want = lora->read_adapter("default");
  const auto got = l2->read_adapter("loaded");
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [key, t] : want)
    expect_identical(got.at(key), t, key);
}

// PEFT's init_lora_weights "orthogonal": A and B both drawn, from the QR of a random matrix, so
// that B A = 0 and the model starts as its base; r must be even. It changes no base weight, so
// such an adapter's files load (they were refused with PiSSA's and the like), and the adapter
// table keeps the init.
TEST(LoraPeft, OrthogonalInitStartsAsTheBaseWithBothMatricesDrawn) {
  Generator gen(5);
  auto m = std::make_shared<Holder>(gen);
  const Tensor x = randn({3, 8}, gen);
  const Tensor base = (*m)(x);
  LoraConfig cfg = targeting({"proj"}, LoraInit::Orthogonal);
  cfg.r = 3;
  expect_error([&] { apply_lora(m, cfg); },
               {"init_lora_weights \"orthogonal\" needs an even r, got 3"});
  cfg.r = 4;
  auto lora = apply_lora(m, cfg, "default", {.max_adapters = 2, .max_rank = 6});
  LoraLinear& layer = *lora->layers()[0].second;
  const auto values = lora->read_adapter("default");
  const Tensor a = values.at("proj.lora_A.weight"), b = values.at("proj.lora_B.weight");
  auto largest = [](const Tensor& t) { return max_abs_diff(t, zeros(t.shape())); };
  EXPECT_GT(largest(a), 1e-3) << "A was drawn";
  EXPECT_GT(largest(b), 1e-3) << "B was drawn";
  EXPECT_LT(largest(matmul(b, a)), 1e-7) << "B A = 0";
  expect_close((*m)(x), base, 1e-6, "the model starts as its base");
  // The slots' padding stays zero.
  EXPECT_EQ(largest(kernels::narrow(layer.lora_A(0).full(), 0, 4, 2)), 0.0);
  EXPECT_EQ(largest(kernels::narrow(layer.lora_B(0).full(), 1, 4, 2)), 0.0);
  // PEFT's files, and the adapter table.
  const std::string dir = scratch_dir("lora_peft_orthogonal_np" + std::to_string(world_size()));
  lora->save_adapter(dir + "/adapter", "default");
  EXPECT_NE(
      read_text(dir + "/adapter/adapter_config.json").find("\"init_lora_weights\": \"orthogonal\""),
      std::string::npos);
  lora->load_adapter(dir + "/adapter", "loaded");
  EXPECT_EQ(lora->config("loaded").init_lora_weights, LoraInit::Orthogonal);
  for (const auto& [key, t] : lora->read_adapter("loaded"))
    expect_identical(t, values.at(key), "loaded " + key);
  lora->load_state_dict(lora->state_dict());
  EXPECT_EQ(lora->config("default").init_lora_weights, LoraInit::Orthogonal);
}

// PEFT config fields that would load onto other modules than the adapter was trained on, or
// onto a base it does not fit, are refused naming the field; they used to be ignored.
TEST(LoraPeft, UnsupportedPeftFieldsAreRefused) {
  const std::string dir = scratch_dir("lora_peft_fields_np" + std::to_string(world_size()));
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, lora_test_config(), "default", {.max_adapters = 2});
  lora->save_adapter(dir + "/adapter", "default");
  const std::string saved = read_text(dir + "/adapter/adapter_config.json");
  const struct {
    const char* name;
    const char* from;
    const char* to;
    std::vector<std::string> error;
  } cases[] = {
      {"pissa",
       "\"init_lora_weights\": true",
       "\"init_lora_weights\": \"pissa\"",
       {"init_lora_weights is \"pissa\"", "unchanged base model"}},
      {"layers",
       "\"layers_to_transform\": null",
       "\"layers_to_transform\": [0]",
       {"layers_to_transform is set ([0])"}},
      {"exclude",
       "\"peft_type\"",
       "\"exclude_modules\": [\"wq\"], \"peft_type\"",
       {"exclude_modules is set"}},
      {"save",
       "\"modules_to_save\": null",
       "\"modules_to_save\": [\"output\"]",
       {"modules_to_save is set"}},
      {"rslora",
       "\"use_rslora\": false",
       "\"use_rslora\": \"yes\"",
       {"use_rslora is not a boolean"}},
      {"bias", "\"peft_type\"", "\"lora_bias\": true, \"peft_type\"", {"lora_bias is set"}},
      {"alora",
       "\"peft_type\"",
       "\"alora_invocation_tokens\": [5, 9], \"peft_type\"",
       {"alora_invocation_tokens is set ([5,9])"}},
  };
  for (const auto& c : cases) {
    const std::string path = peft_config_variant(dir, c.name, c.from, c.to);
    std::vector<std::string> want = c.error;
    want.push_back(std::string(c.name) + "/adapter_config.json'");
    expect_error([&] { lora->load_adapter(path, c.name); }, want);
  }
  const size_t open = saved.find("\"target_modules\": [");
  ASSERT_NE(open, std::string::npos) << saved;
  const std::string list = saved.substr(open, saved.find(']', open) + 1 - open);
  expect_error(
      [&] {
        lora->load_adapter(
            peft_config_variant(dir, "all", list, "\"target_modules\": \"all-linear\""), "all");
      },
      {"target_modules is \"all-linear\""});
  EXPECT_EQ(lora->adapters(), (std::vector<std::string>{"default"}));
}

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
  for (const bool after_backward : {false, true}) {
    const std::string what =
        after_backward ? "reshard_after_backward off" : "reshard_after_forward off";
    auto m = std::make_shared<Decoder>(cfg);
    auto lora = apply_lora(m, lora_test_config(LoraInit::Random), "default", slots);
    auto state = fully_shard(m, DeviceMesh(Shape{world_size()}, {"dp"}));
    if (after_backward) {
      state->set_reshard_after_backward(false);
      backward(sum((*m)(b.ids)));
    } else {
      state->set_reshard_after_forward(false);
      NoGradGuard no_grad;
      (void)(*m)(b.ids);
    }
    ASSERT_TRUE(state->is_unsharded()) << what;
    lora->add_adapter("b", second);
    for (const auto& [key, t] : plain_lora->read_adapter("b"))
      expect_identical(lora->read_adapter("b").at(key), t, what + ": " + key);
    lora->set_adapter("b");
    NoGradGuard no_grad;
    expect_close((*m)(b.ids), want, 1e-5, what + ": forward with the added adapter");
  }
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

// LoRA dropout on a Partial input: every rank masks its term of the sum with the same mask, so
// the layer gives what it gives the replicated input (not coordinate 0's term alone, masked).
TEST(LoraPeft, DropoutMasksAPartialInputAsTheSumItStandsFor) {
  const int64_t n = world_size();
  DeviceMesh mesh(Shape{n}, {"tp"});
  const LoraConfig config = lora_test_config(LoraInit::Random);
  auto routing = std::make_shared<LoraRouting>();
  routing->active_slot = 0;
  auto make = [&](double dropout) {
    Generator gen(6);
    auto l = std::make_shared<LoraLinear>(Linear(8, 8, false, gen),
                                          LoraSlots{.max_adapters = 1, .max_rank = 4}, routing);
    LoraConfig c = config;
    c.lora_dropout = dropout;
    l->init_slot(0, "a", c, "layer");
    return l;
  };
  Generator gen(5);
  const Tensor x = randn({4, 8}, gen);
  // Unequal terms: rank r holds (r + 1) / (n (n + 1) / 2) of x.
  const Tensor term = mul(x, double(world_rank() + 1) / double(n * (n + 1) / 2));
  const DTensor partial = DTensor::from_local(term, mesh, {Partial()}, x.shape());
  const DTensor replicated = distribute_tensor(x, mesh, {Replicate()});
  const Tensor want = make(0.5)->forward_dtensor(replicated).full_tensor();
  expect_close(make(0.5)->forward(x), want, 1e-6, "one process draws the same mask");
  EXPECT_GT(max_abs_diff(make(0.0)->forward(x), want), 1e-3) << "no dropout ran";
  expect_close(make(0.5)->forward_dtensor(partial).full_tensor(), want, 1e-5, "a partial input");
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
