// Optimizer state dicts of parameter groups and of the new state (amsgrad's max_exp_avg_sq) on
// one rank: a round trip through get/set_optimizer_state_dict, dicts saved before groups and
// the newer hyperparameters existed, dicts that do not fit, and groups built in another order.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using tessera::testing::expect_error;

namespace {

struct Net {
  Generator gen{7};
  // Modules live in shared pointers: state dicts walk the module tree through them.
  std::shared_ptr<Linear> lin_ = std::make_shared<Linear>(3, 2, /*bias=*/true, gen);
  Linear& lin = *lin_;
  Net() { init(); }  // idempotent: each test may be the first one run in its process
  void set_grads(uint64_t seed) {
    Generator g(seed);
    for (Parameter* p : {&lin.weight, &lin.bias})
      Tensor(p->stored()).set_grad(randn(p->stored().shape(), g, p->dtype()));
  }
};

// Weights decay and keep a plain second moment; biases do neither decay nor without amsgrad.
std::vector<ParamGroup> groups_of(Net& n, double lr_of_biases) {
  return {{{&n.lin.weight}, {}},
          {{&n.lin.bias}, {{"weight_decay", 0.0}, {"amsgrad", 1}, {"lr", lr_of_biases}}}};
}

double as_double(const StateDict& sd, const std::string& key) {
  return std::get<double>(sd.at(key));
}

void expect_same(const Tensor& a, const Tensor& b, const std::string& what) {
  EXPECT_EQ(a.to_vector<double>(), b.to_vector<double>()) << what;
}

}  // namespace

TEST(OptimizerStateDict, GroupsAndAmsgradStateRoundTrip) {
  Net a;
  AdamW opt(groups_of(a, 0.02), AdamWOptions{.lr = 0.01, .weight_decay = 0.1});
  for (uint64_t s = 0; s < 2; ++s) {
    a.set_grads(10 + s);
    opt.step();
  }
  const StateDict sd = get_optimizer_state_dict(a.lin, opt);
  EXPECT_EQ(as_double(sd, "param_groups/0/weight_decay"), 0.1);
  EXPECT_EQ(as_double(sd, "param_groups/1/weight_decay"), 0.0);
  EXPECT_EQ(as_double(sd, "param_groups/1/lr"), 0.02);
  EXPECT_EQ(as_double(sd, "param_groups/1/amsgrad"), 1.0);
  EXPECT_EQ(sd.count("param_groups/lr"), 0u);  // the single-group layout is for one group only
  EXPECT_EQ(sd.count("state/bias/max_exp_avg_sq"), 1u);
  EXPECT_EQ(sd.count("state/weight/max_exp_avg_sq"), 0u);

  // Another optimizer of the same layout but other hyperparameters takes everything.
  Net b;
  AdamW opt2(groups_of(b, 0.5), AdamWOptions{.lr = 0.3, .weight_decay = 0.7});
  set_model_state_dict(b.lin, get_model_state_dict(a.lin));
  set_optimizer_state_dict(b.lin, opt2, sd);
  for (size_t g = 0; g < 2; ++g)
    EXPECT_EQ(opt2.hyperparameters(g), opt.hyperparameters(g)) << "group " << g;
  for (size_t i = 0; i < 2; ++i)
    for (const std::string& name : opt.state_names(i))
      expect_same(opt2.state_tensor(i, name, false), opt.state_tensor(i, name, false), name);
  EXPECT_EQ(opt2.param_step(1), 2);
  // Both continue alike, amsgrad's maximum included.
  a.set_grads(20);
  b.set_grads(20);
  opt.step();
  opt2.step();
  expect_same(b.lin.weight.local(), a.lin.weight.local(), "weight after a step");
  expect_same(b.lin.bias.local(), a.lin.bias.local(), "bias after a step");
}

