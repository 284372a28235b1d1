// The torch.optim variants against their update formulas written out here in double, over
// several steps with changing gradients: Adam's L2 against AdamW's decoupled decay, amsgrad,
// maximize, SGD's dampening and nesterov; and parameter groups with their own hyperparameters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "unit/optim_test_util.h"

using namespace tessera;
using tessera::testing::expect_error;
using namespace tessera::optim_test;

namespace {

// torch.optim.Adam / AdamW (single-tensor form): g = maximize ? -grad : grad; Adam: g += wd * p;
// AdamW: p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; with amsgrad vmax =
// max(vmax, v) replaces v below; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
struct RefAdam {
  double lr, b1, b2, eps, wd;
  bool decoupled, amsgrad = false, maximize = false;
  Vec m = {}, v = {}, vmax = {};
  int t = 0;
  void step(Vec& p, Vec g) {
    if (m.empty()) m.assign(p.size(), 0.0), v.assign(p.size(), 0.0), vmax.assign(p.size(), 0.0);
    ++t;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      if (maximize) g[i] = -g[i];
      if (!decoupled) g[i] += wd * p[i];
      if (decoupled) p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      vmax[i] = std::max(vmax[i], v[i]);
      const double second = amsgrad ? vmax[i] : v[i];
      p[i] -= lr / bc1 * m[i] / (std::sqrt(second) / std::sqrt(bc2) + eps);
    }
  }
};

// torch.optim.SGD: d = (maximize ? -g : g) + wd * p; buf = d on the first step, then buf =
// momentum * buf + (1 - dampening) * d; d = nesterov ? d + momentum * buf : buf; p -= lr * d.
struct RefSGD {
  double lr, momentum, wd, dampening = 0;
  bool nesterov = false, maximize = false;
  Vec buf = {};
  void step(Vec& p, const Vec& g) {
    Vec d(p.size());
    for (size_t i = 0; i < p.size(); ++i)
      d[i] = (maximize ? -g[i] : g[i]) + wd * p[i];
    if (momentum != 0) {
      if (buf.empty()) {
        buf = d;
      } else {
        for (size_t i = 0; i < p.size(); ++i)
          buf[i] = momentum * buf[i] + (1 - dampening) * d[i];
      }
      for (size_t i = 0; i < p.size(); ++i)
        d[i] = nesterov ? d[i] + momentum * buf[i] : buf[i];
    }
    for (size_t i = 0; i < p.size(); ++i)
      p[i] -= lr * d[i];
  }
};

// Steps `opt` and the references of its parameters four times with fresh gradients, comparing
// after each step.
template <class Ref>
void run_against(Optimizer& opt, std::vector<Parameter*> params, std::vector<Ref>& refs,
                 std::vector<Vec>& want, uint64_t seed, const std::string& what,
                 double tol = 1e-13) {
  for (int t = 0; t < 4; ++t) {
    for (size_t k = 0; k < params.size(); ++k) {
      // Gradients shrink over the steps, so that amsgrad's maximum differs from exp_avg_sq.
      Vec g = random_vec(want[k].size(), seed + 10 * k + uint64_t(t));
      for (double& x : g)
        x *= t < 2 ? 1.0 : 0.05;
      set_grad(*params[k], g);
      refs[k].step(want[k], g);
    }
    opt.step();
    for (size_t k = 0; k < params.size(); ++k)
      expect_near_all(params[k]->local(), want[k], tol,
                      what + " param " + std::to_string(k) + " step " + std::to_string(t));
  }
}

}  // namespace

TEST(Adam, L2WeightDecayMatchesReferenceAndDiffersFromAdamW) {
  Vec p0 = random_vec(6, 1);
  Parameter a = make_param(p0), b = make_param(p0);
  Adam adam({&a}, {.lr = 0.05, .weight_decay = 0.3});
  AdamW adamw({&b}, {.lr = 0.05, .weight_decay = 0.3});
  std::vector<RefAdam> ra{{0.05, 0.9, 0.999, 1e-8, 0.3, /*decoupled=*/false}};
  std::vector<RefAdam> rb{{0.05, 0.9, 0.999, 1e-8, 0.3, /*decoupled=*/true}};
  std::vector<Vec> wa{p0}, wb{p0};
  run_against(adam, {&a}, ra, wa, 100, "adam");
  run_against(adamw, {&b}, rb, wb, 100, "adamw");
  // Same gradients, same hyperparameters: only where the decay enters differs.
  EXPECT_GT(std::abs(wa[0][0] - wb[0][0]), 1e-4);
}

TEST(Adam, DefaultsAreTorchs) {
  Parameter p = make_param({1.0});
  const auto h = Adam({&p}, {}).hyperparameters();
  EXPECT_EQ(h.at("weight_decay"), 0.0);
  EXPECT_EQ(h.at("lr"), 1e-3);
  EXPECT_EQ(h.at("amsgrad"), 0.0);
  EXPECT_EQ(h.at("maximize"), 0.0);
  EXPECT_EQ(AdamW({&p}, {}).hyperparameters().at("weight_decay"), 1e-2);
}

