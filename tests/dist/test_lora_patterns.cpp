// PEFT's LoraConfig fields that choose the modules an adapter covers and their ranks:
// rank_pattern, alpha_pattern, exclude_modules and target_modules "all-linear"; in the model,
// in PEFT's files, in the adapter table, and under every layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

const LoraLinear::Slot& slot_at(const LoraModel& lora, const std::string& path, int64_t s = 0) {
  for (const auto& [p, l] : lora.layers())
    if (p == path) return l->slot(s);
  ADD_FAILURE() << "no layer " << path;
  static const LoraLinear::Slot none;
  return none;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// r 4 and alpha 8 but: wq rank 2 (first key wins over "attention\\.w."), the other attention
// projections rank 6; every feed-forward w1 alpha 3.
LoraConfig patterned(LoraInit init = LoraInit::Random) {
  LoraConfig c = lora_test_config(init);
  c.rank_pattern = {{"wq", 2}, {"attention\\.w.", 6}};
  c.alpha_pattern = {{"feed_forward.w1", 3}};
  return c;
}

}  // namespace

TEST(LoraPatterns, EachModuleTakesItsPatternsRankAndAlpha) {
  for (bool rslora : {false, true}) {
    LoraConfig c = patterned();
    c.use_rslora = rslora;
    auto m = std::make_shared<Decoder>(lora_decoder_config());
    auto lora = apply_lora(m, c);
    auto scale = [&](double alpha, double r) { return rslora ? alpha / std::sqrt(r) : alpha / r; };
    for (const std::string l : {"layers.0.", "layers.1."}) {
      EXPECT_EQ(slot_at(*lora, l + "attention.wq").r, 2);
      EXPECT_DOUBLE_EQ(slot_at(*lora, l + "attention.wq").scale, scale(8, 2));
      EXPECT_EQ(slot_at(*lora, l + "attention.wk").r, 6);
      EXPECT_DOUBLE_EQ(slot_at(*lora, l + "attention.wo").scale, scale(8, 6));
      EXPECT_EQ(slot_at(*lora, l + "feed_forward.w1").r, 4);
      EXPECT_DOUBLE_EQ(slot_at(*lora, l + "feed_forward.w1").scale, scale(3, 4));
      EXPECT_DOUBLE_EQ(slot_at(*lora, l + "feed_forward.w2").scale, scale(8, 4));
    }
    // max_rank 0: the largest r the adapter uses.
    EXPECT_EQ(lora->layers()[0].second->max_rank(), 6);
    const auto values = lora->read_adapter("default");
    EXPECT_EQ(values.at("layers.0.attention.wq.lora_A.weight").shape(), (Shape{2, 32}));
    EXPECT_EQ(values.at("layers.1.attention.wv.lora_B.weight").shape()[1], 6);
    EXPECT_EQ(values.at("layers.1.feed_forward.w3.lora_A.weight").shape()[0], 4);
    lora->write_adapter("default", values);
  }
}

// One Linear with rank 2 and alpha 6 from the patterns: y = x W^T + 3 x A^T B^T.
TEST(LoraPatterns, OutputUsesTheModulesOwnScale) {
  Generator gen(11);
  auto m = std::make_shared<OneLayer>(std::make_shared<Linear>(8, 4, false, gen));
  LoraConfig c = lora_test_config(LoraInit::Random);
  c.target_modules = {"proj"};
  c.rank_pattern = {{"proj", 2}};
  c.alpha_pattern = {{"pro.", 6}};
  const Tensor w = m->proj->weight.full().clone();
  auto lora = apply_lora(m, c, "default", {.max_adapters = 1, .max_rank = 4});
  const auto ab = lora->read_adapter("default");
  const Tensor& a = ab.at("proj.lora_A.weight");
  const Tensor& b = ab.at("proj.lora_B.weight");
  ASSERT_EQ(a.shape(), (Shape{2, 8}));
  const Tensor x = randn({3, 8}, gen);
  const Tensor want =
      add(kernels::matmul(x, w, false, true),
          mul(kernels::matmul(kernels::matmul(x, a, false, true), b, false, true), 3.0));
  expect_close((*m)(x), want, 1e-6, "output with the pattern's scale 6 / 2");
}