TEST(OptimizerStateDict, SingleGroupDictsWithoutTheNewerHyperparametersLoad) {
  // What a checkpoint from before groups, amsgrad, maximize, dampening and nesterov holds.
  Net a;
  SGD old_sgd({&a.lin.weight, &a.lin.bias}, {.lr = 0.1, .momentum = 0.9});
  a.set_grads(1);
  old_sgd.step();
  StateDict sd = get_optimizer_state_dict(a.lin, old_sgd);
  for (const char* k : {"dampening", "nesterov", "maximize"})
    ASSERT_EQ(sd.erase(std::string("param_groups/") + k), 1u) << k;
  sd["param_groups/lr"] = 0.25;

  SGD sgd({&a.lin.weight, &a.lin.bias}, {.lr = 0.1, .momentum = 0.5, .nesterov = true});
  set_optimizer_state_dict(a.lin, sgd, sd);
  EXPECT_EQ(sgd.lr(), 0.25);
  EXPECT_EQ(sgd.hyperparameters().at("momentum"), 0.9);
  EXPECT_EQ(sgd.hyperparameters().at("nesterov"), 1.0);  // the dict has none: kept
  expect_same(sgd.state_tensor(0, "momentum_buffer", false),
              old_sgd.state_tensor(0, "momentum_buffer", false), "momentum_buffer");

  AdamW old_adamw({&a.lin.weight, &a.lin.bias}, {.lr = 0.01});
  old_adamw.step();
  StateDict asd = get_optimizer_state_dict(a.lin, old_adamw);
  asd.erase("param_groups/amsgrad");
  asd.erase("param_groups/maximize");
  AdamW adamw({&a.lin.weight, &a.lin.bias}, {.lr = 0.5, .maximize = true});
  set_optimizer_state_dict(a.lin, adamw, asd);
  EXPECT_EQ(adamw.lr(), 0.01);
  EXPECT_EQ(adamw.hyperparameters().at("maximize"), 1.0);
}

TEST(OptimizerStateDict, DictsThatDoNotFitAreClearErrors) {
  Net a;
  AdamW grouped(groups_of(a, 0.02), AdamWOptions{});
  a.set_grads(1);
  grouped.step();
  StateDict sd = get_optimizer_state_dict(a.lin, grouped);
  // Two groups' dict into one group: the keys say which layout each side has.
  AdamW single({&a.lin.weight, &a.lin.bias}, {});
  expect_error([&] { set_optimizer_state_dict(a.lin, single, sd); },
               {"param_groups/lr", "param_groups/0/lr"});
  // A value out of range names the group and the field.
  sd["param_groups/1/weight_decay"] = -1.0;
  AdamW other(groups_of(a, 0.02), AdamWOptions{});
  a.set_grads(2);
  other.step();  // state of its own, which the failed load must leave as it was
  const Tensor exp_avg = other.state_tensor(0, "exp_avg", false).clone();
  expect_error([&] { set_optimizer_state_dict(a.lin, other, sd); },
               "AdamW param group 1: weight_decay (-1) must be non-negative");
  expect_same(other.state_tensor(0, "exp_avg", false), exp_avg, "exp_avg after a refused dict");
  EXPECT_EQ(other.param_step(0), 1);
  // A step count below 0, found with the other checks: nothing is copied.
  sd["param_groups/1/weight_decay"] = 0.0;
  sd["state/weight/step"] = int64_t(-1);
  expect_error([&] { set_optimizer_state_dict(a.lin, other, sd); },
               {"state/weight/step", "a step count below 0"});
  expect_same(other.state_tensor(0, "exp_avg", false), exp_avg, "exp_avg after a negative step");
  EXPECT_EQ(other.param_step(1), 1);
  // amsgrad's state is required where the optimizer has amsgrad.
  sd["state/weight/step"] = int64_t(1);
  sd.erase("state/bias/max_exp_avg_sq");
  expect_error([&] { set_optimizer_state_dict(a.lin, other, sd); }, "state/bias/max_exp_avg_sq");
}

