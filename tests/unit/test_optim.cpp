// SGD and AdamW against PyTorch's update formulas written out here in double, over several
// steps with changing gradients; clip_grad_norm_ on plain parameters.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "unit/optim_test_util.h"

using namespace tessera;
using tessera::testing::expect_error;
using namespace tessera::optim_test;

namespace {

// torch.optim.SGD (dampening 0, no nesterov): d = g + wd * p; buf = d on the first step, then
// buf = momentum * buf + d; p -= lr * (momentum ? buf : d).
struct RefSGD {
  double lr, momentum, wd;
  Vec buf;
  void step(Vec& p, const Vec& g) {
    Vec d(p.size());
    for (size_t i = 0; i < p.size(); ++i)
      d[i] = g[i] + wd * p[i];
    if (momentum != 0) {
      if (buf.empty()) {
        buf = d;
      } else {
        for (size_t i = 0; i < p.size(); ++i)
          buf[i] = momentum * buf[i] + d[i];
      }
      d = buf;
    }
    for (size_t i = 0; i < p.size(); ++i)
      p[i] -= lr * d[i];
  }
};

// torch.optim.AdamW: p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
struct RefAdamW {
  double lr, b1, b2, eps, wd;
  Vec m, v;
  int t = 0;
  void step(Vec& p, const Vec& g) {
    if (m.empty()) m.assign(p.size(), 0.0), v.assign(p.size(), 0.0);
    ++t;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
    }
  }
};

}  // namespace

TEST(SGD, PlainStepsMatchReference) {
  Vec p0 = random_vec(6, 1);
  Parameter p = make_param(p0);
  SGD opt({&p}, {.lr = 0.1});
  RefSGD ref{0.1, 0, 0, {}};
  Vec want = p0;
  for (int t = 0; t < 3; ++t) {
    Vec g = random_vec(6, 10 + uint64_t(t));
    set_grad(p, g);
    opt.step();
    ref.step(want, g);
    expect_near_all(p.local(), want, 1e-14, "sgd step " + std::to_string(t));
  }
}

TEST(SGD, MomentumAndWeightDecayMatchReference) {
  Vec a0 = random_vec(5, 2), b0 = random_vec(3, 3);
  Parameter a = make_param(a0), b = make_param(b0);
  SGD opt({&a, &b}, {.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01});
  RefSGD ra{0.05, 0.9, 0.01, {}}, rb{0.05, 0.9, 0.01, {}};
  Vec wa = a0, wb = b0;
  for (int t = 0; t < 3; ++t) {
    Vec ga = random_vec(5, 20 + uint64_t(t)), gb = random_vec(3, 30 + uint64_t(t));
    set_grad(a, ga);
    set_grad(b, gb);
    opt.step();
    ra.step(wa, ga);
    rb.step(wb, gb);
    expect_near_all(a.local(), wa, 1e-14, "a step " + std::to_string(t));
    expect_near_all(b.local(), wb, 1e-14, "b step " + std::to_string(t));
  }
  // Momentum actually mattered: a plain-SGD trajectory ends elsewhere.
  RefSGD plain{0.05, 0, 0.01, {}};
  Vec wp = a0;
  for (int t = 0; t < 3; ++t)
    plain.step(wp, random_vec(5, 20 + uint64_t(t)));
  EXPECT_GT(std::abs(wp[0] - wa[0]), 1e-4);
}

TEST(SGD, Float32AndBFloat16Parameters) {
  Vec p0 = random_vec(8, 4);
  Parameter p32 = make_param(p0, DType::Float32);
  Parameter p16 = make_param(p0, DType::BFloat16);
  Vec start16 = p16.local().to_vector<double>();
  SGD opt({&p32, &p16}, {.lr = 0.1, .momentum = 0.5});
  RefSGD r32{0.1, 0.5, 0, {}}, r16{0.1, 0.5, 0, {}};
  Vec w32 = p32.local().to_vector<double>(), w16 = start16;
  for (int t = 0; t < 3; ++t) {
    Vec g = random_vec(8, 40 + uint64_t(t));
    set_grad(p32, g);
    set_grad(p16, g);
    opt.step();
    r32.step(w32, g);
    r16.step(w16, p16.grad().to_vector<double>());
  }
  EXPECT_EQ(p16.dtype(), DType::BFloat16);
  expect_near_all(p32.local(), w32, 1e-6, "float32");
  expect_near_all(p16.local(), w16, 2e-2, "bfloat16");
}