TEST(LoraPatterns, ARankPastTheSlotsIsRefusedNamingTheModule) {
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  expect_error([&] { apply_lora(m, patterned(), "default", {.max_adapters = 1, .max_rank = 4}); },
               {"slots of rank 4", "of rank 6 at 'layers.0.attention.wk'"});
  // Nothing changed: the same model takes LoRA then.
  auto lora = apply_lora(m, lora_test_config(), "default", {.max_adapters = 2, .max_rank = 4});
  expect_error([&] { lora->add_adapter("big", patterned()); },
               {"adapter 'big' has r 6 at 'layers.0.attention.wk'", "at most rank 4"});
  EXPECT_EQ(lora->adapters(), (std::vector<std::string>{"default"}));
  LoraConfig bad = lora_test_config();
  bad.rank_pattern = {{"w(q", 2}};
  expect_error([&] { lora->add_adapter("bad", bad); },
               {"rank_pattern key 'w(q' is not a regular expression"});
  bad.rank_pattern = {{"wq", 0}};
  expect_error([&] { lora->add_adapter("bad", bad); }, {"rank_pattern['wq'] must be positive"});
  bad.rank_pattern = {{"wq", 3}};
  bad.init_lora_weights = LoraInit::Orthogonal;
  expect_error([&] { lora->add_adapter("bad", bad); }, {"rank_pattern['wq'] = 3"});
}

TEST(LoraPatterns, ExcludeModulesLeavesOutWhatTheTargetsName) {
  LoraConfig c = lora_test_config();
  c.target_modules = {"wq", "wk"};
  c.exclude_modules = {"layers.0.attention.wq", "wk"};
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, c);
  EXPECT_EQ(wrapped(*lora), (std::vector<std::string>{"layers.1.attention.wq"}));
  c.exclude_modules = {"attention.wz"};
  expect_error([&] { apply_lora(std::make_shared<Decoder>(lora_decoder_config()), c); },
               {"exclude_modules entry 'attention.wz' matches no module"});
  c.exclude_modules = {"wk", "attention.wq"};
  expect_error([&] { apply_lora(std::make_shared<Decoder>(lora_decoder_config()), c); },
               {"no module of Decoder is left to adapt"});
  c.exclude_modules = {""};
  expect_error([&] { apply_lora(std::make_shared<Decoder>(lora_decoder_config()), c); },
               {"an empty name in exclude_modules"});
}

