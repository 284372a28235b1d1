// Basic layers: values against direct loops, initial values against the generator's draws,
// gradients by finite differences through Module::operator(), and the Module machinery the
// layers rely on (names, state dicts, submodule replacement, hooks, train/eval).
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;

namespace {

void expect_near_all(const Tensor& got, const std::vector<double>& want, double tol,
                     const std::string& what) {
  std::vector<double> g = got.to_vector<double>();
  ASSERT_EQ(g.size(), want.size()) << what;
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_NEAR(g[i], want[i], tol * (1.0 + std::abs(want[i]))) << what << " element " << i;
}

void expect_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  EXPECT_EQ(got.to_vector<double>(), want.to_vector<double>()) << what;
}

// Makes a layer's parameter a float64 leaf holding `value`.
void set_param(Parameter& p, const Tensor& value) {
  p = Parameter(value.to(DType::Float64).clone());
}

std::vector<std::string> names_of(Module& m) {
  std::vector<std::string> out;
  for (auto& [name, p] : m.named_parameters())
    out.push_back(name);
  return out;
}

// A container with two layers of different types, as a model would hold them.
class Block : public Module {
 public:
  explicit Block(Generator& gen) : Module("Block") {
    proj = std::make_shared<Linear>(4, 3, true, gen);
    norm = std::make_shared<RMSNorm>(3);
    register_module("proj", proj);
    register_module("norm", norm);
  }
  Tensor forward(const Tensor& x) override { return (*norm)((*proj)(x)); }
  std::shared_ptr<Linear> proj;
  std::shared_ptr<RMSNorm> norm;
};

}  // namespace

// --- Linear ---

TEST(LinearLayer, ForwardMatchesDirectComputation) {
  Generator gen(7);
  Linear lin(5, 3, true, gen);
  Tensor x = random_tensor({2, 4, 5}, 1, DType::Float32);
  Tensor y = lin(x);
  ASSERT_EQ(y.shape(), (Shape{2, 4, 3}));
  auto xv = x.to_vector<double>(), wv = lin.weight.local().to_vector<double>(),
       bv = lin.bias.local().to_vector<double>();
  std::vector<double> want;
  for (int r = 0; r < 8; ++r)
    for (int o = 0; o < 3; ++o) {
      double s = bv[size_t(o)];
      for (int k = 0; k < 5; ++k)
        s += xv[size_t(r * 5 + k)] * wv[size_t(o * 5 + k)];
      want.push_back(s);
    }
  expect_near_all(y, want, 1e-5, "linear");
}

TEST(LinearLayer, WithoutBiasHasOnlyWeight) {
  Generator gen(3);
  auto lp = std::make_shared<Linear>(4, 2, false, gen);
  Linear& lin = *lp;
  EXPECT_FALSE(lin.bias.defined());
  EXPECT_EQ(names_of(lin), (std::vector<std::string>{"weight"}));
  Tensor x = random_tensor({3, 4}, 2, DType::Float32);
  Tensor y = lin(x);
  auto xv = x.to_vector<double>(), wv = lin.weight.local().to_vector<double>();
  std::vector<double> want;
  for (int r = 0; r < 3; ++r)
    for (int o = 0; o < 2; ++o) {
      double s = 0;
      for (int k = 0; k < 4; ++k)
        s += xv[size_t(r * 4 + k)] * wv[size_t(o * 4 + k)];
      want.push_back(s);
    }
  expect_near_all(y, want, 1e-5, "linear without bias");
}