TEST(AdamW, StepsMatchReferenceWithWeightDecay) {
  Vec a0 = random_vec(7, 5), b0 = random_vec(4, 6);
  Parameter a = make_param(a0), b = make_param(b0);
  AdamWOptions o{.lr = 0.01, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1};
  AdamW opt({&a, &b}, o);
  RefAdamW ra{0.01, 0.8, 0.95, 1e-6, 0.1, {}, {}}, rb = ra;
  Vec wa = a0, wb = b0;
  for (int t = 0; t < 3; ++t) {
    Vec ga = random_vec(7, 50 + uint64_t(t)), gb = random_vec(4, 60 + uint64_t(t));
    set_grad(a, ga);
    set_grad(b, gb);
    opt.step();
    ra.step(wa, ga);
    rb.step(wb, gb);
    expect_near_all(a.local(), wa, 1e-13, "a step " + std::to_string(t));
    expect_near_all(b.local(), wb, 1e-13, "b step " + std::to_string(t));
  }
  EXPECT_EQ(opt.step_count(), 3);
  expect_near_all(opt.exp_avg()[0], ra.m, 1e-13, "exp_avg");
  expect_near_all(opt.exp_avg_sq()[1], rb.v, 1e-13, "exp_avg_sq");
  EXPECT_EQ(opt.exp_avg()[0].shape(), a.local().shape());
}

TEST(AdamW, DecoupledDecayShrinksWithoutGradientSignal) {
  // A zero gradient leaves m = v = 0, so only the decay p *= 1 - lr * wd acts.
  Vec p0 = {1.0, -2.0, 0.5};
  Parameter p = make_param(p0);
  AdamW opt({&p}, {.lr = 0.1, .weight_decay = 0.5});
  set_grad(p, {0, 0, 0});
  opt.step();
  expect_near_all(p.local(), {0.95, -1.9, 0.475}, 1e-15, "decayed");
}

TEST(AdamW, Float32MatchesReference) {
  Vec p0 = random_vec(16, 7);
  Parameter p = make_param(p0, DType::Float32);
  AdamW opt({&p}, {.lr = 0.02});
  RefAdamW ref{0.02, 0.9, 0.999, 1e-8, 1e-2, {}, {}};
  Vec w = p.local().to_vector<double>();
  for (int t = 0; t < 3; ++t) {
    Vec g = random_vec(16, 70 + uint64_t(t));
    set_grad(p, g);
    opt.step();
    ref.step(w, p.grad().to_vector<double>());
  }
  expect_near_all(p.local(), w, 1e-5, "float32 adamw");
}

TEST(Optimizer, SkipsParametersWithoutGradient) {
  Vec a0 = random_vec(3, 8), b0 = random_vec(2, 9);
  Parameter a = make_param(a0), b = make_param(b0);
  AdamW adam({&a, &b}, {.lr = 0.1});
  SGD sgd({&a, &b}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.1});
  for (int t = 0; t < 3; ++t) {
    set_grad(a, random_vec(3, 80 + uint64_t(t)));
    adam.step();
    sgd.step();
  }
  // b never had a gradient: untouched (not even decayed) and no state was made for it.
  expect_near_all(b.local(), b0, 0, "b untouched");
  EXPECT_FALSE(adam.exp_avg()[1].defined());
  EXPECT_TRUE(adam.exp_avg()[0].defined());
  Vec av = a.local().to_vector<double>();
  EXPECT_NE(av[0], a0[0]);
}

TEST(Optimizer, SetLrAndZeroGrad) {
  Vec p0 = {1.0, 2.0};
  Parameter p = make_param(p0);
  SGD opt({&p}, {.lr = 0.1});
  EXPECT_EQ(opt.lr(), 0.1);
  opt.set_lr(0.5);
  set_grad(p, {1.0, -1.0});
  opt.step();
  expect_near_all(p.local(), {0.5, 2.5}, 1e-15, "step with the new lr");
  opt.zero_grad();
  EXPECT_FALSE(p.grad().defined());
  opt.step();  // no gradient: nothing happens
  expect_near_all(p.local(), {0.5, 2.5}, 0, "no-op step");
}

