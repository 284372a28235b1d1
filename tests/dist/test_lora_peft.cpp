// Where LoRA must read as PEFT does: which modules target_modules names, what a second
// apply_lora or add_adapter may change, initial values and dropout streams that depend on the
// adapter alone, and the PEFT config fields that cannot load. Merging, unloading and FSDP are in
// test_lora_peft_merge.cpp, of the same binary.
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

LoraConfig targeting(std::vector<std::string> targets, LoraInit init = LoraInit::Kaiming) {
  LoraConfig c = lora_test_config(init);
  c.target_modules = std::move(targets);
  return c;
}

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
    auto m = std::make_shared<OneLayer>(std::make_shared<Linear>(8, 4, false, gen));
    // Values float32 cannot hold.
    m->proj->weight = Parameter(mul(m->proj->weight.full().to(DType::Float64), 1.0 + 1e-9), false);
    const Tensor w0 = m->proj->weight.full().clone();
    auto lora = apply_lora(m, targeting({"proj"}, init));
    const Parameter& w = lora->layers()[0].second->base_weight();
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
  auto holder = std::make_shared<OneLayer>(std::make_shared<Linear>(8, 4, false, gen));
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
  const std::string dir = scratch_dir("lora_peft_targets");
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
  auto m = std::make_shared<OneLayer>(std::make_shared<Linear>(8, 4, false, gen));
  const Tensor x = randn({3, 8}, gen);
  const Tensor base = (*m)(x);
  LoraConfig cfg = targeting({"proj"}, LoraInit::Orthogonal);
  cfg.r = 3;
  expect_error([&] { apply_lora(m, cfg); },
               {"init_lora_weights \"orthogonal\" needs an even r, got 3"});
  cfg.r = 4;
  auto lora = apply_lora(m, cfg, "default", {.max_adapters = 2, .max_rank = 6});
  auto& layer = dynamic_cast<LoraLinear&>(*lora->layers()[0].second);
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
  const std::string dir = scratch_dir("lora_peft_orthogonal");
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
  const std::string dir = scratch_dir("lora_peft_fields");
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, lora_test_config(), "default", {.max_adapters = 2});
  lora->save_adapter(dir + "/adapter", "default");
  const std::string saved = read_text(dir + "/adapter/adapter_config.json");
  std::vector<PeftConfigEdit> cases = {
      {"pissa",
       "\"init_lora_weights\": true",
       "\"init_lora_weights\": \"pissa\"",
       {"init_lora_weights is \"pissa\"", "unchanged base model"}},
      {"layers",
       "\"layers_to_transform\": null",
       "\"layers_to_transform\": [0.5]",
       {"layers_to_transform is [0.5], not an integer"}},
      {"exclude",
       "\"exclude_modules\": null",
       "\"exclude_modules\": \"(\"",
       {"exclude_modules_regex '(' is not a regular expression"}},
      {"save",
       "\"modules_to_save\": null",
       "\"modules_to_save\": [\"output\"]",
       {"'output' names a module apply_lora made no copies for"}},
      {"save_form",
       "\"modules_to_save\": null",
       "\"modules_to_save\": \"output\"",
       {"modules_to_save is \"output\", not a list"}},
      {"rslora",
       "\"use_rslora\": false",
       "\"use_rslora\": \"yes\"",
       {"use_rslora is not a boolean"}},
      {"bias", "\"peft_type\"", "\"lora_bias\": true, \"peft_type\"", {"lora_bias is set"}},
      {"alora",
       "\"peft_type\"",
       "\"alora_invocation_tokens\": [5, 9], \"peft_type\"",
       {"alora_invocation_tokens is set ([5,9])"}},
      {"bdlora",
       "\"peft_type\"",
       "\"use_bdlora\": {\"lora_a_is_blockdiagonal\": true}, \"peft_type\"",
       {"use_bdlora is set", "not supported"}},
      {"kasa", "\"peft_type\"", "\"kasa_config\": {}, \"peft_type\"", {"kasa_config is set ({})"}},
      {"arrow",
       "\"peft_type\"",
       "\"arrow_config\": {\"top_k\": 3}, \"peft_type\"",
       {"arrow_config is set"}},
      {"qalora", "\"peft_type\"", "\"use_qalora\": true, \"peft_type\"", {"use_qalora is set"}},
      {"tokens",
       "\"trainable_token_indices\": null",
       "\"trainable_token_indices\": [1, 2]",
       {"the input embedding", "apply_lora did not wrap for trainable tokens"}},
      {"tokens_form",
       "\"trainable_token_indices\": null",
       "\"trainable_token_indices\": \"x\"",
       {"trainable_token_indices is \"x\", not a list of ids or an object"}},
      {"tokens_id",
       "\"trainable_token_indices\": null",
       "\"trainable_token_indices\": {\"tok_embeddings\": [1.5]}",
       {"trainable_token_indices['tok_embeddings'] holds 1.5, not a token id"}},
  };
  for (PeftConfigEdit& c : cases)  // each error names the file
    c.error.push_back(std::string(c.name) + "/adapter_config.json'");
  expect_edits_refused(*lora, dir, cases);
  const std::string regex = peft_config_variant(dir, "regex", "\"target_modules\": [",
                                                "\"target_modules\": \".*w.\", \"x\": [");
  // PEFT's string form: a regular expression, here naming the same layers.
  lora->load_adapter(regex, "regex");
  EXPECT_EQ(lora->config("regex").target_modules_regex, ".*w.");
  const auto want = lora->read_adapter("default");
  for (const auto& [key, t] : lora->read_adapter("regex"))
    EXPECT_EQ(max_abs_diff(t, want.at(key)), 0.0) << key;
  lora->delete_adapter("regex");
  // Every other field PEFT 0.21's LoraConfig writes, at its default (variants off): it loads.
  const std::string defaults = peft_config_variant(
      dir, "defaults", "\"peft_type\"",
      R"("alora_invocation_tokens": null, "arrow_config": null, "auto_mapping": null,
         "corda_config": null, "ensure_weight_tying": false, "eva_config": null,
         "kasa_config": null, "layer_replication": null, "loftq_config": {}, "lora_bias": false,
         "lora_ga_config": null, "megatron_config": null, "megatron_core": "megatron.core",
         "monteclora_config": null, "peft_version": "0.21.2", "qalora_group_size": 16,
         "runtime_config": {"ephemeral_gpu_offload": false}, "target_parameters": null,
         "use_bdlora": null, "use_qalora": false, "velora_config": null, "peft_type")");
  lora->load_adapter(defaults, "defaults");
  for (const auto& [key, t] : lora->read_adapter("defaults"))
    EXPECT_EQ(max_abs_diff(t, want.at(key)), 0.0) << key;
  lora->delete_adapter("defaults");
  EXPECT_EQ(lora->adapters(), (std::vector<std::string>{"default"}));
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