TEST(LinearLayer, InitDrawsWeightThenBiasFromTheGenerator) {
  Generator gen(42);
  auto lp = std::make_shared<Linear>(6, 4, true, gen);
  Linear& lin = *lp;
  EXPECT_EQ(names_of(lin), (std::vector<std::string>{"weight", "bias"}));
  // PyTorch: kaiming_uniform(a = sqrt(5)) gives bound 1/sqrt(in) for W, and b ~ U(+-1/sqrt(in)).
  const double bound = 1.0 / std::sqrt(6.0);
  Generator ref(42);
  Tensor w = empty({4, 6});
  uniform_(w, -bound, bound, ref);
  Tensor b = empty({4});
  uniform_(b, -bound, bound, ref);
  expect_equal(lin.weight.local(), w, "weight draw");
  expect_equal(lin.bias.local(), b, "bias draw");
  EXPECT_EQ(gen.offset(), ref.offset());
  for (double v : lin.weight.local().to_vector<double>())
    EXPECT_LE(std::abs(v), bound);
  EXPECT_TRUE(lin.weight.requires_grad());
  EXPECT_TRUE(lin.bias.requires_grad());
}

TEST(LinearLayer, RejectsWrongInputWidth) {
  Generator gen(1);
  Linear lin(4, 2, true, gen);
  expect_error([&] { lin(zeros({3, 5})); }, {"Linear(4 -> 2)", "[3, 5]", "last dim 4"});
}

TEST(LinearLayer, GradcheckThroughModuleCall) {
  Generator gen(5);
  Linear lin(4, 3, true, gen);
  set_param(lin.weight, random_tensor({3, 4}, 11, DType::Float64));
  set_param(lin.bias, random_tensor({3}, 12, DType::Float64));
  Tensor x = random_tensor({2, 4}, 13, DType::Float64).set_requires_grad(true);
  auto r = gradcheck([&](const std::vector<Tensor>& in) { return lin(in[0]); },
                     {x, lin.weight.local(), lin.bias.local()});
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_TRUE(lin.weight.grad().defined());
}

// --- Embedding ---

TEST(EmbeddingLayer, LooksUpRowsAndDrawsNormalInit) {
  Generator gen(9);
  Embedding emb(7, 3, gen);
  Generator ref(9);
  expect_equal(emb.weight.local(), randn({7, 3}, ref), "N(0, 1) init");
  Tensor ids = from_vector<int64_t>({6, 0, 2, 2, 5, 1}, {2, 3});
  Tensor y = emb(ids);
  ASSERT_EQ(y.shape(), (Shape{2, 3, 3}));
  auto wv = emb.weight.local().to_vector<double>();
  std::vector<double> want;
  for (int64_t id : ids.to_vector<int64_t>())
    for (int d = 0; d < 3; ++d)
      want.push_back(wv[size_t(id * 3 + d)]);
  expect_near_all(y, want, 0, "embedding rows");
}

TEST(EmbeddingLayer, GradcheckThroughModuleCall) {
  Generator gen(4);
  Embedding emb(5, 3, gen);
  set_param(emb.weight, random_tensor({5, 3}, 21, DType::Float64));
  Tensor ids = from_vector<int64_t>({4, 1, 1, 0}, {2, 2});
  auto r = gradcheck([&](const std::vector<Tensor>&) { return emb(ids); }, {emb.weight.local()});
  EXPECT_TRUE(r.ok) << r.message;
  // Repeated id 1 accumulates twice; id 2 and 3 get nothing.
  auto g = emb.weight.grad().to_vector<double>();
  for (int d = 0; d < 3; ++d) {
    EXPECT_EQ(g[size_t(2 * 3 + d)], 0.0);
    EXPECT_EQ(g[size_t(3 * 3 + d)], 0.0);
  }
}

// --- norms ---

TEST(NormLayers, RMSNormMatchesDirectComputation) {
  auto np = std::make_shared<RMSNorm>(4, 1e-5);
  RMSNorm& norm = *np;
  EXPECT_EQ(names_of(norm), (std::vector<std::string>{"weight"}));
  expect_near_all(norm.weight.local(), {1, 1, 1, 1}, 0, "ones");
  norm.weight.copy_from_full(from_vector<float>({0.5f, -1.f, 2.f, 1.5f}));
  Tensor x = random_tensor({3, 4}, 31, DType::Float32);
  auto xv = x.to_vector<double>();
  const double w[] = {0.5, -1, 2, 1.5};
  std::vector<double> want;
  for (int r = 0; r < 3; ++r) {
    double ss = 0;
    for (int j = 0; j < 4; ++j)
      ss += xv[size_t(r * 4 + j)] * xv[size_t(r * 4 + j)];
    const double rs = 1.0 / std::sqrt(ss / 4 + 1e-5);
    for (int j = 0; j < 4; ++j)
      want.push_back(xv[size_t(r * 4 + j)] * rs * w[j]);
  }
  expect_near_all(norm(x), want, 1e-5, "rms_norm");
}

