// What trains with an adapter, as in PEFT: the `bias` modes ("none", "all", "lora_only") with
// their single-adapter rule and trained biases that travel in the adapter's files, and adapters
// in inference mode (load_adapter's default) that stay frozen; under tensor parallelism and FSDP
// as on one rank.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dist/checkpoint_util.h"
#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr int64_t kRows = 4;

// Three biased Linears; LoRA targets fc1 and fc2, so head's bias is one no adapter wraps.
class BiasNet : public Module {
 public:
  BiasNet() : Module("BiasNet") {
    Generator gen(21);
    fc1 = std::make_shared<Linear>(8, 12, true, gen);
    fc2 = std::make_shared<Linear>(12, 8, true, gen);
    head = std::make_shared<Linear>(8, 4, true, gen);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    register_module("head", head);
  }
  Tensor forward(const Tensor& x) override { return (*head)((*fc2)(silu((*fc1)(x)))); }
  std::shared_ptr<Linear> fc1, fc2, head;
};

LoraConfig bias_config(const std::string& bias) {
  LoraConfig c;
  c.r = 2;
  c.lora_alpha = 4;
  c.target_modules = {"fc1", "fc2"};
  c.init_lora_weights = LoraInit::Random;
  c.bias = bias;
  c.seed = 5;
  return c;
}

// The trainable parameters other than the adapter slots (which always are).
std::set<std::string> trainable_base(Module& m) {
  std::set<std::string> out;
  for (const auto& [name, p] : m.named_parameters())
    if (p->requires_grad() && name.find(".lora_") == std::string::npos) out.insert(name);
  return out;
}

using Names = std::set<std::string>;

Tensor input(int step) {
  Generator gen(uint64_t(40 + step));
  return randn({kRows, 8}, gen);
}

// `steps` AdamW steps over lora.parameters() on this rank's rows of each batch.
void train(Module& net, LoraModel& lora, int steps, int64_t dp_rank, int64_t dp_size) {
  AdamW opt(lora.parameters(), AdamWOptions{.lr = 5e-2, .weight_decay = 0.0});
  for (int s = 0; s < steps; ++s) {
    Generator gen(uint64_t(70 + s));
    const Tensor target = randn({kRows, 4}, gen);
    const int64_t n = kRows / dp_size;
    const Tensor x = kernels::narrow(input(s), 0, dp_rank * n, n).contiguous();
    const Tensor t = kernels::narrow(target, 0, dp_rank * n, n).contiguous();
    opt.zero_grad();
    backward(mean(square(sub(net(x), t))));
    opt.step();
  }
}

struct Built {
  std::shared_ptr<BiasNet> net;
  std::shared_ptr<LoraModel> lora;
  int64_t dp_rank = 0, dp_size = 1;
};

// One rank: plain. Two: the adapter on tensor-parallel layers (fc1 column-parallel with its
// bias sharded, fc2 row-parallel with its bias replicated), or under FSDP with the bias adapter
// added after fully_shard, so that biases frozen when the groups were made start to train.
std::vector<std::pair<std::string, std::function<Built(const LoraConfig&)>>> layouts() {
  std::vector<std::pair<std::string, std::function<Built(const LoraConfig&)>>> out;
  if (world_size() == 1) {
    out.emplace_back("plain", [](const LoraConfig& c) {
      auto net = std::make_shared<BiasNet>();
      return Built{net, apply_lora(net, c)};
    });
    return out;
  }
  out.emplace_back("tp", [](const LoraConfig& c) {
    auto net = std::make_shared<BiasNet>();
    DeviceMesh mesh(Shape{world_size()}, {"tp"});
    parallelize_module(net, mesh,
                       {{"fc1", std::make_shared<ColwiseParallel>()},
                        {"fc2", std::make_shared<RowwiseParallel>()}});
    return Built{net, apply_lora(net, c)};
  });
  out.emplace_back("fsdp, adapter added after fully_shard", [](const LoraConfig& c) {
    auto net = std::make_shared<BiasNet>();
    LoraConfig none = c;
    none.bias = "none";
    auto lora = apply_lora(net, none, "first");
    fully_shard(net, DeviceMesh(Shape{world_size()}, {"dp"}));
    lora->delete_adapter("first");
    lora->add_adapter("default", c);
    lora->set_adapter("default");
    return Built{net, lora, world_rank(), world_size()};
  });
  return out;
}

}  // namespace

