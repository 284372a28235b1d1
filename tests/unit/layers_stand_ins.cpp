// Stand-in parameters (Module::set_parameter_stand_ins) and children added from outside
// (add_module, delete_module): what LoRA's modules_to_save is built on. Part of the test_layers
// binary.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"
#include "unit/layers_test_util.h"

using namespace tessera;
using namespace tessera::layers_test;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;

namespace {

// Parameters named as a Linear's, held apart: a stand-in set.
class Spare : public Module {
 public:
  Spare(const Linear& like, uint64_t seed) : Module("Spare") {
    weight = Parameter(random_tensor(like.weight.stored().shape(), seed, DType::Float32));
    bias = Parameter(random_tensor(like.bias.stored().shape(), seed + 1, DType::Float32));
    register_parameter("weight", &weight);
    register_parameter("bias", &bias);
  }
  Parameter weight, bias;
};

struct Rig {
  Generator gen{3};
  std::shared_ptr<Linear> lin = std::make_shared<Linear>(4, 3, true, gen);
  std::shared_ptr<Spare> spare = std::make_shared<Spare>(*lin, 11);
  int64_t chosen = 0;
  Tensor own_weight = lin->weight.stored().clone();
  Rig() {
    lin->add_module("spare", spare);
    lin->set_parameter_stand_ins({{{"weight", &spare->weight}, {"bias", &spare->bias}}},
                                 [this] { return Module::StandInChoice{chosen}; });
  }
  // What the Linear computes with the spare's values, and with its own.
  Tensor with_spare(const Tensor& x) const {
    NoGradGuard no_grad;
    return add(kernels::matmul(x, spare->weight.stored(), false, true), spare->bias.stored());
  }
};

}  // namespace

TEST(LayerStandIns, TheForwardComputesWithTheChosenSetWhichGetsTheGradients) {
  Rig rig;
  Tensor x = random_tensor({2, 4}, 5, DType::Float32);
  Tensor y = (*rig.lin)(x);
  expect_near_all(y, rig.with_spare(x).to_vector<double>(), 1e-6, "stand-in forward");
  // Outside the forward, every Parameter object holds its own value again.
  expect_equal(rig.lin->weight.stored(), rig.own_weight, "own weight after the forward");
  backward(sum(y));
  EXPECT_FALSE(rig.lin->weight.grad().defined());
  ASSERT_TRUE(rig.spare->weight.grad().defined());
  // d sum(x W^T + b) / dW = ones^T x: each row of the gradient is x's column sums.
  Tensor want = kernels::matmul(ones({2, 3}), x, /*trans_a=*/true);
  expect_near_all(rig.spare->weight.grad(), want.to_vector<double>(), 1e-6,
                  "stand-in weight gradient");
  // -1: the module's own.
  rig.chosen = -1;
  rig.spare->zero_grad();
  Tensor own = (*rig.lin)(x);
  expect_equal(own, rig.lin->forward(x), "own forward");
  backward(sum(own));
  EXPECT_TRUE(rig.lin->weight.grad().defined());
  EXPECT_FALSE(rig.spare->weight.grad().defined());
}

TEST(LayerStandIns, ActivationCheckpointingRecomputesWithTheSameSet) {
  Rig rig;
  Rig plain;  // the same values, not checkpointed
  checkpoint(rig.lin);
  Tensor x = random_tensor({2, 4}, 5, DType::Float32);
  Tensor y = (*rig.lin)(x);
  Tensor y2 = (*plain.lin)(x);
  expect_equal(y, y2, "checkpointed forward");
  backward(sum(mul(y, y)));
  backward(sum(mul(y2, y2)));
  ASSERT_TRUE(rig.spare->weight.grad().defined());
  EXPECT_FALSE(rig.lin->weight.grad().defined());
  expect_equal(rig.spare->weight.grad(), plain.spare->weight.grad(), "recomputed gradient");
}

TEST(LayerStandIns, AForwardThatThrowsLeavesEveryParameterItsOwn) {
  Rig rig;
  Tensor bad = random_tensor({2, 5}, 5, DType::Float32);  // in_features is 4
  EXPECT_THROW((*rig.lin)(bad), Error);
  expect_equal(rig.lin->weight.stored(), rig.own_weight, "own weight after a throw");
}