TEST(NormLayers, LayerNormMatchesDirectComputation) {
  auto np = std::make_shared<LayerNorm>(5);
  LayerNorm& norm = *np;
  EXPECT_EQ(names_of(norm), (std::vector<std::string>{"weight", "bias"}));
  expect_near_all(norm.weight.local(), {1, 1, 1, 1, 1}, 0, "ones");
  expect_near_all(norm.bias.local(), {0, 0, 0, 0, 0}, 0, "zeros");
  const std::vector<double> w = {1, 2, -1, 0.5, 3}, b = {0.1, 0, -0.2, 1, 0.5};
  norm.weight.copy_from_full(from_vector<double>(w));
  norm.bias.copy_from_full(from_vector<double>(b));
  Tensor x = random_tensor({2, 5}, 32, DType::Float32);
  auto xv = x.to_vector<double>();
  std::vector<double> want;
  for (int r = 0; r < 2; ++r) {
    double mu = 0, var = 0;
    for (int j = 0; j < 5; ++j)
      mu += xv[size_t(r * 5 + j)] / 5;
    for (int j = 0; j < 5; ++j)
      var += (xv[size_t(r * 5 + j)] - mu) * (xv[size_t(r * 5 + j)] - mu) / 5;
    for (int j = 0; j < 5; ++j)
      want.push_back((xv[size_t(r * 5 + j)] - mu) / std::sqrt(var + 1e-5) * w[size_t(j)] +
                     b[size_t(j)]);
  }
  expect_near_all(norm(x), want, 1e-5, "layer_norm");
}

TEST(NormLayers, GradcheckThroughModuleCall) {
  RMSNorm rms(6);
  set_param(rms.weight, random_tensor({6}, 41, DType::Float64));
  Tensor x = random_tensor({3, 6}, 42, DType::Float64).set_requires_grad(true);
  auto r =
      gradcheck([&](const std::vector<Tensor>& in) { return rms(in[0]); }, {x, rms.weight.local()});
  EXPECT_TRUE(r.ok) << "RMSNorm: " << r.message;

  LayerNorm ln(6);
  set_param(ln.weight, random_tensor({6}, 43, DType::Float64));
  set_param(ln.bias, random_tensor({6}, 44, DType::Float64));
  Tensor x2 = random_tensor({2, 2, 6}, 45, DType::Float64).set_requires_grad(true);
  auto r2 = gradcheck([&](const std::vector<Tensor>& in) { return ln(in[0]); },
                      {x2, ln.weight.local(), ln.bias.local()});
  EXPECT_TRUE(r2.ok) << "LayerNorm: " << r2.message;
}

// --- Module machinery through the layers ---

TEST(LayerModules, NamesInRegistrationOrder) {
  Generator gen(1);
  auto block = std::make_shared<Block>(gen);
  EXPECT_EQ(names_of(*block),
            (std::vector<std::string>{"proj.weight", "proj.bias", "norm.weight"}));
  EXPECT_EQ(block->get_submodule("proj")->type_name(), "Linear");
  EXPECT_EQ(block->named_modules().size(), 3u);
}

TEST(LayerModules, StateDictRoundTrip) {
  Generator g1(1), g2(2);
  auto a = std::make_shared<Block>(g1);
  auto b = std::make_shared<Block>(g2);
  a->norm->weight.copy_from_full(from_vector<float>({0.5f, 2.f, -1.f}));
  Tensor x = random_tensor({2, 4}, 5, DType::Float32);
  Tensor ya = (*a)(x);
  auto sd = a->state_dict();
  ASSERT_EQ(sd.size(), 3u);
  expect_equal(sd.at("proj.weight"), a->proj->weight.local(), "state_dict value");
  b->load_state_dict(sd);
  expect_equal((*b)(x), ya, "output after load");
  // The loaded values are copies, not aliases of the source.
  a->proj->weight.fill_(0.0);
  EXPECT_NE(b->proj->weight.local().to_vector<double>()[0], 0.0);
}