// PEFT's string forms: a regular expression the module's whole path must match, to target
// (target_modules_regex) or to exclude (exclude_modules_regex); add_adapter reads them alike.
TEST(LoraPatterns, RegexTargetsAndExcludesMatchTheWholePath) {
  auto fresh = [] { return std::make_shared<Decoder>(lora_decoder_config()); };
  LoraConfig c = lora_test_config();
  c.target_modules = {};
  c.target_modules_regex = "layers\\.[0-9]+\\.attention\\.w[qv]";
  auto lora = apply_lora(fresh(), c, "default", {.max_adapters = 2});
  EXPECT_EQ(wrapped(*lora),
            (std::vector<std::string>{"layers.0.attention.wq", "layers.0.attention.wv",
                                      "layers.1.attention.wq", "layers.1.attention.wv"}));
  LoraConfig second = c;
  second.target_modules_regex = "layers\\.1\\.attention\\.wq";
  lora->add_adapter("second", second);
  EXPECT_EQ(slot_at(*lora, "layers.1.attention.wq", 1).adapter, "second");
  EXPECT_EQ(slot_at(*lora, "layers.0.attention.wq", 1).adapter, "");
  // Excluding by regex, beside a list of targets.
  LoraConfig ex = lora_test_config();
  ex.target_modules = {"wq", "wk"};
  ex.exclude_modules_regex = "layers\\.0\\..*";
  EXPECT_EQ(wrapped(*apply_lora(fresh(), ex)),
            (std::vector<std::string>{"layers.1.attention.wq", "layers.1.attention.wk"}));
  // Each refusal: `from` changed by `edit`, with the error naming what.
  auto refused = [&](LoraConfig from, const std::function<void(LoraConfig&)>& edit,
                     const std::vector<std::string>& what) {
    edit(from);
    expect_error([&] { apply_lora(fresh(), from); }, what);
  };
  // The whole path: a tail alone matches nothing.
  refused(c, [](LoraConfig& x) { x.target_modules_regex = "attention\\.wq"; },
          {"target_modules_regex 'attention\\.wq' matches the whole path of no module"});
  refused(ex, [](LoraConfig& x) { x.exclude_modules_regex = "nothing"; },
          {"exclude_modules_regex 'nothing' matches the whole path of no module"});
  refused(c, [](LoraConfig& x) { x.target_modules_regex = ".*_norm"; },
          {"not a Linear or an Embedding"});
  refused(c, [](LoraConfig& x) { x.target_modules = {"wq"}; },
          {"target_modules and target_modules_regex are both set"});
  refused(ex, [](LoraConfig& x) { x.exclude_modules = {"wk"}; },
          {"exclude_modules and exclude_modules_regex are both set"});
  refused(c, [](LoraConfig& x) { x.target_modules_regex = "w(q"; },
          {"target_modules_regex 'w(q' is not a regular expression"});
  refused(c, [](LoraConfig& x) { x.layers_to_transform = {0}; },
          {"layers_to_transform cannot be used with target_modules_regex"});
}

// The string forms in PEFT's files (written as strings, loaded back onto the same layers) and in
// the adapter table.
TEST(LoraPatterns, RegexFormsSurvivePeftFilesAndTheAdapterTable) {
  const std::string dir = scratch_dir("lora_regex");
  LoraConfig c = lora_test_config(LoraInit::Random);
  c.target_modules = {};
  c.target_modules_regex = "layers\\.[0-9]+\\.(attention\\.w[qv]|feed_forward\\.w2)";
  c.exclude_modules_regex = "layers\\.1\\.feed_forward\\.w2";
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, c, "default", {.max_adapters = 2});
  const std::vector<std::string> layers = wrapped(*lora);
  EXPECT_EQ(layers.size(), 5u);
  lora->save_adapter(dir + "/adapter", "default");
  const std::string text = read_text(dir + "/adapter/adapter_config.json");
  EXPECT_NE(text.find("\"target_modules\": \"layers\\\\.[0-9]+"), std::string::npos) << text;
  EXPECT_NE(text.find("\"exclude_modules\": \"layers\\\\.1"), std::string::npos) << text;
  auto m2 = std::make_shared<Decoder>(lora_decoder_config());
  auto other = apply_lora(m2, c, "base", {.max_adapters = 2});
  other->load_adapter(dir + "/adapter", "loaded");
  EXPECT_EQ(other->config("loaded").target_modules_regex, c.target_modules_regex);
  EXPECT_EQ(other->config("loaded").exclude_modules_regex, c.exclude_modules_regex);
  const auto want = lora->read_adapter("default");
  const auto got = other->read_adapter("loaded");
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [key, t] : want)
    expect_identical(got.at(key), t, key);
  // The adapter table.
  auto m3 = std::make_shared<Decoder>(lora_decoder_config());
  auto third = apply_lora(m3, c, "x", {.max_adapters = 2});
  third->delete_adapter("x");
  third->load_state_dict(lora->state_dict());
  EXPECT_EQ(third->config("default").target_modules_regex, c.target_modules_regex);
  EXPECT_EQ(third->config("default").exclude_modules_regex, c.exclude_modules_regex);
  EXPECT_EQ(wrapped(*third), layers);
}

