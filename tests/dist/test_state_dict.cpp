// State dicts of the decoder under every layout of this world size: sharded ones hold the stored
// pieces with their real placements, full ones the global tensors in logical order; setting a
// full one copies each rank's window and refuses a local shard; broadcast_from_rank0 needs only
// rank 0's dict; strict and non-strict key checks; optimizer state keyed by parameter names.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "dist/checkpoint_models.h"
#include "dist/checkpoint_util.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// The reference: a plain decoder built in this process, no DTensor anywhere.
std::map<std::string, Tensor> plain_state(uint64_t seed) {
  return std::make_shared<Decoder>(checkpoint_config(seed))->state_dict();
}

void expect_model_equals(Decoder& m, const std::map<std::string, Tensor>& want,
                         const std::string& what) {
  for (const auto& [name, t] : m.state_dict())
    expect_identical(t, want.at(name), what + ": " + name);
}

}  // namespace

TEST(StateDict, ShardedHoldsTheStoredPiecesWithTheirPlacements) {
  for (const Layout& l : decoder_layouts()) {
    Parallel p = l.build(7);
    const StateDict sd = get_model_state_dict(*p.model);
    const auto params = p.model->named_parameters();
    ASSERT_EQ(sd.size(), params.size()) << l.name;
    for (auto& [name, param] : params) {
      const StateValue& v = sd.at(name);
      if (param->is_dtensor()) {
        ASSERT_TRUE(std::holds_alternative<DTensor>(v)) << l.name << " " << name;
        const DTensor& d = std::get<DTensor>(v);
        EXPECT_EQ(d.placements(), param->stored_dtensor().placements()) << l.name << " " << name;
        EXPECT_TRUE(d.to_local().storage().is_same(param->stored().storage()))
            << l.name << " " << name << ": copied instead of shared";
      } else {
        ASSERT_TRUE(std::holds_alternative<Tensor>(v)) << l.name << " " << name;
      }
    }
  }
}

TEST(StateDict, FullIsGlobalInLogicalOrderAndOnRankZeroWithCpuOffload) {
  const auto want = plain_state(7);
  for (const Layout& l : decoder_layouts()) {
    Parallel p = l.build(7);
    const StateDict sd = get_model_state_dict(*p.model, {.full_state_dict = true});
    ASSERT_EQ(sd.size(), want.size()) << l.name;
    for (const auto& [name, t] : want)
      expect_identical(std::get<Tensor>(sd.at(name)), t, l.name + " full " + name);
    const StateDict off =
        get_model_state_dict(*p.model, {.full_state_dict = true, .cpu_offload = true});
    EXPECT_EQ(off.size(), world_rank() == 0 ? want.size() : 0u) << l.name;
  }
}

TEST(StateDict, SettingAFullDictCopiesEachRanksWindow) {
  const auto want = plain_state(11);
  StateDict full;
  for (const auto& [name, t] : want)
    full[name] = t;
  for (const Layout& l : decoder_layouts()) {
    Parallel p = l.build(7);
    const IncompatibleKeys k = set_model_state_dict(*p.model, full, {.full_state_dict = true});
    EXPECT_TRUE(k.empty()) << k.str();
    expect_model_equals(*p.model, want, l.name);
  }
}

TEST(StateDict, SettingASharedDictLoadsAcrossLayouts) {
  const auto want = plain_state(11);
  for (const Layout& from : decoder_layouts()) {
    Parallel src = from.build(11);
    const StateDict sd = get_model_state_dict(*src.model);
    for (const Layout& to : decoder_layouts()) {
      Parallel dst = to.build(7);
      set_model_state_dict(*dst.model, sd);
      expect_model_equals(*dst.model, want, from.name + " -> " + to.name);
    }
  }
}

