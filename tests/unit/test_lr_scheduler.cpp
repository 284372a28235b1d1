// The LR schedulers against torch.optim.lr_scheduler's closed forms written out here, for
// several steps and for each parameter group; their state dicts and bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <numbers>
#include <string>
#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using tessera::testing::expect_error;

namespace {

constexpr double kPi = std::numbers::pi;

// An SGD of two groups with base lrs 0.1 and 0.04.
struct TwoGroups {
  Parameter a{full({2}, 1.0)}, b{full({2}, 1.0)};
  SGD opt{{{{&a}, {}}, {{&b}, {{"lr", 0.04}}}}, SGDOptions{.lr = 0.1}};
};
const std::vector<double> kBase = {0.1, 0.04};

// A warmup of 3 epochs from a tenth of the base lrs, then a cosine over 6; group 0 starts at
// `lr0` (a resumed run's optimizer may hold another lr than the base when the schedule is built).
struct WarmupCosine {
  explicit WarmupCosine(double lr0 = 0.1)
      : set_lr0((groups.opt.set_hyperparameters(0, {{"lr", lr0}}), true)),
        sched(groups.opt,
              {std::make_shared<LinearLR>(groups.opt, 0.1, 1.0, 3),
               std::make_shared<CosineAnnealingLR>(groups.opt, 6)},
              {3}) {}
  TwoGroups groups;
  bool set_lr0;
  SequentialLR sched;
  // A resumed run: the optimizer's lrs come back with its own state, the scheduler's progress
  // from its dict.
  void resume_from(const WarmupCosine& saved) {
    sched.load_state_dict(saved.sched.state_dict());
    for (size_t g = 0; g < 2; ++g)
      groups.opt.set_hyperparameters(g, {{"lr", saved.groups.opt.hyperparameters(g).at("lr")}});
  }
};

// Steps both `steps` times; they must set the same lrs.
void expect_same_schedule(WarmupCosine& a, WarmupCosine& b, int steps) {
  for (int e = 0; e < steps; ++e) {
    a.sched.step();
    b.sched.step();
    EXPECT_EQ(b.sched.get_last_lr(), a.sched.get_last_lr()) << "step " << e;
  }
}

// Checks the scheduler's lrs at epochs 0..n-1 (stepping in between) against want(base, epoch),
// in get_last_lr() and in the optimizer's groups.
void expect_schedule(LRScheduler& s, int n, const std::function<double(double, int)>& want,
                     const std::string& what) {
  for (int e = 0; e < n; ++e) {
    if (e > 0) s.step();
    ASSERT_EQ(s.last_epoch(), e) << what;
    for (size_t g = 0; g < kBase.size(); ++g) {
      const double w = want(kBase[g], e);
      EXPECT_NEAR(s.get_last_lr()[g], w, 1e-15 + 1e-12 * w)
          << what << " epoch " << e << " group " << g;
      EXPECT_EQ(s.optimizer().hyperparameters(g).at("lr"), s.get_last_lr()[g]) << what;
    }
  }
}

}  // namespace

TEST(LRScheduler, LambdaLR) {
  TwoGroups s;
  LambdaLR sched(s.opt, [](int64_t e) { return 1.0 / double(e + 1); });
  expect_schedule(
      sched, 6, [](double b, int e) { return b / (e + 1); }, "LambdaLR");
  TwoGroups t;
  LambdaLR per_group(t.opt, {[](int64_t e) { return double(e); }, [](int64_t) { return 2.0; }});
  per_group.step();
  EXPECT_DOUBLE_EQ(per_group.get_last_lr()[0], 0.1);
  EXPECT_DOUBLE_EQ(per_group.get_last_lr()[1], 0.08);
}

TEST(LRScheduler, StepLR) {
  TwoGroups s;
  StepLR sched(s.opt, 3, 0.5);
  expect_schedule(
      sched, 10, [](double b, int e) { return b * std::pow(0.5, e / 3); }, "StepLR");
}

TEST(LRScheduler, MultiStepLR) {
  TwoGroups s;
  // Unsorted, and 6 twice: gamma twice there.
  MultiStepLR sched(s.opt, {6, 2, 6}, 0.1);
  expect_schedule(
      sched, 9, [](double b, int e) { return b * std::pow(0.1, (e >= 2) + 2 * (e >= 6)); },
      "MultiStepLR");
}