// "all-linear": every Linear but a Decoder's output layer; any Linear of another model.
TEST(LoraPatterns, AllLinearWrapsEveryLinearButTheOutputLayer) {
  LoraConfig c = lora_test_config();
  c.target_modules = {"all-linear"};
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, c);
  std::vector<std::string> want;
  for (const std::string l : {"layers.0.", "layers.1."})
    for (const std::string p : {"attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"})
      want.push_back(l + p);
  std::vector<std::string> got = wrapped(*lora);
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
  // As in PEFT, an entry names a module, not what is inside it: "layers.1.attention" (no Linear)
  // leaves its projections adapted.
  c.exclude_modules = {"feed_forward.w3", "layers.1.attention"};
  EXPECT_EQ(apply_lora(std::make_shared<Decoder>(lora_decoder_config()), c)->layers().size(), 12u);
  Generator gen(5);
  auto one = std::make_shared<OneLayer>(std::make_shared<Linear>(8, 4, false, gen));
  c.exclude_modules.clear();
  EXPECT_EQ(wrapped(*apply_lora(one, c)), (std::vector<std::string>{"proj"}));
  c.target_modules = {"all-linear", "wq"};
  expect_error([&] { apply_lora(std::make_shared<Decoder>(lora_decoder_config()), c); },
               {"\"all-linear\" stands alone"});
}

// A layer an earlier apply_lora wrapped holds that LoraModel's slots: naming it is refused (its
// adapters go in with add_adapter), so "all-linear" in a second apply_lora leaves it out instead
// of failing, and the second model's add_adapter with "all-linear" covers its own layers only.
TEST(LoraPatterns, AllLinearPassesOverTheLayersAnEarlierApplyWrapped) {
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto first = apply_lora(m, lora_test_config(), "first", {.max_adapters = 2, .max_rank = 4});
  LoraConfig c = lora_test_config();
  c.target_modules = {"wq", "w2"};
  auto m2 = std::make_shared<Decoder>(lora_decoder_config());
  auto some = apply_lora(m2, c, "some", {.max_adapters = 2});
  c.target_modules = {"all-linear"};
  auto rest = apply_lora(m2, c, "rest", {.max_adapters = 2});
  std::vector<std::string> want;
  for (const std::string l : {"layers.0.", "layers.1."})
    for (const std::string p :
         {"attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w3"})
      want.push_back(l + p);
  EXPECT_EQ(wrapped(*rest), want);
  EXPECT_EQ(wrapped(*some),
            (std::vector<std::string>{"layers.0.attention.wq", "layers.0.feed_forward.w2",
                                      "layers.1.attention.wq", "layers.1.feed_forward.w2"}));
  rest->add_adapter("more", c);
  EXPECT_EQ(rest->read_adapter("more").size(), 2 * want.size());
  some->add_adapter("all", c);
  EXPECT_EQ(some->read_adapter("all").size(), 2 * some->layers().size());
  first->add_adapter("all", c);
  EXPECT_EQ(first->read_adapter("all").size(), 2 * first->layers().size());
  // Every layer has an adapter: both models' layers stay where they were put.
  for (const auto& [path, l] : some->layers())
    EXPECT_EQ(m2->get_submodule(path), l->module_ptr()) << path;
  const Batch b = affine_batch(0, 2, lora_decoder_config().max_seq_len, 32);
  EXPECT_EQ((*m2)(b.ids).shape(), (Shape{2, lora_decoder_config().max_seq_len, 32}));
  // Nothing is left for a third.
  expect_error([&] { apply_lora(m2, c, "third"); }, {"no module of Decoder is left to adapt"});
  // The first model covered every Linear but the output layer: nothing is left either.
  expect_error([&] { apply_lora(m, c, "second"); }, {"no module of Decoder is left to adapt"});
  // Named, a wrapped layer is still refused.
  c.target_modules = {"wq"};
  expect_error([&] { apply_lora(m, c, "second"); }, {"already has LoRA slots"});
  EXPECT_EQ(first->adapters(), (std::vector<std::string>{"first", "all"}));
}