// The double-sharding bug: a local piece handed over where the global tensor belongs.
TEST(StateDict, ALocalShardUnderAGlobalNameIsRefused) {
  if (world_size() == 1) GTEST_SKIP() << "nothing is sharded on one rank";
  Parallel p = decoder_layouts()[0].build(7);  // FSDP
  const auto before = p.model->state_dict();
  StateDict full;
  for (const auto& [name, t] : before)
    full[name] = t;
  Parameter* w = nullptr;
  for (auto& [name, q] : p.model->named_parameters())
    if (name == "layers.0.attention.wq.weight") w = q;
  ASSERT_NE(w, nullptr);
  full["layers.0.attention.wq.weight"] = w->stored().clone();
  const std::string expected = "expected the global shape " + shape_str(w->global_shape()) +
                               ", got " + shape_str(w->stored().shape());
  expect_error([&] { set_model_state_dict(*p.model, full, {.full_state_dict = true}); },
               {"set_model_state_dict into Decoder", "layers.0.attention.wq.weight", expected,
                "a local piece cannot stand for the global tensor"});
  expect_model_equals(*p.model, before, "after the refused set");
}

TEST(StateDict, StrictReportsEveryKeyAtOnceAndNonStrictReturnsThem) {
  for (const Layout& l : decoder_layouts()) {
    Parallel p = l.build(7);
    StateDict full;
    for (const auto& [name, t] : plain_state(11))
      full[name] = t;
    full.erase("norm.weight");
    full.erase("output.weight");
    full["bogus"] = zeros({3});
    full["layers.1.ffn_norm.weight"] = zeros({5});
    expect_error([&] { set_model_state_dict(*p.model, full, {.full_state_dict = true}); },
                 {"missing keys: norm.weight, output.weight", "unexpected keys: bogus",
                  "layers.1.ffn_norm.weight (expected the global shape [32], got [5])"});
    const IncompatibleKeys k =
        set_model_state_dict(*p.model, full, {.full_state_dict = true, .strict = false});
    EXPECT_EQ(k.missing_keys, (std::vector<std::string>{"norm.weight", "output.weight"}));
    EXPECT_EQ(k.unexpected_keys, (std::vector<std::string>{"bogus"}));
    ASSERT_EQ(k.mismatched_keys.size(), 1u);
    // The keys that fit were loaded; the others kept their values.
    const auto now = p.model->state_dict();
    expect_identical(now.at("tok_embeddings.weight"), plain_state(11).at("tok_embeddings.weight"),
                     l.name + " loaded");
    expect_identical(now.at("norm.weight"), plain_state(7).at("norm.weight"), l.name + " kept");
  }
}

// A full dict holds plain tensors, from which each rank copies its own window: the key check
// must still be every rank's, or one rank throws while the others return, or (strict = false)
// an FSDP parameter ends up with windows of two models.
TEST(StateDict, SettingAFullDictAgreesOnTheKeysAcrossRanks) {
  if (world_size() == 1) GTEST_SKIP() << "one rank agrees with itself";
  Parallel p = decoder_layouts().front().build(7);
  const auto before = p.model->state_dict();
  StateDict full;
  for (const auto& [name, t] : plain_state(11))
    full[name] = t;
  auto same_error_on_every_rank = [](const std::string& error) {
    EXPECT_NE(error, "") << "no error on rank " << world_rank();
    const auto all = all_gather_strings(world_group(), error);
    for (size_t r = 0; r < all.size(); ++r)
      EXPECT_EQ(all[r], all[0]) << "rank " << r << " and rank 0 differ";
  };
  StateDict bogus = full;
  if (world_rank() == 1) bogus["bogus"] = zeros({3});
  const std::string strict =
      error_of([&] { set_model_state_dict(*p.model, bogus, {.full_state_dict = true}); });
  same_error_on_every_rank(strict);
  EXPECT_NE(strict.find("[rank 1] unexpected keys: bogus"), std::string::npos) << strict;
  expect_model_equals(*p.model, before, "after the refused strict set");
  StateDict dropped = full;
  if (world_rank() == 1) dropped.erase("layers.0.attention.wq.weight");
  const std::string loose = error_of(
      [&] { set_model_state_dict(*p.model, dropped, {.full_state_dict = true, .strict = false}); });
  same_error_on_every_rank(loose);
  EXPECT_NE(loose.find("layers.0.attention.wq.weight (not on rank 1)"), std::string::npos) << loose;
  expect_model_equals(*p.model, before, "after the refused non-strict set");
  StateDict misshaped = full;
  if (world_rank() == 1) misshaped["norm.weight"] = zeros({5});
  const std::string shapes = error_of([&] {
    set_model_state_dict(*p.model, misshaped, {.full_state_dict = true, .strict = false});
  });
  same_error_on_every_rank(shapes);
  EXPECT_NE(shapes.find("would load and others not: norm.weight (not on rank 1)"),
            std::string::npos)
      << shapes;
  expect_model_equals(*p.model, before, "after the refused set of a mis-shaped key");
  // The same keys on every rank, some of them missing: every rank returns them and loads the rest.
  full.erase("norm.weight");
  const IncompatibleKeys k =
      set_model_state_dict(*p.model, full, {.full_state_dict = true, .strict = false});
  EXPECT_EQ(k.missing_keys, (std::vector<std::string>{"norm.weight"}));
}