TEST(LRScheduler, LinearLR) {
  TwoGroups s;
  LinearLR sched(s.opt, 0.25, 1.0, 4);
  expect_schedule(
      sched, 8, [](double b, int e) { return b * (0.25 + 0.75 * std::min(e, 4) / 4.0); },
      "LinearLR");
  TwoGroups t;
  LinearLR decay(t.opt, 1.0, 0.0, 5);  // down to zero
  expect_schedule(
      decay, 8, [](double b, int e) { return b * (1.0 - std::min(e, 5) / 5.0); }, "LinearLR decay");
}

TEST(LRScheduler, CosineAnnealingLR) {
  TwoGroups s;
  const double eta_min = 0.001;
  CosineAnnealingLR sched(s.opt, 5, eta_min);
  // Past t_max it rises again (epochs 6..12), through the recursion's special case at 6.
  expect_schedule(
      sched, 13,
      [&](double b, int e) { return eta_min + (b - eta_min) * (1 + std::cos(kPi * e / 5)) / 2; },
      "CosineAnnealingLR");
}

TEST(LRScheduler, SequentialLRWarmupThenCosine) {
  TwoGroups s;
  auto warmup = std::make_shared<LinearLR>(s.opt, 0.1, 1.0, 3);
  auto cosine = std::make_shared<CosineAnnealingLR>(s.opt, 6);
  // Both took the group's lr from before the warmup as their base.
  EXPECT_EQ(cosine->base_lrs(), kBase);
  SequentialLR sched(s.opt, {warmup, cosine}, {3});
  expect_schedule(
      sched, 12,
      [](double b, int e) {
        if (e < 3) return b * (0.1 + 0.9 * e / 3.0);
        return b * (1 + std::cos(kPi * (e - 3) / 6)) / 2;
      },
      "SequentialLR");
}

TEST(LRScheduler, StateDictRoundTrip) {
  WarmupCosine s;
  for (int e = 0; e < 4; ++e)
    s.sched.step();
  const std::map<std::string, double> sd = s.sched.state_dict();
  EXPECT_EQ(sd.at("last_epoch"), 4.0);
  EXPECT_EQ(sd.at("schedulers/1/last_epoch"), 1.0);
  EXPECT_EQ(sd.at("base_lrs/1"), 0.04);
  WarmupCosine r(s.groups.opt.hyperparameters(0).at("lr"));
  r.resume_from(s);
  EXPECT_EQ(r.sched.state_dict(), sd);
  expect_same_schedule(s, r, 3);
}

// Saved during the warmup, the cosine has not started (its last_epoch is -1): the dict loads and
// the resumed schedule goes on alike, across the milestone.
TEST(LRScheduler, StateDictRoundTripBeforeTheMilestone) {
  WarmupCosine s;
  s.sched.step();
  EXPECT_EQ(s.sched.state_dict().at("schedulers/1/last_epoch"), -1.0);
  WarmupCosine r;
  r.resume_from(s);
  expect_same_schedule(s, r, 5);
}

TEST(LRScheduler, BadArgumentsAndDictsAreClearErrors) {
  TwoGroups s;
  expect_error([&] { StepLR(s.opt, 0); }, "StepLR: step_size (0) must be positive");
  expect_error([&] { LinearLR(s.opt, 0.0); }, "LinearLR: start_factor (0) must be in (0, 1]");
  expect_error([&] { CosineAnnealingLR(s.opt, 0); }, "CosineAnnealingLR: t_max (0)");
  expect_error([&] { LambdaLR(s.opt, std::vector<std::function<double(int64_t)>>(3, nullptr)); },
               "LambdaLR: expected 2 lr_lambdas (one per param group), got 3");
  auto a = std::make_shared<StepLR>(s.opt, 2);
  TwoGroups other;
  auto b = std::make_shared<StepLR>(other.opt, 2);
  expect_error(
      [&] {
        SequentialLR(s.opt, {a, b}, {2});
      },
      "SequentialLR: scheduler 1 is built on another optimizer");
  expect_error([&] { SequentialLR(s.opt, {a, a}, {}); }, "expected 1 milestones");
  StepLR sched(s.opt, 2);
  std::map<std::string, double> sd = sched.state_dict();
  sd["base_lrs/2"] = 0.1;
  expect_error([&] { sched.load_state_dict(sd); },
               "StepLR::load_state_dict: unexpected key 'base_lrs/2'");
  sd.erase("base_lrs/2");
  sd["last_epoch"] = -2;
  expect_error([&] { sched.load_state_dict(sd); }, "last_epoch (-2) is not a whole number >= -1");
  sd["last_epoch"] = 1;
  sd.erase("last_lr/1");
  expect_error([&] { sched.load_state_dict(sd); }, "missing key 'last_lr/1'");
}