// PyTorch's zero_grad(set_to_none=False), on the optimizer and on a module: each gradient stays,
// zeroed in place (the next backward accumulates into it), and a missing one stays missing; the
// default still drops them.
TEST(Optimizer, ZeroGradWithoutSetToNoneZeroesInPlace) {
  Parameter p = make_param({1.0, 2.0}), q = make_param({3.0});
  SGD opt({&p, &q}, {.lr = 0.1});
  set_grad(p, {1.0, -1.0});
  const Tensor before = p.grad();
  opt.zero_grad(/*set_to_none=*/false);
  ASSERT_TRUE(p.grad().defined());
  EXPECT_TRUE(p.grad().storage().is_same(before.storage())) << "the gradient was replaced";
  expect_near_all(p.grad(), {0.0, 0.0}, 0, "zeroed gradient");
  EXPECT_FALSE(q.grad().defined()) << "a missing gradient was created";
  opt.step();
  expect_near_all(p.local(), {1.0, 2.0}, 0, "a step on zeroed gradients");
  opt.zero_grad();
  EXPECT_FALSE(p.grad().defined());

  Generator gen(5);
  auto lin = std::make_shared<Linear>(3, 2, true, gen);
  const Tensor x = randn({4, 3}, gen);
  backward(sum((*lin)(x)));
  const Tensor first = lin->weight.grad().clone();
  lin->zero_grad(/*set_to_none=*/false);
  for (Parameter* w : lin->parameters()) {
    ASSERT_TRUE(w->grad().defined());
    EXPECT_FALSE(w->grad().requires_grad());
    expect_near_all(w->grad(), Vec(size_t(w->grad().numel()), 0.0), 0, "module zero_grad");
  }
  backward(sum((*lin)(x)));
  expect_near_all(lin->weight.grad(), first.to(DType::Float64).to_vector<double>(), 0,
                  "a backward after zeroing");
  lin->zero_grad();
  EXPECT_FALSE(lin->weight.grad().defined());
}

TEST(Optimizer, RejectsBadOptions) {
  Parameter p = make_param({1.0, 2.0});
  expect_error([&] { SGD({&p}, {.lr = -1}); }, "SGD: lr (-1)");
  expect_error([&] { AdamW({&p}, {.beta1 = 1.0}); }, "AdamW: betas (1, ");
  expect_error([&] { SGD({nullptr}, {}); }, "SGD: parameter 0 of 1 is null");
}

// PyTorch refuses an empty list; stepping it would silently train nothing.
TEST(Optimizer, RejectsEmptyParameterList) {
  // A bare {} could be a list of parameters or of groups: the tests name the type.
  expect_error([&] { AdamW(std::vector<Parameter*>{}, {}); },
               "AdamW: optimizer got an empty parameter list");
  expect_error([&] { SGD(std::vector<Parameter*>{}, {}); },
               "SGD: optimizer got an empty parameter list");
  expect_error(
      [&] {
        Adam(ParamGroups{{{}, {}}, {{}, {}}}, {});
      },
      "Adam: optimizer got an empty parameter list");
}

TEST(ClipGradNorm, ScalesWhenAboveMaxNorm) {
  Vec ga = {3.0, 0.0, -4.0}, gb = {12.0};
  Parameter a = make_param({0, 0, 0}), b = make_param({0}), c = make_param({1, 1});
  set_grad(a, ga);
  set_grad(b, gb);  // c has no gradient and contributes nothing
  const double norm = clip_grad_norm_({&a, &b, &c}, 6.5);
  EXPECT_NEAR(norm, 13.0, 1e-12);  // sqrt(9 + 16 + 144)
  const double coef = 6.5 / (13.0 + 1e-6);
  expect_near_all(a.grad(), {3 * coef, 0, -4 * coef}, 1e-15, "a clipped");
  expect_near_all(b.grad(), {12 * coef}, 1e-15, "b clipped");
  EXPECT_FALSE(c.grad().defined());
  // Now below the limit: returned, nothing scaled.
  const double again = clip_grad_norm_({&a, &b, &c}, 100.0);
  EXPECT_NEAR(again, 13.0 * coef, 1e-12);
  expect_near_all(b.grad(), {12 * coef}, 1e-15, "b unchanged");
}

// A NaN anywhere makes the norm NaN, and every gradient then NaN (PyTorch's clamped coefficient),
// rather than the others taking an unclipped step.
TEST(ClipGradNorm, NanNormReachesEveryGradient) {
  Parameter a = make_param({0, 0}), b = make_param({0});
  set_grad(a, {std::nan(""), 1.0});
  set_grad(b, {100.0});
  expect_error(
      [&] {
        clip_grad_norm_({&a, &b}, 1.0, 2.0, /*error_if_nonfinite=*/true);
      },
      "clip_grad_norm_: the total norm of the gradients is nan");
  EXPECT_EQ(b.grad().item<double>(), 100.0) << "nothing scaled by the refused call";
  EXPECT_TRUE(std::isnan(clip_grad_norm_({&a, &b}, 1.0)));
  EXPECT_TRUE(std::isnan(b.grad().item<double>()));
}