// layers_to_transform keeps the modules of the listed layers, whose index follows layers_pattern
// (or, without it, any component); an entry that is a module's whole path keeps it anywhere.
TEST(LoraPatterns, LayersToTransformKeepsTheListedLayers) {
  LoraConfig c = lora_test_config();
  c.target_modules = {"wq", "w1", "layers.0.attention.wk"};
  c.layers_to_transform = {1};
  auto build = [&] { return apply_lora(std::make_shared<Decoder>(lora_decoder_config()), c); };
  const std::vector<std::string> want = {"layers.0.attention.wk", "layers.1.attention.wq",
                                         "layers.1.feed_forward.w1"};
  EXPECT_EQ(wrapped(*build()), want);
  c.layers_pattern = {"lay.rs"};
  EXPECT_EQ(wrapped(*build()), want);
  c.target_modules = {"wq"};
  c.layers_pattern = {"blocks", "h"};
  expect_error([&] { build(); }, {"no module of Decoder is left to adapt"});
  c.layers_to_transform.clear();
  expect_error([&] { build(); }, {"layers_pattern is set without layers_to_transform"});
  c.layers_pattern.clear();
  c.layers_to_transform = {-1};
  expect_error([&] { build(); }, {"layers_to_transform holds -1"});
  c.layers_to_transform = {0};
  c.target_modules = {"all-linear"};
  expect_error([&] { build(); }, {"layers_to_transform cannot be used with target_modules"});
}

// PEFT reads exclude_modules as names and dotted suffixes, as it reads targets: a pattern is
// written as the paths of the modules it matched, targeted or not ("wq" names every layer's).
TEST(LoraPatterns, PeftFilesListTheModulesAnExcludePatternMatched) {
  const std::string dir = scratch_dir("lora_exclude_pattern");
  LoraConfig c = lora_test_config(LoraInit::Random);
  c.target_modules = {"wq", "w1"};
  c.exclude_modules = {"layers.[0].attention.w?", "layers.1.feed_forward.w1"};
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, c);
  lora->save_adapter(dir + "/adapter", "default");
  auto m2 = std::make_shared<Decoder>(lora_decoder_config());
  auto other = apply_lora(m2, lora_test_config(), "base", {.max_adapters = 2});
  other->load_adapter(dir + "/adapter", "loaded");
  std::vector<std::string> excluded = other->config("loaded").exclude_modules;
  std::sort(excluded.begin(), excluded.end());
  EXPECT_EQ(excluded, (std::vector<std::string>{"layers.0.attention.wk", "layers.0.attention.wo",
                                                "layers.0.attention.wq", "layers.0.attention.wv",
                                                "layers.1.feed_forward.w1"}));
  const auto want = lora->read_adapter("default"), have = other->read_adapter("loaded");
  ASSERT_EQ(have.size(), want.size());
  EXPECT_EQ(have.count("layers.0.attention.wq.lora_A.weight"), 0u);
  EXPECT_EQ(have.count("layers.1.attention.wq.lora_A.weight"), 1u);
  for (const auto& [key, t] : want)
    expect_identical(have.at(key), t, key);
}