TEST(LayerStandIns, BadSetsAreRefusedNamingTheParameter) {
  Generator gen(3);
  auto lin = std::make_shared<Linear>(4, 3, true, gen);
  Parameter wrong(random_tensor({3, 5}, 1, DType::Float32));
  expect_error(
      [&] {
        lin->set_parameter_stand_ins({{{"weight", &wrong}}},
                                     [] { return Module::StandInChoice{0}; });
      },
      {"stand-in set 0 for 'weight'", "[3, 5]"});
  expect_error(
      [&] {
        lin->set_parameter_stand_ins({{{"scale", &wrong}}},
                                     [] { return Module::StandInChoice{0}; });
      },
      {"'scale'", "none of its parameters"});
  Parameter fine(random_tensor({3, 4}, 1, DType::Float32));
  lin->set_parameter_stand_ins({{{"weight", &fine}}}, [] { return Module::StandInChoice{1}; });
  expect_error(
      [&] {
        (*lin)(random_tensor({2, 4}, 5, DType::Float32));
      },
      {"stand-in set 1 chosen, of 1"});
  lin->set_parameter_stand_ins({{{"weight", &fine}}}, [] {
    return Module::StandInChoice{-1, std::vector<int64_t>{0, -1, 0}};
  });
  expect_error(
      [&] {
        (*lin)(random_tensor({2, 4}, 5, DType::Float32));
      },
      {"stand-in sets chosen for 3 rows", "[2, 4]"});
}

TEST(LayerStandIns, AddedChildrenAreListedReplacedAndDeleted) {
  Rig rig;
  EXPECT_EQ(names_of(*rig.lin),
            (std::vector<std::string>{"weight", "bias", "spare.weight", "spare.bias"}));
  EXPECT_EQ(rig.lin->state_dict().count("spare.bias"), 1u);
  rig.lin->clear_parameter_stand_ins();
  rig.lin->delete_module("spare");
  EXPECT_EQ(names_of(*rig.lin), (std::vector<std::string>{"weight", "bias"}));
  expect_error([&] { rig.lin->delete_module("spare"); }, {"no child 'spare'"});
  Generator gen(1);
  auto block = std::make_shared<Block>(gen);
  expect_error([&] { block->delete_module("proj"); }, {"'proj'", "own members"});
}

// A mixed batch: each row computes with its own set, and each set's parameters get the gradients
// of their rows only.
TEST(LayerStandIns, EachRowTakesItsSet) {
  Rig rig;
  rig.lin->set_parameter_stand_ins(
      {{{"weight", &rig.spare->weight}, {"bias", &rig.spare->bias}}}, [] {
        return Module::StandInChoice{-1, std::vector<int64_t>{0, -1, -1, 0}};
      });
  Tensor x = random_tensor({4, 4}, 5, DType::Float32);
  Tensor y = (*rig.lin)(x);
  const Tensor own = rig.lin->forward(x), spare = rig.with_spare(x);
  for (int64_t r = 0; r < 4; ++r) {
    const Tensor want = kernels::narrow(r == 0 || r == 3 ? spare : own, 0, r, 1);
    expect_near_all(kernels::narrow(y, 0, r, 1), want.to_vector<double>(), 1e-6,
                    "row " + std::to_string(r));
  }
  backward(sum(y));
  // d sum(x W^T + b) / dW: per output row, the sum of the input rows that used W.
  auto rows_sum = [&](std::vector<int64_t> rows) {
    std::vector<double> out(3 * 4, 0.0);
    const std::vector<double> xv = x.to_vector<double>();
    for (int64_t r : rows)
      for (int64_t o = 0; o < 3; ++o)
        for (int64_t i = 0; i < 4; ++i)
          out[size_t(o * 4 + i)] += xv[size_t(r * 4 + i)];
    return out;
  };
  expect_near_all(rig.spare->weight.grad(), rows_sum({0, 3}), 1e-6, "spare's gradient");
  expect_near_all(rig.spare->bias.grad(), {2, 2, 2}, 1e-6, "spare's bias gradient");
  expect_near_all(rig.lin->weight.grad(), rows_sum({1, 2}), 1e-6, "own gradient");
  // One set for every row: one run, the set's.
  rig.lin->set_parameter_stand_ins({{{"weight", &rig.spare->weight}, {"bias", &rig.spare->bias}}},
                                   [] {
                                     return Module::StandInChoice{-1, std::vector<int64_t>{0, 0}};
                                   });
  const Tensor two = kernels::narrow(x, 0, 0, 2);
  expect_equal((*rig.lin)(two), rig.with_spare(two), "all rows one set");
  // A row that runs alone never sees another set's values: an infinite bias in the spare leaves
  // the own rows finite (a 0/1 mask over both runs would have made them NaN).
  rig.lin->set_parameter_stand_ins({{{"weight", &rig.spare->weight}, {"bias", &rig.spare->bias}}},
                                   [] {
                                     return Module::StandInChoice{-1, std::vector<int64_t>{0, -1}};
                                   });
  {
    NoGradGuard no_grad;
    rig.spare->bias.fill_(std::numeric_limits<double>::infinity());
  }
  const std::vector<double> mixed = (*rig.lin)(two).to_vector<double>();
  for (size_t i = 0; i < 3; ++i)
    EXPECT_TRUE(std::isinf(mixed[i])) << i;
  for (size_t i = 3; i < 6; ++i)
    EXPECT_TRUE(std::isfinite(mixed[i])) << i;
}