TEST(Adam, AmsgradKeepsTheLargestSecondMoment) {
  for (bool decoupled : {false, true}) {
    Vec p0 = random_vec(5, 2);
    Parameter p = make_param(p0);
    std::unique_ptr<Optimizer> opt;
    // beta2 0.5: exp_avg_sq follows the shrinking gradients down, below its maximum.
    if (decoupled)
      opt = std::make_unique<AdamW>(std::vector<Parameter*>{&p},
                                    AdamWOptions{.lr = 0.1, .beta2 = 0.5, .amsgrad = true});
    else
      opt = std::make_unique<Adam>(
          std::vector<Parameter*>{&p},
          AdamOptions{.lr = 0.1, .beta2 = 0.5, .weight_decay = 0.1, .amsgrad = true});
    std::vector<RefAdam> ref{{0.1, 0.9, 0.5, 1e-8, decoupled ? 1e-2 : 0.1, decoupled, true}};
    std::vector<Vec> want{p0};
    const std::string what = decoupled ? "adamw amsgrad" : "adam amsgrad";
    run_against(*opt, {&p}, ref, want, 200, what);
    EXPECT_EQ(opt->state_names(0),
              (std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}));
    expect_near_all(opt->state_tensor(0, "max_exp_avg_sq", false), ref[0].vmax, 1e-13, what);
    // The maximum is not the current exp_avg_sq: the test reached amsgrad's own branch.
    EXPECT_GT(ref[0].vmax[0], ref[0].v[0] * 2) << what;
  }
}

TEST(Adam, MaximizeAscends) {
  Vec p0 = random_vec(4, 3);
  Parameter a = make_param(p0), b = make_param(p0);
  Adam adam({&a}, {.lr = 0.05, .weight_decay = 0.2, .maximize = true});
  AdamW adamw({&b}, {.lr = 0.05, .weight_decay = 0.2, .amsgrad = true, .maximize = true});
  std::vector<RefAdam> ra{{0.05, 0.9, 0.999, 1e-8, 0.2, false, false, true}};
  std::vector<RefAdam> rb{{0.05, 0.9, 0.999, 1e-8, 0.2, true, true, true}};
  std::vector<Vec> wa{p0}, wb{p0};
  run_against(adam, {&a}, ra, wa, 300, "adam maximize");
  run_against(adamw, {&b}, rb, wb, 300, "adamw maximize");
}

TEST(SGD, DampeningNesterovAndMaximizeMatchReference) {
  struct Case {
    SGDOptions o;
    RefSGD ref;
    const char* what;
  };
  std::vector<Case> cases = {
      {{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.05, .dampening = 0.3},
       {0.1, 0.9, 0.05, 0.3},
       "dampening"},
      {{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.05, .nesterov = true},
       {0.1, 0.9, 0.05, 0, true},
       "nesterov"},
      {{.lr = 0.1, .momentum = 0.5, .maximize = true}, {0.1, 0.5, 0, 0, false, true}, "maximize"},
      {{.lr = 0.1, .maximize = true}, {0.1, 0, 0, 0, false, true}, "maximize without momentum"},
  };
  for (Case& c : cases) {
    Vec p0 = random_vec(5, 4);
    Parameter p = make_param(p0);
    SGD opt({&p}, c.o);
    std::vector<RefSGD> ref{c.ref};
    std::vector<Vec> want{p0};
    run_against(opt, {&p}, ref, want, 400, c.what, 1e-14);
    // The option changed the trajectory: plain momentum SGD ends elsewhere.
    std::vector<RefSGD> plain{{0.1, c.ref.momentum, c.ref.wd}};
    Vec wp = p0;
    for (int t = 0; t < 4; ++t) {
      Vec g = random_vec(5, 400 + uint64_t(t));
      for (double& x : g)
        x *= t < 2 ? 1.0 : 0.05;
      plain[0].step(wp, g);
    }
    EXPECT_GT(std::abs(wp[0] - want[0][0]), 1e-6) << c.what;
  }
}

// Momentum switched on after steps without it starts its buffer as PyTorch's does (a copy of
// the gradient, no dampening): w = 1 - 0.1 (no momentum) - 0.1 (buffer = g), not - 0.05.
TEST(SGD, MomentumSwitchedOnLaterStartsFromTheGradient) {
  Parameter p = make_param({1.0});
  SGD opt({&p}, {.lr = 0.1});
  for (int step = 0; step < 2; ++step) {
    set_grad(p, {1.0});
    opt.step();
    if (step == 0) opt.set_hyperparameters({{"momentum", 0.9}, {"dampening", 0.5}});
  }
  EXPECT_NEAR(p.stored().to_vector<double>()[0], 0.8, 1e-12);
}

TEST(SGD, NesterovNeedsMomentumAndNoDampening) {
  Parameter p = make_param({1.0});
  expect_error([&] { SGD({&p}, {.nesterov = true}); },
               "SGD: nesterov momentum requires a momentum and zero dampening (momentum 0, "
               "dampening 0)");
  expect_error([&] { SGD({&p}, {.momentum = 0.9, .dampening = 0.1, .nesterov = true}); },
               "dampening 0.1");
  SGD ok({&p}, {.momentum = 0.9, .nesterov = true});
  expect_error(
      [&] {
        ok.set_hyperparameters({{"momentum", 0.0}});
      },
      "SGD: nesterov momentum requires");
  EXPECT_EQ(ok.hyperparameters().at("momentum"), 0.9);  // unchanged
}