// Each group's parameters are in the dict by name (PyTorch's param_groups[g]["params"]), so
// that a dict's hyperparameters never land on another group: an optimizer whose groups were
// built in another order refuses them, naming the parameters, or with strict = false keeps its
// own while the state, keyed by name, loads. A dict from before groups held their names is
// taken by position, as it was.
TEST(OptimizerStateDict, HyperparametersNeverLandOnAnotherGroup) {
  Net a;
  AdamW grouped(groups_of(a, 0.02), AdamWOptions{.weight_decay = 0.1});
  a.set_grads(1);
  grouped.step();
  StateDict sd = get_optimizer_state_dict(a.lin, grouped);
  EXPECT_EQ(std::get<std::string>(sd.at("param_groups/0/params")), "weight");
  EXPECT_EQ(std::get<std::string>(sd.at("param_groups/1/params")), "bias");
  EXPECT_EQ(sd.count("param_groups/params"), 0u);  // one group has nothing to tell apart

  // The same groups the other way round: biases first.
  const std::vector<ParamGroup> swapped = {
      {{&a.lin.bias}, {{"weight_decay", 0.0}, {"amsgrad", 1}, {"lr", 0.5}}},
      {{&a.lin.weight}, {{"amsgrad", 1}}}};
  AdamW other(swapped, AdamWOptions{.lr = 0.3, .weight_decay = 0.7});
  const auto before = std::vector{other.hyperparameters(0), other.hyperparameters(1)};
  expect_error([&] { set_optimizer_state_dict(a.lin, other, sd); },
               {"param_groups/0/lr", "the dict's param group 0 holds other parameters",
                "only the dict's: weight", "only the optimizer's: bias"});
  EXPECT_EQ(other.param_step(0), 0) << "state copied from a refused dict";
  sd["state/weight/max_exp_avg_sq"] = zeros({2, 3});  // the weights' group has amsgrad here
  const IncompatibleKeys k = set_optimizer_state_dict(a.lin, other, sd, {.strict = false});
  auto listed = [&](const std::string& start) {
    return std::any_of(k.mismatched_keys.begin(), k.mismatched_keys.end(),
                       [&](const std::string& m) { return m.starts_with(start); });
  };
  EXPECT_TRUE(
      listed("param_groups/1/params (the dict's param group 1 holds other parameters "
             "than the optimizer's; only the dict's: bias; only the optimizer's: weight"))
      << k.str();
  for (const char* key : {"param_groups/0/lr (not loaded", "param_groups/1/weight_decay (not"})
    EXPECT_TRUE(listed(key)) << key << " in " << k.str();
  EXPECT_EQ(other.hyperparameters(0), before[0]);
  EXPECT_EQ(other.hyperparameters(1), before[1]);
  EXPECT_EQ(other.param_step(0), 1);  // the biases' state, by name
  expect_same(other.state_tensor(1, "exp_avg", false), grouped.state_tensor(0, "exp_avg", false),
              "the weights' exp_avg");

  // The same groups in the same order: taken, the names are only checked.
  sd.erase("state/weight/max_exp_avg_sq");
  AdamW same(groups_of(a, 0.9), AdamWOptions{});
  EXPECT_TRUE(set_optimizer_state_dict(a.lin, same, sd).empty());
  EXPECT_EQ(same.hyperparameters(1).at("lr"), 0.02);

  // A dict without the names: by position, as before they were saved.
  sd.erase("param_groups/0/params");
  sd.erase("param_groups/1/params");
  AdamW positional(groups_of(a, 0.9), AdamWOptions{});
  set_optimizer_state_dict(a.lin, positional, sd);
  EXPECT_EQ(positional.hyperparameters(1).at("lr"), 0.02);
}

