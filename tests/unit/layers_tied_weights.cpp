// Shared modules and tied weights: listed once under the first name, updated, clipped and counted
// once by the optimizers, and saved and loaded under every name. Part of the test_layers binary.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"
#include "unit/layers_test_util.h"

using namespace tessera;
using namespace tessera::layers_test;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;

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