// save_adapter writes PEFT's fields (patterns in their order, the modules "all-linear" resolved
// to) and load_adapter reads them back onto a model with other slots and layout.
TEST(LoraPatterns, PeftFilesKeepThePatterns) {
  const std::string dir = scratch_dir("lora_patterns");
  LoraConfig c = patterned();
  c.exclude_modules = {"layers.1.feed_forward.w2"};
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, c);
  lora->save_adapter(dir + "/adapter", "default");
  const std::string text = read_text(dir + "/adapter/adapter_config.json");
  EXPECT_NE(text.find("\"rank_pattern\": {\n    \"wq\": 2,\n    \"attention\\\\.w.\": 6\n  }"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("\"alpha_pattern\": {\n    \"feed_forward.w1\": 3.0\n  }"), std::string::npos)
      << text;
  EXPECT_NE(text.find("\"exclude_modules\": [\n    \"layers.1.feed_forward.w2\"\n  ]"),
            std::string::npos)
      << text;
  auto m2 = std::make_shared<Decoder>(lora_decoder_config());
  auto other = apply_lora(m2, lora_test_config(), "base", {.max_adapters = 2, .max_rank = 8});
  other->load_adapter(dir + "/adapter", "loaded");
  const LoraConfig& got = other->config("loaded");
  EXPECT_EQ(got.rank_pattern, c.rank_pattern);
  EXPECT_EQ(got.alpha_pattern, c.alpha_pattern);
  EXPECT_EQ(got.exclude_modules, c.exclude_modules);
  EXPECT_DOUBLE_EQ(slot_at(*other, "layers.0.feed_forward.w1", 1).scale, 3.0 / 4.0);
  const auto want = lora->read_adapter("default"), have = other->read_adapter("loaded");
  ASSERT_EQ(have.size(), want.size());
  EXPECT_EQ(have.count("layers.1.feed_forward.w2.lora_A.weight"), 0u);
  for (const auto& [key, t] : want)
    expect_identical(have.at(key), t, key);

  // "all-linear" is saved as the modules it resolved to, and read in both forms.
  LoraConfig all = lora_test_config(LoraInit::Random);
  all.target_modules = {"all-linear"};
  auto m3 = std::make_shared<Decoder>(lora_decoder_config());
  auto lora3 = apply_lora(m3, all, "default", {.max_adapters = 3});
  lora3->save_adapter(dir + "/all", "default");
  const std::string saved = read_text(dir + "/all/adapter_config.json");
  EXPECT_NE(saved.find("\"layers.1.feed_forward.w3\""), std::string::npos) << saved;
  EXPECT_EQ(saved.find("\"all-linear\""), std::string::npos) << saved;
  lora3->load_adapter(dir + "/all", "listed");
  EXPECT_EQ(lora3->config("listed").target_modules.size(), 14u);

  // layers_to_transform: written as a list, read as a list or PEFT's single integer.
  LoraConfig one = lora_test_config(LoraInit::Random);
  one.layers_to_transform = {1};
  one.layers_pattern = {"layers"};
  auto m4 = std::make_shared<Decoder>(lora_decoder_config());
  auto lora4 = apply_lora(m4, one);
  lora4->save_adapter(dir + "/adapter", "default");
  const std::string layered = read_text(dir + "/adapter/adapter_config.json");
  EXPECT_NE(layered.find("\"layers_to_transform\": [\n    1\n  ]"), std::string::npos) << layered;
  EXPECT_NE(layered.find("\"layers_pattern\": [\n    \"layers\"\n  ]"), std::string::npos)
      << layered;
  const std::string single = peft_config_variant(
      dir, "single", "\"layers_to_transform\": [\n    1\n  ]", "\"layers_to_transform\": 1");
  for (const std::string& from : {dir + "/adapter", single}) {
    auto m5 = std::make_shared<Decoder>(lora_decoder_config());
    auto lora5 = apply_lora(m5, lora_test_config(), "base", {.max_adapters = 2});
    lora5->load_adapter(from, "layered");
    EXPECT_EQ(lora5->config("layered").layers_to_transform, std::vector<int64_t>{1});
    const auto have = lora5->read_adapter("layered");
    EXPECT_EQ(have.size(), 14u) << from;
    for (const auto& [key, t] : lora4->read_adapter("default"))
      expect_identical(have.at(key), t, from + " " + key);
  }
}