TEST(LoraBias, ModesChooseWhichBiasesTrain) {
  auto net = std::make_shared<BiasNet>();
  auto lora = apply_lora(net, bias_config("none"));
  EXPECT_EQ(trainable_base(*net), Names());
  EXPECT_EQ(lora->parameters().size(), 4u);

  net = std::make_shared<BiasNet>();
  lora = apply_lora(net, bias_config("lora_only"));
  EXPECT_EQ(trainable_base(*net), (Names{"fc1.bias", "fc2.bias"}));
  EXPECT_EQ(lora->adapter_parameters("default").size(), 6u);
  EXPECT_EQ(lora->parameters().size(), 6u);
  // fc1: 2*8 + 12*2 + 12 (bias); fc2: 2*12 + 8*2 + 8.
  EXPECT_EQ(lora->get_nb_trainable_parameters().first, 52 + 48);

  net = std::make_shared<BiasNet>();
  lora = apply_lora(net, bias_config("all"));
  EXPECT_EQ(trainable_base(*net), (Names{"fc1.bias", "fc2.bias", "head.bias"}));
  EXPECT_EQ(lora->parameters().size(), 7u);
  // The base model merge_and_unload returns is frozen, as without a bias mode.
  {
    auto other = std::make_shared<BiasNet>();
    ModulePtr merged = apply_lora(other, bias_config("all"))->merge_and_unload();
    EXPECT_EQ(trainable_base(*merged), Names());
  }
  // Freed with its adapter: the biases freeze again, keeping their values.
  lora->delete_adapter("default");
  EXPECT_EQ(trainable_base(*net), Names());

  LoraConfig bad = bias_config("lora");
  expect_error([&] { apply_lora(std::make_shared<BiasNet>(), bad); },
               {"bias 'lora' is not one of PEFT's \"none\", \"all\", \"lora_only\""});
}

// The biases are the base model's, shared by every adapter: as in PEFT, a model with several
// adapters cannot have one that trains them.
TEST(LoraBias, OnlyASingleAdapterMayTrainBiases) {
  auto net = std::make_shared<BiasNet>();
  auto lora = apply_lora(net, bias_config("all"), "default", {.max_adapters = 2});
  expect_error([&] { lora->add_adapter("b", bias_config("none")); },
               {"LoRA add_adapter 'b'", "default (bias \"all\")", "set bias \"none\""});
  EXPECT_EQ(lora->adapters(), std::vector<std::string>{"default"});
  net = std::make_shared<BiasNet>();
  lora = apply_lora(net, bias_config("none"), "default", {.max_adapters = 2});
  expect_error([&] { lora->add_adapter("b", bias_config("lora_only")); },
               {"b (bias \"lora_only\")"});
  EXPECT_EQ(trainable_base(*net), Names()) << "a refused adapter leaves the biases frozen";
  lora->delete_adapter("default");
  lora->add_adapter("b", bias_config("lora_only"));
  EXPECT_EQ(trainable_base(*net), (Names{"fc1.bias", "fc2.bias"}));
}

// A second apply_lora freezes the base model, not the biases the first one's adapter trains; and
// an adapter of a second LoraModel may not train the biases too, which every adapter shares.
TEST(LoraBias, ASecondApplyLeavesTheFirstsBiasesTraining) {
  auto net = std::make_shared<BiasNet>();
  LoraConfig fc1 = bias_config("all");
  fc1.target_modules = {"fc1"};
  auto first = apply_lora(net, fc1);
  LoraConfig head = bias_config("none");
  head.target_modules = {"head"};
  auto second = apply_lora(net, head, "head");
  EXPECT_EQ(trainable_base(*net), (Names{"fc1.bias", "fc2.bias", "head.bias"}));
  for (Parameter* p : first->parameters())
    EXPECT_TRUE(p->requires_grad()) << p->str();

  LoraConfig with_bias = head;
  with_bias.bias = "lora_only";
  second->delete_adapter("head");
  expect_error([&] { second->add_adapter("b", with_bias); },
               {"LoRA add_adapter 'b'", "bias \"lora_only\"", "default (bias \"all\")",
                "another LoraModel"});
  EXPECT_TRUE(second->adapters().empty());
  // Nor from a checkpoint's adapter table.
  auto elsewhere = std::make_shared<BiasNet>();
  const StateDict table = apply_lora(elsewhere, with_bias, "b")->state_dict();
  expect_error(
      [&] { second->load_state_dict(table); },
      {"LoRA load_state_dict", "adapter 'b'", "default (bias \"all\")", "another LoraModel"});
  EXPECT_TRUE(second->adapters().empty());
  auto other = std::make_shared<BiasNet>();
  auto kept = apply_lora(other, fc1);  // its bias adapter lives as long as its LoraModel
  expect_error([&] { apply_lora(other, with_bias, "head"); },
               {"apply_lora: adapter 'head'", "default (bias \"all\")", "another LoraModel"});
  for (const auto& [name, p] : other->named_parameters())
    EXPECT_EQ(name.find("head.lora_"), std::string::npos) << "refused before the model changed";
}