TEST(LayerModules, StrictLoadNamesMissingUnexpectedAndMisshapedKeys) {
  Generator g1(1);
  auto m = std::make_shared<Block>(g1);
  auto sd = m->state_dict();
  Tensor before = m->proj->weight.local().clone();

  auto missing = sd;
  missing.erase("proj.bias");
  expect_error([&] { m->load_state_dict(missing); }, {"missing keys: proj.bias"});
  m->load_state_dict(missing, /*strict=*/false);  // allowed when not strict

  auto unexpected = sd;
  unexpected["proj.scale"] = zeros({3});
  expect_error([&] { m->load_state_dict(unexpected); }, {"unexpected keys: proj.scale"});

  auto misshaped = sd;
  misshaped["proj.weight"] = zeros({4, 3});
  misshaped["norm.weight"] = zeros({9});
  expect_error([&] { m->load_state_dict(misshaped, /*strict=*/false); },
               {"mis-shaped keys", "proj.weight (expected [3, 4], got [4, 3])",
                "norm.weight (expected [3], got [9])"});
  // A failed load writes nothing.
  expect_equal(m->proj->weight.local(), before, "weight after failed load");
}

TEST(LayerModules, ReplaceSubmoduleChecksType) {
  Generator gen(1);
  auto block = std::make_shared<Block>(gen);
  expect_error([&] { block->replace_submodule("proj", std::make_shared<RMSNorm>(4)); },
               {"'proj'", "Linear", "RMSNorm"});
  Generator g2(99);
  auto other = std::make_shared<Linear>(4, 3, false, g2);
  block->replace_submodule("proj", other);
  EXPECT_EQ(block->proj, other);
  EXPECT_EQ(names_of(*block), (std::vector<std::string>{"proj.weight", "norm.weight"}));
  Tensor x = random_tensor({2, 4}, 5, DType::Float32);
  expect_equal((*block)(x), (*block->norm)((*other)(x)), "forward through the new child");
}

TEST(LayerModules, HooksReplaceInputAndOutput) {
  Generator gen(1);
  Linear lin(3, 2, true, gen);
  Tensor x = random_tensor({2, 3}, 6, DType::Float32);
  Tensor doubled = lin(mul(x, 2.0));
  int pre_calls = 0;
  lin.register_forward_pre_hook([&](Module& m, const Tensor& in) {
    EXPECT_EQ(&m, &lin);
    ++pre_calls;
    return mul(in, 2.0);
  });
  expect_equal(lin(x), doubled, "pre-hook replaced input");
  Tensor seen_input;
  lin.register_forward_hook([&](Module&, const Tensor& in, const Tensor& out) {
    seen_input = in;
    return add(out, 1.0);
  });
  Tensor y = lin(x);
  expect_equal(seen_input, mul(x, 2.0), "forward hook sees the replaced input");
  expect_near_all(y, add(doubled, 1.0).to_vector<double>(), 0, "hook replaced output");
  // A pre-hook returning an undefined tensor keeps the input.
  Linear lin2(3, 2, true, gen);
  lin2.register_forward_pre_hook([](Module&, const Tensor&) { return Tensor(); });
  Tensor y2 = lin2(x);
  lin2.register_forward_hook([](Module&, const Tensor&, const Tensor&) { return Tensor(); });
  expect_equal(lin2(x), y2, "undefined hook results keep values");
  EXPECT_EQ(pre_calls, 2);
}