TEST(StateDict, BroadcastFromRankZeroSendsEachRankItsWindow) {
  const auto want = plain_state(11);
  for (const Layout& l : decoder_layouts()) {
    Parallel p = l.build(7);
    StateDict full;
    if (world_rank() == 0)
      for (const auto& [name, t] : want)
        full[name] = t;
    const StateDictOptions o{.full_state_dict = true, .broadcast_from_rank0 = true};
    const IncompatibleKeys k = set_model_state_dict(*p.model, full, o);
    EXPECT_TRUE(k.empty()) << k.str();
    expect_model_equals(*p.model, want, l.name + " broadcast");
    // Rank 0's mistakes are every rank's error.
    if (world_rank() == 0) full.erase("norm.weight");
    expect_error([&] { set_model_state_dict(*p.model, full, o); },
                 {"rank 0's state dict", "missing keys: norm.weight"});
  }
}

// Rank 0 converts each value to the parameter's dtype once per distinct window, not once per
// rank: a parameter every rank holds whole (a plain model, a norm under TP) cost it one
// converted copy per rank, all kept until the last send.
TEST(StateDict, BroadcastFromRankZeroConvertsEachWindowOnce) {
  if (world_size() < 3) GTEST_SKIP() << "with two ranks one copy is sent either way";
  Generator gen(7);
  auto model = std::make_shared<Linear>(256, 256, /*bias=*/false, gen);  // float32, 256 KiB
  const Tensor value = index_tensor({256, 256}, DType::Float64);
  StateDict full;
  if (world_rank() == 0) full["weight"] = value;
  const int64_t before = memory_stats().current_bytes;
  reset_peak_memory();
  const IncompatibleKeys k =
      set_model_state_dict(*model, full, {.full_state_dict = true, .broadcast_from_rank0 = true});
  const int64_t extra = memory_stats().peak_bytes - before;
  EXPECT_TRUE(k.empty()) << k.str();
  expect_identical(model->weight.stored(), value.to(DType::Float32), "loaded");
  const int64_t one = 256 * 256 * 4;
  if (world_rank() == 0) {
    EXPECT_LT(extra, 2 * one) << "rank 0 held " << extra << " bytes more";
  }
}