// Trained on any layout, the biases come out as a plain run on the whole batch trains them, and
// save_adapter writes them under PEFT's names; loaded into a fresh model they give the trained
// model's output.
TEST(LoraBias, TrainedBiasesTravelWithTheAdapter) {
  for (const std::string mode : {"lora_only", "all"}) {
    const LoraConfig cfg = bias_config(mode);
    auto ref_net = std::make_shared<BiasNet>();
    auto ref = apply_lora(ref_net, cfg);
    train(*ref_net, *ref, 3, 0, 1);  // every rank runs the one-rank reference by itself
    const Tensor before = BiasNet().fc2->bias.full();
    const auto all = layouts();
    for (size_t li = 0; li < all.size(); ++li) {
      const auto& [name, build] = all[li];
      const std::string what = name + ", bias \"" + mode + "\"";
      Built b = build(cfg);
      train(*b.net, *b.lora, 3, b.dp_rank, b.dp_size);
      const Tensor fc2_bias = b.net->fc2->bias.full();
      EXPECT_GT(max_abs_diff(fc2_bias, before), 1e-3) << what << ": the bias trained";
      expect_close(fc2_bias, ref_net->fc2->bias.full(), 1e-5, what + ": fc2.bias");
      expect_close(b.net->fc1->bias.full(), ref_net->fc1->bias.full(), 1e-5, what + ": fc1.bias");
      expect_close(b.net->head->bias.full(), ref_net->head->bias.full(), 1e-5,
                   what + ": head.bias");

      const std::string dir = scratch_dir("lora_bias") + "/" + mode + "_" + std::to_string(li);
      b.lora->save_adapter(dir, "default");
      std::vector<std::string> keys;
      for (const auto& [key, t] : load_safetensors(dir + "/adapter_model.safetensors").tensors)
        if (key.find("bias") != std::string::npos) keys.push_back(key);
      std::vector<std::string> want = {"base_model.model.fc1.base_layer.bias",
                                       "base_model.model.fc2.base_layer.bias"};
      if (mode == "all") want.push_back("base_model.model.head.bias");
      EXPECT_EQ(keys, want) << what;

      // PEFT's load onto a fresh base: the adapter is the model's only one.
      auto fresh = std::make_shared<BiasNet>();
      LoraConfig none = cfg;
      none.bias = "none";
      auto loaded = apply_lora(fresh, none, "first");
      loaded->delete_adapter("first");
      loaded->load_adapter(dir, "default", /*is_trainable=*/true);
      loaded->set_adapter("default");
      EXPECT_EQ(loaded->config("default").bias, mode);
      EXPECT_EQ(trainable_base(*fresh).size(), mode == "all" ? 3u : 2u) << what;
      const Tensor x = input(9);
      Tensor want_y = (*b.net)(
          kernels::narrow(x, 0, b.dp_rank * (kRows / b.dp_size), kRows / b.dp_size).contiguous());
      Tensor got_y =
          kernels::narrow((*fresh)(x), 0, b.dp_rank * (kRows / b.dp_size), kRows / b.dp_size);
      expect_close(got_y, want_y, 1e-5, what + ": the loaded adapter's output");
    }
  }
}