// A PEFT file with these fields loads (it used to be refused); a bad value is refused naming the
// field, and leaves no adapter behind.
TEST(LoraPatterns, PeftFilesWithTheFieldsLoadAndBadValuesAreRefused) {
  const std::string dir = scratch_dir("lora_patterns_fields");
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, lora_test_config(LoraInit::Random), "default", {.max_adapters = 2});
  lora->save_adapter(dir + "/adapter", "default");
  const std::string saved = read_text(dir + "/adapter/adapter_config.json");
  const size_t open = saved.find("\"target_modules\": [");
  ASSERT_NE(open, std::string::npos) << saved;
  const std::string list = saved.substr(open, saved.find(']', open) + 1 - open);
  const auto values = lora->read_adapter("default");
  auto loads_as_saved = [&](const std::string& name, const std::string& from,
                            const std::string& to) {
    lora->load_adapter(peft_config_variant(dir, name, from, to), name);
    for (const auto& [key, t] : lora->read_adapter(name))
      expect_identical(t, values.at(key), name + " " + key);
    EXPECT_EQ(lora->layers()[0].second->slot(1).adapter, name);
    const double scale = lora->layers()[0].second->slot(1).scale;
    lora->delete_adapter(name);
    return scale;
  };
  EXPECT_DOUBLE_EQ(loads_as_saved("alpha", "\"alpha_pattern\": {}",
                                  "\"alpha_pattern\": {\"layers.0.attention.wq\": 12}"),
                   12.0 / 4.0);
  EXPECT_DOUBLE_EQ(loads_as_saved("rank", "\"rank_pattern\": {}", "\"rank_pattern\": {\"w.\": 4}"),
                   8.0 / 4.0);
  loads_as_saved("all", list, "\"target_modules\": \"ALL-LINEAR\"");
  loads_as_saved("exclude", "\"exclude_modules\": null", "\"exclude_modules\": []");
  expect_edits_refused(
      *lora, dir,
      {
          {"r0", "\"rank_pattern\": {}", "\"rank_pattern\": {\"wq\": 0}", {"rank_pattern['wq']"}},
          {"rtext",
           "\"rank_pattern\": {}",
           "\"rank_pattern\": {\"wq\": \"8\"}",
           {"rank_pattern['wq'] is \"8\", not an integer"}},
          {"alist", "\"alpha_pattern\": {}", "\"alpha_pattern\": [8]", {"alpha_pattern is [8]"}},
          {"regex",
           "\"exclude_modules\": null",
           "\"exclude_modules\": \"w(q\"",
           {"exclude_modules_regex 'w(q' is not a regular expression"}},
          {"layers",
           "\"layers_to_transform\": null",
           "\"layers_to_transform\": \"0\"",
           {"layers_to_transform is \"0\", not an integer or a list of integers"}},
          {"lpattern",
           "\"layers_pattern\": null",
           "\"layers_pattern\": \"layers\"",
           {"layers_pattern is set without layers_to_transform"}},
          {"wider",
           "\"rank_pattern\": {}",
           "\"rank_pattern\": {\"wq\": 2}",
           {"layers.0.attention.wq.lora_A.weight", "[2, 32]"}},
      });
  EXPECT_EQ(lora->adapters(), (std::vector<std::string>{"default"}));
}