TEST(StateDict, OptimizerStateIsKeyedByNameAndMovesBetweenLayouts) {
  auto layouts = decoder_layouts();
  Parallel a = layouts.front().build(7);
  AdamW opt(a.model->parameters(), checkpoint_adamw());
  for (int s = 0; s < 2; ++s)
    train_step(a, opt, s);
  const StateDict full = get_optimizer_state_dict(*a.model, opt, {.full_state_dict = true});
  EXPECT_EQ(std::get<int64_t>(full.at("state/layers.0.attention.wq.weight/step")), 2);
  EXPECT_EQ(std::get<double>(full.at("param_groups/lr")), 3e-3);
  EXPECT_EQ(std::get<Tensor>(full.at("state/norm.weight/exp_avg")).shape(), (Shape{32}));
  const StateDict sharded = get_optimizer_state_dict(*a.model, opt);
  for (const Layout& to : layouts) {
    Parallel b = to.build(11);
    AdamW opt2(b.model->parameters(), AdamWOptions{.lr = 1.0});
    for (const StateDict* sd : {&full, &sharded}) {
      const IncompatibleKeys k =
          set_optimizer_state_dict(*b.model, opt2, *sd, {.full_state_dict = sd == &full});
      EXPECT_TRUE(k.empty()) << k.str();
      EXPECT_EQ(opt2.lr(), 3e-3);
      const StateDict back = get_optimizer_state_dict(*b.model, opt2, {.full_state_dict = true});
      ASSERT_EQ(back.size(), full.size());
      for (const auto& [key, v] : full) {
        if (std::holds_alternative<Tensor>(v))
          expect_identical(std::get<Tensor>(back.at(key)), std::get<Tensor>(v),
                           to.name + " " + key);
        else
          EXPECT_EQ(state_value_str(back.at(key)), state_value_str(v)) << key;
      }
    }
  }
}

TEST(StateDict, FrozenParametersAreLeftOutWhenAsked) {
  Parallel p = decoder_layouts().front().build(7);
  std::set<std::string> frozen;
  for (auto& [name, q] : p.model->named_parameters())
    if (name.find("attention") != std::string::npos) {
      q->set_requires_grad(false);
      frozen.insert(name);
    }
  const StateDict sd = get_model_state_dict(*p.model, {.ignore_frozen_params = true});
  for (const auto& name : frozen)
    EXPECT_EQ(sd.count(name), 0u) << name;
  EXPECT_EQ(sd.size(), p.model->named_parameters().size() - frozen.size());
  AdamW opt(p.model->parameters(), checkpoint_adamw());
  const StateDict os = get_optimizer_state_dict(*p.model, opt);
  for (const auto& [key, v] : os)
    for (const auto& name : frozen)
      EXPECT_EQ(key.find("state/" + name + "/"), std::string::npos) << key;
  // Frozen parameters got no optimizer state.
  for (size_t i = 0; i < opt.params().size(); ++i) {
    if (!opt.params()[i]->requires_grad()) {
      EXPECT_FALSE(opt.state_tensor(i, "exp_avg", false).defined());
    }
  }
}

namespace {

Parameter& parameter_named(Module& m, const std::string& name) {
  for (auto& [n, q] : m.named_parameters())
    if (n == name) return *q;
  throw Error("no parameter " + name);
}

size_t index_in(Optimizer& opt, const Parameter& p) {
  for (size_t i = 0; i < opt.params().size(); ++i)
    if (opt.params()[i] == &p) return i;
  throw Error("not in the optimizer: " + p.str());
}

}  // namespace