// PyTorch's clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite): the total
// p-norm is (sum over every element of |g|^p)^(1/p), for inf the largest |g|.
TEST(ClipGradNorm, NormTypeInfinityAndGeneralP) {
  const Vec ga = {3.0, 0.0, -4.0}, gb = {12.0};
  const std::vector<std::pair<double, double>> norms = {
      {INFINITY, 12.0}, {1.0, 19.0}, {3.0, std::cbrt(27.0 + 64.0 + 1728.0)}, {2.0, 13.0}};
  for (const auto& [p, want] : norms) {
    Parameter a = make_param({0, 0, 0}), b = make_param({0});
    set_grad(a, ga);
    set_grad(b, gb);
    EXPECT_NEAR(clip_grad_norm_({&a, &b}, 100.0, p), want, 1e-12 * want) << "p = " << p;
    expect_near_all(b.grad(), {12.0}, 0, "not clipped below max_norm");
    EXPECT_NEAR(clip_grad_norm_({&a, &b}, 6.0, p), want, 1e-12 * want) << "p = " << p;
    const double coef = 6.0 / (want + 1e-6);
    expect_near_all(a.grad(), {3 * coef, 0, -4 * coef}, 1e-15, "a clipped");
    expect_near_all(b.grad(), {12 * coef}, 1e-15, "b clipped");
  }
}

TEST(ClipGradNorm, InfinityNormOfANanIsNan) {
  Parameter a = make_param({0, 0}), b = make_param({0});
  set_grad(a, {1.0, std::nan("")});
  set_grad(b, {100.0});
  EXPECT_TRUE(std::isnan(clip_grad_norm_({&a, &b}, 1.0, INFINITY)));
  EXPECT_TRUE(std::isnan(b.grad().item<double>()));
}

TEST(ClipGradNorm, RefusesNormTypesThatAreNotNorms) {
  Parameter a = make_param({1.0});
  set_grad(a, {1.0});
  for (double p : std::vector<double>{0.0, -1.0, -INFINITY, NAN})
    expect_error([&] { clip_grad_norm_({&a}, 1.0, p); },
                 {"clip_grad_norm_: norm_type", "is not supported"});
  EXPECT_EQ(a.grad().item<double>(), 1.0);
}

// clip_grad_norm_(params, max_norm, true) was error_if_nonfinite before norm_type took the third
// place; a bool there does not compile rather than read as norm_type 1.
template <class T>
constexpr bool clip_takes_third = requires(const std::vector<Parameter*>& ps, T third) {
  clip_grad_norm_(ps, 1.0, third);
};
static_assert(!clip_takes_third<bool>);
static_assert(clip_takes_third<double> && clip_takes_third<int> && clip_takes_third<float>);

TEST(ClipGradNorm, Float32Gradients) {
  Vec g = random_vec(100, 11);
  Parameter p = make_param(Vec(100, 0.0), DType::Float32);
  set_grad(p, g);
  double want = 0;
  for (double v : p.grad().to_vector<double>())
    want += v * v;
  want = std::sqrt(want);
  EXPECT_NEAR(clip_grad_norm_({&p}, 1.0), want, 1e-9 * want);
  double after = 0;
  for (double v : p.grad().to_vector<double>())
    after += v * v;
  EXPECT_NEAR(std::sqrt(after), 1.0, 1e-5);
}

TEST(Optimizer, ResetStateForgetsAParametersUpdates) {
  Parameter a(full({3}, 1.0)), b(full({3}, 1.0));
  AdamW opt({&a, &b}, AdamWOptions{.lr = 0.1});
  for (Parameter* p : {&a, &b})
    Tensor(p->stored()).set_grad(full({3}, 0.5));
  opt.step();
  opt.reset_state({&a});
  EXPECT_EQ(opt.param_step(0), 0);
  EXPECT_FALSE(opt.state_tensor(0, "exp_avg", false).defined());
  EXPECT_EQ(opt.param_step(1), 1);
  EXPECT_TRUE(opt.state_tensor(1, "exp_avg", false).defined());
  Parameter stranger(full({1}, 0.0));
  tessera::testing::expect_error([&] { opt.reset_state({&stranger}); },
                                 "is not a parameter of this optimizer");
}

// A step refuses before it changes anything, as PyTorch's: a parameter it cannot update after
// one it can left the first (and the step counts) one step ahead of the rest.
TEST(Optimizer, RefusedStepChangesNothing) {
  const Vec a0 = {1.0, 2.0};
  Parameter a = make_param(a0);
  Parameter n(from_vector<int64_t>({3, 4}), /*requires_grad=*/false);
  Tensor(n.stored()).set_grad(from_vector<int64_t>({1, 1}));
  AdamW adam({&a, &n}, {.lr = 0.1});
  SGD sgd({&a, &n}, {.lr = 0.1});
  for (Optimizer* opt : std::vector<Optimizer*>{&adam, &sgd}) {
    set_grad(a, {1.0, -1.0});
    expect_error([&] { opt->step(); }, {"parameter 1", "not floating point", "int64"});
    expect_near_all(a.local(), a0, 0, "a parameter before the refused one");
    EXPECT_EQ(opt->param_step(0), 0);
  }
  EXPECT_EQ(adam.step_count(), 0);
  EXPECT_FALSE(adam.exp_avg()[0].defined());
}