// A scheduler its constructor refuses records no initial lr on the optimizer: the next one starts
// from the lrs the groups have then (a refused LinearLR left the lrs of then as the base lrs).
TEST(LRScheduler, RefusedSchedulerRecordsNoInitialLr) {
  TwoGroups s;
  expect_error([&] { LinearLR(s.opt, 2.0); }, "LinearLR: start_factor (2) must be in (0, 1]");
  expect_error([&] { StepLR(s.opt, 0); }, "StepLR: step_size (0) must be positive");
  expect_error([&] { CosineAnnealingLR(s.opt, 0); }, "CosineAnnealingLR: t_max (0) must be");
  const std::vector<std::function<double(int64_t)>> one = {[](int64_t) { return 1.0; }};
  expect_error([&] { LambdaLR(s.opt, one); }, "LambdaLR: expected 2 lr_lambdas");
  EXPECT_FALSE(s.opt.initial_lr(0).has_value());
  EXPECT_FALSE(s.opt.initial_lr(1).has_value());
  s.opt.set_lr(0.05);
  StepLR sched(s.opt, 2);
  EXPECT_EQ(sched.base_lrs(), (std::vector<double>{0.05, 0.05}));
  EXPECT_EQ(s.opt.initial_lr(1), 0.05);
}

// A step refused (an lr out of range for one group) changes nothing: group 0's lr was set and the
// epoch counted before group 1's was refused.
TEST(LRScheduler, RefusedStepChangesNothing) {
  TwoGroups s;
  LambdaLR sched(s.opt, std::vector<std::function<double(int64_t)>>{
                            [](int64_t e) { return 1.0 / double(e + 1); },
                            [](int64_t e) { return e == 2 ? -1.0 : 1.0; }});
  sched.step();
  const std::vector<double> lrs = sched.get_last_lr();
  expect_error([&] { sched.step(); }, "SGD param group 1: lr (-0.04) must be non-negative");
  EXPECT_EQ(sched.last_epoch(), 1);
  EXPECT_EQ(sched.get_last_lr(), lrs);
  EXPECT_EQ(s.opt.hyperparameters(0).at("lr"), lrs[0]);
  EXPECT_EQ(s.opt.hyperparameters(1).at("lr"), lrs[1]);
  // Inside a SequentialLR too, at a milestone's restart as well.
  TwoGroups t;
  bool armed = false;  // the restart at the milestone gets a negative lr
  auto bad = [&armed](int64_t) { return armed ? -1.0 : 1.0; };
  auto warm = std::make_shared<LinearLR>(t.opt, 0.5, 1.0, 2);
  auto rest = std::make_shared<LambdaLR>(
      t.opt, std::vector<std::function<double(int64_t)>>{[](int64_t) { return 1.0; }, bad});
  SequentialLR seq(t.opt, {warm, rest}, {1});
  const std::map<std::string, double> before = seq.state_dict();
  armed = true;
  expect_error([&] { seq.step(); }, "SGD param group 1: lr (-0.04) must be non-negative");
  EXPECT_EQ(seq.state_dict(), before);
  EXPECT_EQ(t.opt.hyperparameters(0).at("lr"), before.at("last_lr/0"));
}

// SequentialLR's load is all or nothing: a part its scheduler refuses (a bad last_epoch) left the
// SequentialLR's own progress and the parts before it loaded, the rest not.
TEST(LRScheduler, RefusedSequentialLoadChangesNothing) {
  WarmupCosine saved, fresh, want;
  for (int e = 0; e < 5; ++e)
    saved.sched.step();
  std::map<std::string, double> sd = saved.sched.state_dict();
  sd["schedulers/1/last_epoch"] = 1.5;
  const std::map<std::string, double> before = fresh.sched.state_dict();
  expect_error([&] { fresh.sched.load_state_dict(sd); },
               "CosineAnnealingLR::load_state_dict: last_epoch (1.5) is not a whole number");
  EXPECT_EQ(fresh.sched.state_dict(), before);
  EXPECT_EQ(fresh.sched.last_epoch(), 0);
  expect_same_schedule(want, fresh, 6);
}