// As PyTorch's optimizer.state_dict(), a parameter frozen after some updates (a stage of
// fine-tuning) keeps its state through get and set, into an optimizer whose copy of it is frozen
// and has none; a dict without it leaves such a parameter without state.
TEST(StateDict, OptimizerStateOfAParameterFrozenAfterTrainingIsKept) {
  const std::string w = "layers.0.attention.wq.weight";
  Parallel a = decoder_layouts().front().build(7);
  AdamW opt(a.model->parameters(), checkpoint_adamw());
  for (int s = 0; s < 2; ++s)
    train_step(a, opt, s);
  parameter_named(*a.model, w).set_requires_grad(false);
  const StateDict sharded = get_optimizer_state_dict(*a.model, opt);
  const StateDict full = get_optimizer_state_dict(*a.model, opt, {.full_state_dict = true});
  for (const StateDict* sd : {&sharded, &full}) {
    ASSERT_TRUE(sd->count("state/" + w + "/exp_avg") && sd->count("state/" + w + "/exp_avg_sq"));
    EXPECT_EQ(std::get<int64_t>(sd->at("state/" + w + "/step")), 2);
  }
  for (const bool broadcast : {false, true}) {
    Parallel b = decoder_layouts().front().build(11);
    Parameter& frozen = parameter_named(*b.model, w);
    frozen.set_requires_grad(false);
    AdamW opt2(b.model->parameters(), AdamWOptions{.lr = 1.0});
    StateDict in = broadcast && world_rank() != 0 ? StateDict{} : full;
    const IncompatibleKeys k = set_optimizer_state_dict(
        *b.model, opt2, in, {.full_state_dict = true, .broadcast_from_rank0 = broadcast});
    EXPECT_TRUE(k.empty()) << k.str();
    EXPECT_EQ(opt2.param_step(index_in(opt2, frozen)), 2);
    const StateDict back = get_optimizer_state_dict(*b.model, opt2, {.full_state_dict = true});
    ASSERT_EQ(back.size(), full.size());
    for (const auto& [key, v] : full) {
      if (std::holds_alternative<Tensor>(v))
        expect_identical(std::get<Tensor>(back.at(key)), std::get<Tensor>(v), key);
      else
        EXPECT_EQ(state_value_str(back.at(key)), state_value_str(v)) << key;
    }
  }
  // Without its keys, a frozen parameter with no state is neither missing nor given any.
  StateDict without = full;
  std::erase_if(without, [&](const auto& e) { return e.first.starts_with("state/" + w + "/"); });
  Parallel c = decoder_layouts().front().build(11);
  Parameter& frozen = parameter_named(*c.model, w);
  frozen.set_requires_grad(false);
  AdamW opt3(c.model->parameters(), AdamWOptions{.lr = 1.0});
  const IncompatibleKeys k =
      set_optimizer_state_dict(*c.model, opt3, without, {.full_state_dict = true});
  EXPECT_TRUE(k.empty()) << k.str();
  EXPECT_FALSE(opt3.state_tensor(index_in(opt3, frozen), "exp_avg", false).defined());
  EXPECT_EQ(get_optimizer_state_dict(*c.model, opt3).count("state/" + w + "/step"), 0u);
}

// A parameter's optimizer state loads whole or not at all: with one of its tensors mis-shaped
// (a resized layer), strict = false leaves its step and its other moment as they were too, and
// reports them; the other parameters load (with broadcast_from_rank0 as well).
namespace {

const std::string kResized = "layers.0.attention.wq.weight";

// A full optimizer dict of two steps whose exp_avg of kResized has another shape (the layer
// resized since).
StateDict dict_with_a_resized_moment() {
  Parallel a = decoder_layouts().front().build(7);
  AdamW opt(a.model->parameters(), checkpoint_adamw());
  for (int s = 0; s < 2; ++s)
    train_step(a, opt, s);
  StateDict full = get_optimizer_state_dict(*a.model, opt, {.full_state_dict = true});
  full["state/" + kResized + "/exp_avg"] = zeros({4, 3});
  return full;
}

}  // namespace