TEST(ParamGroups, EachGroupUsesItsOwnWeightDecay) {
  // The usual split: decay for weights, none for norms and biases.
  Vec w0 = random_vec(6, 5), b0 = random_vec(3, 6);
  Parameter w = make_param(w0), b = make_param(b0);
  AdamW opt({{{&w}, {}}, {{&b}, {{"weight_decay", 0.0}, {"lr", 0.02}}}},
            AdamWOptions{.lr = 0.05, .weight_decay = 0.5});
  ASSERT_EQ(opt.num_param_groups(), 2u);
  EXPECT_EQ(opt.hyperparameters(0).at("weight_decay"), 0.5);
  EXPECT_EQ(opt.hyperparameters(1).at("weight_decay"), 0.0);
  EXPECT_EQ(opt.hyperparameters(1).at("lr"), 0.02);
  EXPECT_EQ(opt.hyperparameters(1).at("beta2"), 0.999);  // the default
  EXPECT_EQ(opt.param_group_of(1), 1u);
  std::vector<RefAdam> refs{{0.05, 0.9, 0.999, 1e-8, 0.5, true}, {0.02, 0.9, 0.999, 1e-8, 0, true}};
  std::vector<Vec> want{w0, b0};
  run_against(opt, {&w, &b}, refs, want, 500, "groups");
  const std::vector<ParamGroup> groups = opt.param_groups();
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[1].params, std::vector<Parameter*>{&b});
  EXPECT_EQ(groups[1].options.at("weight_decay"), 0.0);
}

TEST(ParamGroups, SgdGroupsAndLrActOnEveryGroup) {
  Vec a0 = random_vec(4, 7), b0 = random_vec(4, 8);
  Parameter a = make_param(a0), b = make_param(b0);
  SGD opt({{{&a}, {{"momentum", 0.9}, {"nesterov", 1}}}, {{&b}, {{"weight_decay", 0.1}}}},
          SGDOptions{.lr = 0.1});
  EXPECT_EQ(opt.state_names(0), std::vector<std::string>{"momentum_buffer"});
  EXPECT_TRUE(opt.state_names(1).empty());  // no momentum in group 1: no state
  std::vector<RefSGD> refs{{0.1, 0.9, 0, 0, true}, {0.1, 0, 0.1}};
  std::vector<Vec> want{a0, b0};
  run_against(opt, {&a, &b}, refs, want, 600, "sgd groups", 1e-14);
  // set_lr sets every group's lr; lr() reads group 0's; a group's own lr is set by name.
  opt.set_lr(0.3);
  EXPECT_EQ(opt.hyperparameters(1).at("lr"), 0.3);
  opt.set_hyperparameters(1, {{"lr", 0.01}});
  EXPECT_EQ(opt.lr(), 0.3);
  EXPECT_EQ(opt.hyperparameters(1).at("lr"), 0.01);
  refs[0].lr = 0.3;
  refs[1].lr = 0.01;
  run_against(opt, {&a, &b}, refs, want, 700, "sgd groups after set_lr", 1e-14);
}

TEST(ParamGroups, BadGroupsAreClearErrors) {
  Parameter a = make_param({1.0}), b = make_param({2.0});
  expect_error(
      [&] {
        AdamW({{{&a}, {}}, {{&b, &a}, {}}}, AdamWOptions{});
      },
      {"AdamW: parameter 1 of param group 1 ", "is parameter 0 of param group 0 again"});
  expect_error(
      [&] {
        AdamW({{{&a}, {}}, {{&b}, {{"weight_decai", 0.0}}}}, AdamWOptions{});
      },
      "AdamW param group 1: unknown hyperparameter 'weight_decai' (it has amsgrad, "
      "beta1, beta2, eps, lr, maximize, weight_decay)");
  expect_error(
      [&] {
        SGD({{{&a}, {}}, {{&b}, {{"lr", -0.5}}}}, SGDOptions{});
      },
      "SGD param group 1: lr (-0.5) must be non-negative");
  expect_error(
      [&] {
        Adam({{{&a}, {{"amsgrad", 2}}}, {{&b}, {}}}, AdamOptions{});
      },
      "Adam param group 0: amsgrad (2) is a boolean: 0 or 1");
  AdamW opt({{{&a}, {}}, {{&b}, {}}}, AdamWOptions{});
  expect_error(
      [&] {
        opt.set_hyperparameters(2, {{"lr", 0.1}});
      },
      "Optimizer::set_hyperparameters: param group 2 out of range (the optimizer has 2)");
  expect_error([&] { opt.set_lr(-1); }, "AdamW param group 0: lr (-1) must be non-negative");
  EXPECT_EQ(opt.hyperparameters(1).at("lr"), 1e-3);
  expect_error([&] { opt.state_tensor(0, "max_exp_avg_sq", true); },
               "max_exp_avg_sq only with amsgrad");
}