// A file whose biases do not fit the model is refused before the adapter is added.
TEST(LoraBias, MisShapedBiasInAFileIsRefusedWhole) {
  const std::string dir = scratch_dir("lora_bias_bad");
  auto net = std::make_shared<BiasNet>();
  auto lora = apply_lora(net, bias_config("lora_only"));
  lora->save_adapter(dir + "/good", "default");
  // The same adapter, its fc2 bias one element short.
  SafetensorsFile file = load_safetensors(dir + "/good/adapter_model.safetensors");
  std::map<std::string, Tensor> tensors = file.tensors;
  tensors["base_model.model.fc2.base_layer.bias"] = zeros({7});
  if (world_rank() == 0) {
    std::filesystem::create_directories(dir + "/bad");
    save_safetensors(dir + "/bad/adapter_model.safetensors", tensors, {{"format", "pt"}});
    std::filesystem::copy_file(dir + "/good/adapter_config.json", dir + "/bad/adapter_config.json",
                               std::filesystem::copy_options::overwrite_existing);
  }
  world_group()->barrier()->wait();
  auto fresh = std::make_shared<BiasNet>();
  auto other = apply_lora(fresh, bias_config("none"), "first");
  other->delete_adapter("first");
  const Tensor bias_before = fresh->fc1->bias.full().clone();
  expect_error([&] { other->load_adapter(dir + "/bad", "default"); },
               {"'base_model.model.fc2.base_layer.bias' is [7], the model's bias [8]"});
  EXPECT_TRUE(other->adapters().empty());
  expect_identical(fresh->fc1->bias.full(), bias_before, "fc1.bias after the refused load");
  EXPECT_EQ(trainable_base(*fresh), Names());
}

// The adapter table of a checkpoint carries the mode: loaded, it makes the same biases train, and
// those of the adapters it replaces freeze.
TEST(LoraBias, TheAdapterTableRestoresWhichBiasesTrain) {
  auto net = std::make_shared<BiasNet>();
  auto saved = apply_lora(net, bias_config("all"), "default", {.max_adapters = 2});
  const StateDict table = saved->state_dict();
  auto other_net = std::make_shared<BiasNet>();
  auto other = apply_lora(other_net, bias_config("none"), "default", {.max_adapters = 2});
  other->delete_adapter("default");
  other->add_adapter("mine", bias_config("lora_only"));
  EXPECT_EQ(trainable_base(*other_net), (Names{"fc1.bias", "fc2.bias"}));
  other->load_state_dict(table);
  EXPECT_EQ(other->adapters(), std::vector<std::string>{"default"});
  EXPECT_EQ(trainable_base(*other_net), (Names{"fc1.bias", "fc2.bias", "head.bias"}));
  auto plain =
      apply_lora(std::make_shared<BiasNet>(), bias_config("none"), "default", {.max_adapters = 2});
  plain->load_state_dict(table);
  EXPECT_EQ(trainable_base(*plain->model()), (Names{"fc1.bias", "fc2.bias", "head.bias"}));
  auto none =
      apply_lora(std::make_shared<BiasNet>(), bias_config("none"), "default", {.max_adapters = 2});
  plain->load_state_dict(none->state_dict());
  EXPECT_EQ(trainable_base(*plain->model()), Names());
}