// amsgrad (Adam) and momentum 0 or not (SGD) decide which state tensors exist: a dict whose
// value differs from the optimizer's is refused naming both, or with strict = false leaves the
// optimizer's, rather than switching amsgrad on over a max_exp_avg_sq of zeros.
TEST(OptimizerStateDict, HyperparametersThatDecideTheStateMustAgree) {
  Net a;
  AdamW with(groups_of(a, 0.02), AdamWOptions{});
  a.set_grads(1);
  with.step();
  const StateDict sd = get_optimizer_state_dict(a.lin, with);
  const std::vector<ParamGroup> no_amsgrad = {{{&a.lin.weight}, {}},
                                              {{&a.lin.bias}, {{"weight_decay", 0.0}}}};
  AdamW without(no_amsgrad, AdamWOptions{});
  expect_error([&] { set_optimizer_state_dict(a.lin, without, sd); },
               {"param_groups/1/amsgrad (amsgrad 1 in the dict, 0 in the optimizer",
                "build the optimizer with the dict's amsgrad", "state/bias/max_exp_avg_sq"});
  set_optimizer_state_dict(a.lin, without, sd, {.strict = false});
  EXPECT_EQ(without.hyperparameters(1).at("amsgrad"), 0.0);
  EXPECT_EQ(without.state_names(1), (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));

  SGD momentum({&a.lin.weight, &a.lin.bias}, {.lr = 0.1, .momentum = 0.9});
  momentum.step();
  SGD plain({&a.lin.weight, &a.lin.bias}, {.lr = 0.1});
  expect_error(
      [&] { set_optimizer_state_dict(a.lin, plain, get_optimizer_state_dict(a.lin, momentum)); },
      {"param_groups/momentum (momentum 0.9 in the dict, 0 in the optimizer", "momentum_buffer"});
  // Another momentum that is not 0 keeps the same state: taken.
  SGD other({&a.lin.weight, &a.lin.bias}, {.lr = 0.1, .momentum = 0.5});
  set_optimizer_state_dict(a.lin, other, get_optimizer_state_dict(a.lin, momentum));
  EXPECT_EQ(other.hyperparameters().at("momentum"), 0.9);
}

// State is created for a frozen parameter without any only to receive the dict's: when that
// does not load (the dict is refused, or strict = false leaves its unit out), the parameter is
// left without state. Zeros left there were saved with it from then on (a LoRA base weight's
// size twice over), and made the next dict without its state miss keys.
TEST(OptimizerStateDict, AFrozenParametersStateThatDoesNotLoadIsNotCreated) {
  Net a;
  AdamW trained({&a.lin.weight, &a.lin.bias}, {});
  a.set_grads(1);
  trained.step();
  const StateDict with_bias = get_optimizer_state_dict(a.lin, trained);

  a.lin.bias.set_requires_grad(false);  // fine-tuning: the bias was never updated here
  AdamW tuning({&a.lin.weight, &a.lin.bias}, {});
  const StateDict own = get_optimizer_state_dict(a.lin, tuning);
  ASSERT_EQ(own.count("state/bias/exp_avg"), 0u);
  const auto bias_has_state = [&] {
    return tuning.state_tensor(1, "exp_avg", false).defined() ||
           get_optimizer_state_dict(a.lin, tuning).count("state/bias/exp_avg") != 0;
  };

  StateDict refused = with_bias;
  refused.erase("state/weight/exp_avg");
  expect_error([&] { set_optimizer_state_dict(a.lin, tuning, refused); }, "state/weight/exp_avg");
  EXPECT_FALSE(bias_has_state()) << "after a refused dict";
  EXPECT_TRUE(set_optimizer_state_dict(a.lin, tuning, own).empty());

  StateDict partial = with_bias;
  partial.erase("state/bias/exp_avg_sq");
  const IncompatibleKeys k = set_optimizer_state_dict(a.lin, tuning, partial, {.strict = false});
  EXPECT_EQ(k.missing_keys, std::vector<std::string>{"state/bias/exp_avg_sq"}) << k.str();
  EXPECT_FALSE(bias_has_state()) << "after a dict whose bias state was left out";
  EXPECT_EQ(tuning.param_step(1), 0);
  EXPECT_TRUE(set_optimizer_state_dict(a.lin, tuning, own).empty());

  // A dict that holds all of it still gives it its state.
  EXPECT_TRUE(set_optimizer_state_dict(a.lin, tuning, with_bias).empty());
  expect_same(tuning.state_tensor(1, "exp_avg", false), trained.state_tensor(1, "exp_avg", false),
              "the bias's exp_avg");
  EXPECT_EQ(tuning.param_step(1), 1);
}