// A hook may register hooks on its own module (a lazy set-up on the first call): as in PyTorch,
// a call runs the pre-hooks there were when it started and the hooks there were when its forward
// returned (the loops ran on over the vector the registration had reallocated, and crashed).
TEST(LayerModules, HooksRegisteredByAHookRunFromTheNextCall) {
  Generator gen(1);
  auto lin = std::make_shared<Linear>(3, 2, true, gen);
  std::vector<std::string> calls;
  bool set_up = false;
  lin->register_forward_pre_hook([&](Module& m, const Tensor&) {
    calls.push_back("pre 0");
    if (!set_up) {
      set_up = true;
      for (int i = 0; i < 4; ++i) {
        m.register_forward_pre_hook([&calls, i](Module&, const Tensor&) {
          calls.push_back("new pre " + std::to_string(i));
          return Tensor();
        });
        m.register_forward_hook([&calls, i](Module&, const Tensor&, const Tensor&) {
          calls.push_back("new hook " + std::to_string(i));
          return Tensor();
        });
      }
    }
    return Tensor();
  });
  lin->register_forward_pre_hook([&](Module&, const Tensor&) {
    calls.push_back("pre 1");
    return Tensor();
  });
  lin->register_forward_hook([&](Module& m, const Tensor&, const Tensor&) {
    calls.push_back("hook 0");
    if (calls.size() < 4)
      m.register_forward_hook([&calls](Module&, const Tensor&, const Tensor&) {
        calls.push_back("late hook");
        return Tensor();
      });
    return Tensor();
  });
  lin->register_forward_hook([&](Module&, const Tensor&, const Tensor&) {
    calls.push_back("hook 1");
    return Tensor();
  });
  const Tensor x = random_tensor({2, 3}, 6, DType::Float32);
  (*lin)(x);
  EXPECT_EQ(calls, (std::vector<std::string>{"pre 0", "pre 1", "hook 0", "hook 1", "new hook 0",
                                             "new hook 1", "new hook 2", "new hook 3"}));
  calls.clear();
  (*lin)(x);
  EXPECT_EQ(calls,
            (std::vector<std::string>{"pre 0", "pre 1", "new pre 0", "new pre 1", "new pre 2",
                                      "new pre 3", "hook 0", "hook 1", "new hook 0", "new hook 1",
                                      "new hook 2", "new hook 3", "late hook"}));
}

TEST(LayerModules, TrainEvalIsRecursive) {
  Generator gen(1);
  auto block = std::make_shared<Block>(gen);
  EXPECT_TRUE(block->is_training());
  EXPECT_TRUE(block->proj->is_training());
  block->eval();
  EXPECT_FALSE(block->is_training());
  EXPECT_FALSE(block->proj->is_training());
  EXPECT_FALSE(block->norm->is_training());
  block->proj->train();
  EXPECT_TRUE(block->proj->is_training());
  EXPECT_FALSE(block->is_training());
  block->train();
  EXPECT_TRUE(block->norm->is_training());
}

namespace {

// A layer that takes another over, as the LoRA wrapper does, through Linear's wrapping
// constructor.
class WrappingLinear : public Linear {
 public:
  explicit WrappingLinear(const Linear& base) : Linear("WrappingLinear", base) {}
};

}  // namespace

// The wrapper runs in the training mode of the layer it replaces (layers with dropout behave
// differently in each).
TEST(LayerModules, WrappingALinearKeepsItsMode) {
  Generator gen(1);
  auto lin = std::make_shared<Linear>(3, 2, true, gen);
  lin->eval();
  EXPECT_FALSE(std::make_shared<WrappingLinear>(*lin)->is_training());
  lin->train();
  EXPECT_TRUE(std::make_shared<WrappingLinear>(*lin)->is_training());
}

// The wrapper runs through the forward pre-hooks and hooks of the layer it replaces (a parallel
// plan's, or the user's), not only with its parameters.
TEST(LayerModules, WrappingALinearKeepsItsHooks) {
  Generator gen(1);
  auto lin = std::make_shared<Linear>(3, 2, true, gen);
  lin->register_forward_pre_hook([](Module&, const Tensor& in) { return mul(in, 2.0); });
  lin->register_forward_hook(
      [](Module&, const Tensor&, const Tensor& out) { return add(out, 1.0); });
  const Tensor x = random_tensor({2, 3}, 6, DType::Float32);
  expect_equal((*std::make_shared<WrappingLinear>(*lin))(x), (*lin)(x), "the wrapper's forward");
}