// The adapter table keeps the fields; a table written before them still loads.
TEST(LoraPatterns, TheAdapterTableKeepsThePatterns) {
  LoraConfig c = patterned();
  c.exclude_modules = {"layers.0.feed_forward.w2"};
  c.layers_to_transform = {0, 1};
  c.layers_pattern = {"layers"};
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, c, "default", {.max_adapters = 2, .max_rank = 6});
  const StateDict sd = lora->state_dict();
  // Per-module ranks make format 2, which older builds refuse instead of misreading.
  EXPECT_NE(std::get<std::string>(sd.at("adapters")).find("\"format\":2"), std::string::npos);
  auto m2 = std::make_shared<Decoder>(lora_decoder_config());
  auto other = apply_lora(m2, c, "x", {.max_adapters = 2, .max_rank = 6});
  other->delete_adapter("x");
  other->load_state_dict(sd);
  const LoraConfig& got = other->config("default");
  EXPECT_EQ(got.rank_pattern, c.rank_pattern);
  EXPECT_EQ(got.alpha_pattern, c.alpha_pattern);
  EXPECT_EQ(got.exclude_modules, c.exclude_modules);
  EXPECT_EQ(got.layers_to_transform, c.layers_to_transform);
  EXPECT_EQ(got.layers_pattern, c.layers_pattern);
  EXPECT_EQ(slot_at(*other, "layers.1.attention.wq").r, 2);
  EXPECT_DOUBLE_EQ(slot_at(*other, "layers.1.feed_forward.w1").scale, 3.0 / 4.0);
  EXPECT_EQ(other->layers().size(), lora->layers().size());
  // A table from before the fields: no exclusions, every module at r.
  auto m3 = std::make_shared<Decoder>(lora_decoder_config());
  auto third = apply_lora(m3, lora_test_config());
  std::string old = std::get<std::string>(third->state_dict().at("adapters"));
  EXPECT_NE(old.find("\"format\":1"), std::string::npos) << old;
  for (const char* f : {"\"exclude_modules\":[],", "\"rank_pattern\":[],", "\"alpha_pattern\":[],",
                        "\"layers_pattern\":[],", "\"layers_to_transform\":[],"}) {
    const size_t at = old.find(f);
    ASSERT_NE(at, std::string::npos) << f << " in " << old;
    old.erase(at, std::string(f).size());
  }
  third->delete_adapter("default");
  third->load_state_dict(StateDict{{"adapters", old}});
  EXPECT_TRUE(third->config("default").rank_pattern.empty());
  EXPECT_EQ(slot_at(*third, "layers.0.attention.wq").r, 4);
}

// Under every layout: the same modules, the same initial values, the plain model's logits, and
// after three AdamW steps the plain model's losses and adapters (each module's gradient reaches
// its own r columns only).
TEST(LoraPatterns, EveryLayoutGivesThePlainModel) {
  LoraConfig c = patterned();
  c.exclude_modules = {"layers.1.attention.wv"};
  c.target_modules.push_back("layers.0.attention.wq");
  c.layers_to_transform = {1};
  auto plain = std::make_shared<Decoder>(lora_decoder_config());
  auto ref_lora = apply_lora(plain, c);
  const auto ref = ref_lora->read_adapter("default");
  const Batch b = affine_batch(0, 4, 8, lora_decoder_config().vocab_size);
  const Tensor want = (*plain)(b.ids);
  LoraRun ref_run{"plain", std::make_shared<Decoder>(lora_decoder_config()), nullptr, 0, 1};
  ref_run.lora = apply_lora(ref_run.model, c);
  const LoraTrained reference = lora_train(ref_run, 3);  // AdamW, eps 1e-6
  const std::vector<double>& ref_losses = reference.losses;
  const auto& trained = reference.adapter;
  for (const LoraLayout& l : lora_layouts()) {
    LoraRun run = l.build(lora_decoder_config(), c);
    EXPECT_EQ(wrapped(*run.lora), wrapped(*ref_lora)) << l.name;
    EXPECT_EQ(run.lora->layers().size(), 7u) << l.name;
    EXPECT_EQ(slot_at(*run.lora, "layers.0.attention.wq").r, 2) << l.name;
    EXPECT_EQ(slot_at(*run.lora, "layers.1.attention.wk").r, 6) << l.name;
    const auto got = run.lora->read_adapter("default");
    ASSERT_EQ(got.size(), ref.size()) << l.name;
    for (const auto& [key, t] : ref)
      expect_identical(got.at(key), t, l.name + " " + key);
    expect_close(run.logits(b.ids), want, 1e-5, l.name + " logits");
    const LoraTrained after = lora_train(run, 3);
    const std::vector<double>& losses = after.losses;
    for (size_t i = 0; i < losses.size(); ++i)
      EXPECT_NEAR(losses[i], ref_losses[i], 1e-6 * ref_losses[i]) << l.name << " step " << i;
    for (const auto& [key, t] : after.adapter)
      expect_close(t, trained.at(key), 1e-5, l.name + " trained " + key);
  }
}