TEST(StateDict, AParametersOptimizerStateLoadsWholeOrNotAtAll) {
  const std::string w = kResized, other = "norm.weight";
  const StateDict full = dict_with_a_resized_moment();
  for (const bool broadcast : {false, true}) {
    Parallel b = decoder_layouts().front().build(11);
    AdamW opt2(b.model->parameters(), AdamWOptions{.lr = 1.0});
    const StateDict in = broadcast && world_rank() != 0 ? StateDict{} : full;
    const IncompatibleKeys k = set_optimizer_state_dict(
        *b.model, opt2, in,
        {.full_state_dict = true, .broadcast_from_rank0 = broadcast, .strict = false});
    const std::string listed = k.str();
    for (const char* name : {"exp_avg (", "exp_avg_sq (not loaded", "step (not loaded"})
      EXPECT_NE(listed.find("state/" + w + "/" + name), std::string::npos) << listed;
    const Parameter& pw = parameter_named(*b.model, w);
    EXPECT_EQ(opt2.param_step(index_in(opt2, pw)), 0) << "a step loaded without its moments";
    const Tensor sq = opt2.state_tensor(index_in(opt2, pw), "exp_avg_sq", true);
    const std::vector<float> values = sq.contiguous().to_vector<float>();
    EXPECT_EQ(std::count(values.begin(), values.end(), 0.0f), int64_t(values.size()))
        << "exp_avg_sq loaded without exp_avg";
    EXPECT_EQ(opt2.param_step(index_in(opt2, parameter_named(*b.model, other))), 2);
  }
}

// The same rule through a checkpoint: load() with strict = false reads none of a unit whose
// file holds a key that does not fit, so that set_optimizer_state_dict, which sees only the
// dict, never takes a step without its moments.
TEST(StateDict, LoadReadsAParametersOptimizerStateWholeOrNotAtAll) {
  const std::string w = kResized, other = "norm.weight";
  const std::string path = scratch_dir("state_dict_units") + "/optim.h5";
  save(dict_with_a_resized_moment(), path);
  Parallel b = decoder_layouts().front().build(11);
  AdamW opt2(b.model->parameters(), AdamWOptions{.lr = 1.0});
  StateDict into = get_optimizer_state_dict(*b.model, opt2);
  const IncompatibleKeys k = load(into, path, {.strict = false});
  const std::string listed = k.str();
  for (const char* name : {"exp_avg (", "exp_avg_sq (not loaded", "step (not loaded"})
    EXPECT_NE(listed.find("state/" + w + "/" + name), std::string::npos) << listed;
  EXPECT_TRUE(set_optimizer_state_dict(*b.model, opt2, into).empty());
  const Parameter& pw = parameter_named(*b.model, w);
  EXPECT_EQ(opt2.param_step(index_in(opt2, pw)), 0) << "a step loaded without its moments";
  EXPECT_EQ(opt2.param_step(index_in(opt2, parameter_named(*b.model, other))), 2);
}

TEST(StateDict, AnOptimizerParameterOutsideTheModelIsAnError) {
  Parallel p = decoder_layouts().front().build(7);
  Parameter stray(zeros({2}));
  AdamW opt({&stray}, checkpoint_adamw());
  expect_error([&] { get_optimizer_state_dict(*p.model, opt); },
               {"optimizer parameter 0", "is not a parameter of the Decoder"});
}

namespace {

// An embedding and an output projection tied by assignment (PyTorch's
// `lm_head.weight = embed.weight`): two Parameters holding one tensor.
class TiedLm : public Module {
 public:
  explicit TiedLm(uint64_t seed) : Module("TiedLm") {
    Generator gen(seed);
    embed = std::make_shared<Embedding>(6, 4, gen);
    lm_head = std::make_shared<Linear>(4, 6, false, gen);
    lm_head->weight = embed->weight;
    register_module("embed", embed);
    register_module("lm_head", lm_head);
  }
  std::shared_ptr<Embedding> embed;
  std::shared_ptr<Linear> lm_head;
};

}  // namespace