// load_adapter loads for inference unless asked otherwise, as PEFT's does: the adapter's
// matrices and its bias mode's biases stay frozen, its table and files say so, and its slot
// trains again once it is deleted.
TEST(LoraInference, LoadedAdaptersAreFrozenUnlessTrainable) {
  const std::string dir = scratch_dir("lora_inference");
  auto src = std::make_shared<BiasNet>();
  apply_lora(src, bias_config("lora_only"))->save_adapter(dir + "/a", "default");
  auto net = std::make_shared<BiasNet>();
  auto lora = apply_lora(net, bias_config("none"), "first", {.max_adapters = 2});
  lora->delete_adapter("first");
  const int64_t all_slots = lora->get_nb_trainable_parameters().first;
  lora->load_adapter(dir + "/a", "served");
  EXPECT_TRUE(lora->config("served").inference_mode);
  EXPECT_EQ(trainable_base(*net), Names()) << "its biases stay frozen";
  for (Parameter* p : lora->adapter_parameters("served"))
    EXPECT_FALSE(p->requires_grad()) << p->str();
  EXPECT_EQ(lora->adapter_parameters("served").size(), 4u) << "no bias: it trains none";
  EXPECT_EQ(lora->get_nb_trainable_parameters().first, all_slots - (16 + 24 + 24 + 16));
  lora->save_adapter(dir + "/again", "served");
  const std::string text = [&] {
    std::ifstream in(dir + "/again/adapter_config.json");
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }();
  EXPECT_NE(text.find("\"inference_mode\": true"), std::string::npos) << text;

  // The adapter table keeps the mode; a table written before it existed loads as trained.
  const std::string table = std::get<std::string>(lora->state_dict().at("adapters"));
  auto other_net = std::make_shared<BiasNet>();
  auto other = apply_lora(other_net, bias_config("none"), "first", {.max_adapters = 2});
  other->load_state_dict(lora->state_dict());
  EXPECT_FALSE(other->adapter_parameters("served")[0]->requires_grad());
  EXPECT_TRUE(other->config("served").inference_mode);
  std::string old = table;
  const std::string field = "\"inference_mode\":true,";
  ASSERT_NE(old.find(field), std::string::npos) << old;
  old.erase(old.find(field), field.size());
  other->load_state_dict(StateDict{{"adapters", old}});
  EXPECT_FALSE(other->config("served").inference_mode);
  EXPECT_TRUE(other->adapter_parameters("served")[0]->requires_grad());
  EXPECT_EQ(trainable_base(*other_net), (Names{"fc1.bias", "fc2.bias"}));

  // Freed, the slot trains for the next adapter.
  lora->delete_adapter("served");
  EXPECT_EQ(lora->get_nb_trainable_parameters().first, all_slots);
  lora->load_adapter(dir + "/a", "tuned", /*is_trainable=*/true);
  EXPECT_FALSE(lora->config("tuned").inference_mode);
  EXPECT_EQ(trainable_base(*net), (Names{"fc1.bias", "fc2.bias"}));
  for (Parameter* p : lora->adapter_parameters("tuned"))
    EXPECT_TRUE(p->requires_grad()) << p->str();
}

// An adapter in inference mode on any layout: training the rest of the model leaves it as it
// was, FSDP included, where it is added after fully_shard.
TEST(LoraInference, AFrozenAdapterStaysAsItWasWhileTheRestTrains) {
  LoraConfig cfg = bias_config("lora_only");
  cfg.inference_mode = true;
  for (const auto& [name, build] : layouts()) {
    Built b = build(cfg);
    b.net->head->weight.set_requires_grad(true);
    // Copies: full() of a plain parameter is a view of it.
    std::map<std::string, Tensor> before;
    for (const auto& [key, t] : b.lora->read_adapter("default"))
      before[key] = t.clone();
    const Tensor fc1_bias = b.net->fc1->bias.full().clone();
    const Tensor head = b.net->head->weight.full().clone();
    AdamW opt(b.net->parameters(), AdamWOptions{.lr = 5e-2});
    for (int s = 0; s < 2; ++s) {
      const int64_t n = kRows / b.dp_size;
      const Tensor x = kernels::narrow(input(s), 0, b.dp_rank * n, n).contiguous();
      opt.zero_grad();
      backward(mean(square((*b.net)(x))));
      opt.step();
    }
    for (const auto& [key, t] : b.lora->read_adapter("default"))
      expect_identical(t, before.at(key), name + ": " + key);
    expect_identical(b.net->fc1->bias.full(), fc1_bias, name + ": fc1.bias");
    EXPECT_GT(max_abs_diff(b.net->head->weight.full(), head), 1e-3) << name << ": head trained";
  }
}

// PEFT's set_requires_grad switches adapters between training and frozen, biases included.
TEST(LoraInference, SetRequiresGradSwitchesAnAdapter) {
  auto net = std::make_shared<BiasNet>();
  auto lora = apply_lora(net, bias_config("all"));
  expect_error(
      [&] {
        lora->set_requires_grad({"default", "nope"}, false);
      },
      {"set_requires_grad: no adapter 'nope'"});
  EXPECT_FALSE(lora->config("default").inference_mode) << "nothing changed";
  lora->set_requires_grad({"default"}, false);
  EXPECT_TRUE(lora->config("default").inference_mode);
  EXPECT_EQ(trainable_base(*net), Names());
  EXPECT_FALSE(lora->adapter_parameters("default")[0]->requires_grad());
  lora->set_requires_grad({"default"});
  EXPECT_EQ(trainable_base(*net), (Names{"fc1.bias", "fc2.bias", "head.bias"}));
  EXPECT_TRUE(lora->adapter_parameters("default")[0]->requires_grad());
}