// The wrapper's forward is checkpointed when the layer's was (checkpoint(lin) before apply_lora
// kept its activations from then on), and so is the plain layer unwrapped from it.
TEST(LayerModules, WrappingALinearKeepsItsActivationCheckpointing) {
  Generator gen(1);
  auto lin = std::make_shared<Linear>(3, 2, true, gen);
  EXPECT_FALSE(std::make_shared<WrappingLinear>(*lin)->activation_checkpointing());
  checkpoint(lin);
  auto wrapper = std::make_shared<WrappingLinear>(*lin);
  EXPECT_TRUE(wrapper->activation_checkpointing());
  EXPECT_TRUE(Linear::unwrapped(*wrapper)->activation_checkpointing());
}

TEST(LayerModules, ZeroGradClearsEveryLayer) {
  Generator gen(1);
  auto block = std::make_shared<Block>(gen);
  backward(sum((*block)(random_tensor({2, 4}, 7, DType::Float32))));
  for (Parameter* p : block->parameters())
    EXPECT_TRUE(p->grad().defined()) << p->str();
  block->zero_grad();
  for (Parameter* p : block->parameters())
    EXPECT_FALSE(p->grad().defined()) << p->str();
}

// --- shared modules and tied weights ---

namespace {

// An embedding and an output projection tied by assignment, as PyTorch's
// `lm_head.weight = embed.weight`: two Parameters holding one tensor.
class TiedLm : public Module {
 public:
  explicit TiedLm(Generator& gen) : Module("TiedLm") {
    embed = std::make_shared<Embedding>(5, 3, gen);
    lm_head = std::make_shared<Linear>(3, 5, false, gen);
    lm_head->weight = embed->weight;
    register_module("embed", embed);
    register_module("lm_head", lm_head);
  }
  Tensor forward(const Tensor& ids) override { return (*lm_head)((*embed)(ids)); }
  std::shared_ptr<Embedding> embed;
  std::shared_ptr<Linear> lm_head;
};

// One Linear registered under two names.
class SharedChild : public Module {
 public:
  explicit SharedChild(Generator& gen) : Module("SharedChild") {
    a = std::make_shared<Linear>(2, 2, true, gen);
    b = a;
    register_module("a", a);
    register_module("b", b);
  }
  std::shared_ptr<Linear> a, b;
};

template <class Pairs>
std::vector<std::string> first_of(const Pairs& pairs) {
  std::vector<std::string> out;
  for (const auto& [name, x] : pairs)
    out.push_back(name);
  return out;
}

template <class Map>
std::vector<std::string> keys_of(const Map& map) {
  return first_of(map);
}

}  // namespace

TEST(TiedWeights, ListedOnceUnderTheFirstName) {
  Generator gen(1);
  auto m = std::make_shared<TiedLm>(gen);
  EXPECT_EQ(names_of(*m), (std::vector<std::string>{"embed.weight"}));
  EXPECT_EQ(m->parameters().size(), 1u);
  EXPECT_EQ(first_of(m->named_parameters(true, /*remove_duplicate=*/false)),
            (std::vector<std::string>{"embed.weight", "lm_head.weight"}));
}

// PyTorch: SGD(lr=1) from w = 0 with gradient 1 gives -1; listing the tensor twice gave -2.
TEST(TiedWeights, OptimizersUpdateATiedWeightOnce) {
  Generator gen(1);
  auto m = std::make_shared<TiedLm>(gen);
  m->embed->weight.fill_(0.0);
  Tensor leaf = m->embed->weight.stored();
  leaf.set_grad(full({5, 3}, 1.0));
  SGD sgd(m->parameters(), {.lr = 1.0});
  sgd.step();
  expect_near_all(m->lm_head->weight.stored(), std::vector<double>(15, -1.0), 0, "after SGD");
  AdamW adamw(m->parameters(), {.lr = 0.1, .weight_decay = 0.0});
  adamw.step();
  // One Adam step moves each element by lr (m / sqrt(v) = 1 after bias correction).
  expect_near_all(m->embed->weight.stored(), std::vector<double>(15, -1.1), 1e-6, "after AdamW");
}