// As PyTorch's get_model_state_dict (model.state_dict()), a tied tensor has a key under each of
// its names, and loading sets it from each; the optimizer's state is the tensor's, keyed by its
// first name whichever of its Parameters the optimizer holds.
TEST(StateDict, TiedWeightsHaveEveryNameAndStayTiedThroughACheckpoint) {
  auto a = std::make_shared<TiedLm>(7);
  for (bool full : {false, true}) {
    const StateDict sd = get_model_state_dict(*a, {.full_state_dict = full});
    ASSERT_EQ(sd.size(), 2u);
    EXPECT_TRUE(sd.count("embed.weight") && sd.count("lm_head.weight"));
  }
  Tensor leaf = a->embed->weight.stored();
  leaf.set_grad(full({6, 4}, 0.5));
  AdamW opt({&a->lm_head->weight}, checkpoint_adamw());
  opt.step();
  const StateDict os = get_optimizer_state_dict(*a, opt);
  EXPECT_TRUE(os.count("state/embed.weight/exp_avg"));
  EXPECT_FALSE(os.count("state/lm_head.weight/exp_avg"));

  const std::string path =
      scratch_dir("state_dict_tied") + "/np" + std::to_string(world_size()) + ".h5";
  save(get_model_state_dict(*a), path);
  auto b = std::make_shared<TiedLm>(11);
  StateDict into = get_model_state_dict(*b);
  const IncompatibleKeys k = load(into, path);
  EXPECT_TRUE(k.empty()) << k.str();
  expect_identical(b->lm_head->weight.stored(), a->embed->weight.stored(), "loaded");
  EXPECT_TRUE(b->lm_head->weight.stored().is_same(b->embed->weight.stored())) << "untied";
  const IncompatibleKeys k2 = set_model_state_dict(
      *b, get_model_state_dict(*a, {.full_state_dict = true}), {.full_state_dict = true});
  EXPECT_TRUE(k2.empty()) << k2.str();
}

// An optimizer of several groups saves each group's parameter names; a checkpoint from before
// they (or amsgrad and maximize) were saved still loads strictly, its dict keeping the
// optimizer's own values for them, which set_optimizer_state_dict then leaves as they are.
TEST(StateDict, OptimizerCheckpointsWithoutTheNewerKeysLoadStrictly) {
  auto groups_of = [](Decoder& m) {
    ParamGroups g{{{}, {}}, {{}, {{"weight_decay", 0.0}, {"amsgrad", 1}}}};
    for (auto& [name, p] : m.named_parameters())
      g.groups[name.find("norm") != std::string::npos ? 1 : 0].params.push_back(p);
    return g;
  };
  Parallel a = decoder_layouts().front().build(7);
  AdamW opt(groups_of(*a.model), checkpoint_adamw());
  train_step(a, opt, 0);
  StateDict sd = get_optimizer_state_dict(*a.model, opt);
  const std::string names = std::get<std::string>(sd.at("param_groups/1/params"));
  EXPECT_NE(names.find("norm.weight"), std::string::npos) << names;
  const std::string dir = scratch_dir("state_dict_newer_keys");
  save(sd, dir + "/now.h5");
  for (size_t g = 0; g < 2; ++g)
    for (const char* k : {"params", "amsgrad", "maximize"})
      ASSERT_EQ(sd.erase("param_groups/" + std::to_string(g) + "/" + k), 1u) << k;
  save(sd, dir + "/older.h5");

  for (const char* file : {"now.h5", "older.h5"}) {
    SCOPED_TRACE(file);
    Parallel b = decoder_layouts().front().build(11);
    AdamW opt2(groups_of(*b.model), AdamWOptions{.lr = 1.0});
    StateDict into = get_optimizer_state_dict(*b.model, opt2);
    const IncompatibleKeys k = load(into, dir + "/" + file);
    EXPECT_TRUE(k.empty()) << k.str();
    EXPECT_EQ(std::get<std::string>(into.at("param_groups/1/params")), names);
    EXPECT_TRUE(set_optimizer_state_dict(*b.model, opt2, into).empty());
    for (size_t g = 0; g < 2; ++g)
      EXPECT_EQ(opt2.hyperparameters(g), opt.hyperparameters(g)) << "group " << g;
    EXPECT_EQ(opt2.param_step(0), 1);
  }
}