TEST(TiedWeights, OptimizersRefuseATensorListedTwice) {
  Generator gen(1);
  auto m = std::make_shared<TiedLm>(gen);
  expect_error(
      [&] {
        SGD({&m->embed->weight, &m->lm_head->weight}, {});
      },
      {"SGD: parameter 1 of 2", "is parameter 0 again", "some parameters appear more than once"});
  Parameter p(zeros({2}));
  expect_error([&] { AdamW({&p, &p}, {}); }, {"AdamW: parameter 1 of 2", "is parameter 0 again"});
}

TEST(TiedWeights, ClipGradNormCountsAndScalesATiedGradientOnce) {
  Generator gen(1);
  auto m = std::make_shared<TiedLm>(gen);
  Tensor leaf = m->embed->weight.stored();
  leaf.set_grad(full({5, 3}, 1.0, DType::Float32));
  const double norm = clip_grad_norm_({&m->embed->weight, &m->lm_head->weight}, 1.0);
  EXPECT_NEAR(norm, std::sqrt(15.0), 1e-6);
  expect_near_all(m->embed->weight.grad(), std::vector<double>(15, 1.0 / std::sqrt(15.0)), 1e-6,
                  "scaled once");
}

TEST(TiedWeights, StateDictHasEveryNameAndLoadsThemAll) {
  Generator g1(1), g2(2);
  auto a = std::make_shared<TiedLm>(g1);
  auto b = std::make_shared<TiedLm>(g2);
  const auto sd = a->state_dict();
  EXPECT_EQ(keys_of(sd), (std::vector<std::string>{"embed.weight", "lm_head.weight"}));
  expect_equal(sd.at("lm_head.weight"), sd.at("embed.weight"), "one tensor under both names");
  EXPECT_TRUE(b->load_state_dict(sd).empty());
  expect_equal(b->lm_head->weight.stored(), a->embed->weight.stored(), "loaded");
  EXPECT_TRUE(b->lm_head->weight.stored().is_same(b->embed->weight.stored())) << "still tied";
  auto only_first = sd;
  only_first.erase("lm_head.weight");
  expect_error([&] { b->load_state_dict(only_first); }, {"missing keys: lm_head.weight"});
}

TEST(SharedModules, ListedOnceByNamedModulesAndUnderEveryNameByStateDict) {
  Generator gen(1);
  auto m = std::make_shared<SharedChild>(gen);
  EXPECT_EQ(first_of(m->named_modules()), (std::vector<std::string>{"", "a"}));
  EXPECT_EQ(first_of(m->named_modules(/*remove_duplicate=*/false)),
            (std::vector<std::string>{"", "a", "b"}));
  EXPECT_EQ(names_of(*m), (std::vector<std::string>{"a.weight", "a.bias"}));
  const auto sd = m->state_dict();
  EXPECT_EQ(keys_of(sd), (std::vector<std::string>{"a.bias", "a.weight", "b.bias", "b.weight"}));
  EXPECT_TRUE(m->load_state_dict(sd).empty());
}

// PyTorch's load_state_dict(strict=False) returns the keys it did not take.
TEST(LayerModules, NonStrictLoadReturnsMissingAndUnexpectedKeys) {
  Generator gen(1);
  auto m = std::make_shared<Block>(gen);
  auto sd = m->state_dict();
  EXPECT_TRUE(m->load_state_dict(sd).empty());
  sd.erase("proj.bias");
  sd.erase("norm.weight");
  sd["zz.extra"] = zeros({1});
  sd["aa.extra"] = zeros({1});
  const IncompatibleKeys k = m->load_state_dict(sd, /*strict=*/false);
  EXPECT_EQ(k.missing_keys, (std::vector<std::string>{"norm.weight", "proj.bias"}));
  EXPECT_EQ(k.unexpected_keys, (std::vector<std::string>{"aa.extra", "zz.extra"}));
  EXPECT_TRUE(k.mismatched_keys.empty());
}

// PyTorch's nn.RMSNorm(eps=None) uses torch.finfo(x.dtype).eps: [1e-3, -1e-3] in float32 gives
// 1e-3 / sqrt(1e-6 + 1.19e-7) = 0.9452 (with eps 1e-6: 0.7071).
TEST(NormLayers, RMSNormDefaultEpsIsTheInputDtypesEpsilon) {
  const Tensor x = from_vector<float>({1e-3f, -1e-3f});
  const double want = 1e-3 / std::sqrt(1e-6 + 1.1920928955078125e-07);
  expect_near_all((*std::make_shared<RMSNorm>(2))(x), {want, -want}, 1e-6, "float32 default");
  EXPECT_NEAR(want, 0.9452, 1e-4);
  EXPECT_FALSE(RMSNorm(2).eps().has_value());
  const double with_1e6 = 1e-3 / std::sqrt(2e-6);
  expect_near_all((*std::make_shared<RMSNorm>(2, 1e-6))(x), {with_1e6, -with_1e6}, 1e-6,
                  "explicit 1e-6");
  // The op alone, in bfloat16: float32's eps, as PyTorch computes in float32 (bfloat16's own
  // 0.0078125 would give 0.125 / sqrt(0.015625 + 0.0078125) = 0.8165).
  const Tensor xb = from_vector<float>({0.125f, -0.125f}).to(DType::BFloat16);
  const double wb = 0.125 / std::sqrt(0.015625 + 1.1920928955078125e-07);
  expect_near_all(rms_norm(xb, Tensor()), {wb, -wb}, 4e-3, "bfloat16 default");
  expect_near_all(rms_norm(x, Tensor()), {want, -want}, 1e-6, "float32 op default");
}

// torch.nn.init.kaiming_uniform_'s default a = 0 gives bound sqrt(6 / fan_in); Linear keeps
// nn.Linear's a = sqrt(5) (LinearLayer.InitDrawsWeightThenBiasFromTheGenerator).
TEST(ParameterInit, KaimingUniformDefaultsToPyTorchsAZero) {
  Generator gen(5), ref(5);
  Parameter p(empty({4, 6}));
  p.kaiming_uniform_(gen);
  const double bound = kaiming_uniform_bound({4, 6}, 0.0, FanMode::FanIn);
  EXPECT_NEAR(bound, std::sqrt(6.0 / 6.0), 1e-12);
  Tensor want = empty({4, 6});
  uniform_(want, -bound, bound, ref);
  expect_equal(p.stored(), want, "kaiming_uniform_ with a = 0");
}

// A buffer that requires grad (a running statistic someone differentiates through) loads like
// any: the load runs without grad, as PyTorch's does. It used to be refused by copy_ after the
// parameters had been written.
TEST(LayerModules, LoadStateDictWritesABufferThatRequiresGrad) {
  class WithBuffer : public Module {
   public:
    explicit WithBuffer(Generator& gen) : Module("WithBuffer") {
      proj = std::make_shared<Linear>(2, 2, false, gen);
      register_module("proj", proj);
      stat = zeros({2});
      stat.set_requires_grad(true);
      register_buffer("stat", &stat);
    }
    std::shared_ptr<Linear> proj;
    Tensor stat;
  };
  Generator gen(5);
  auto m = std::make_shared<WithBuffer>(gen);
  std::map<std::string, Tensor> sd{{"proj.weight", full({2, 2}, 3.0)}, {"stat", full({2}, 7.0)}};
  m->load_state_dict(sd);
  EXPECT_EQ(m->proj->weight.local().to_vector<double>(), (std::vector<double>{3, 3, 3, 3}));
  EXPECT_EQ(m->stat.to_vector<double>(), (std::vector<double>{7, 7}));
}
