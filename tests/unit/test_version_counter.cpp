// Version counters: an in-place write to a tensor that backward still needs is an error at
// backward (PyTorch's "modified by an inplace operation"), never a silently wrong gradient.
#include <gtest/gtest.h>

#include "tessera/tessera.h"
#include "tessera/testing.h"

using namespace tessera;
using tessera::testing::error_of;
using tessera::testing::expect_error;

namespace {

Tensor leaf(std::vector<float> v, Shape s) {
  Tensor t = from_vector<float>(v, s);
  t.set_requires_grad(true);
  return t;
}

TEST(VersionCounter, EveryInPlaceWriteCountsAndViewsShareTheCount) {
  Tensor t = zeros({2, 3});
  EXPECT_EQ(t.version(), 0u);
  t.fill_(1.0);
  EXPECT_EQ(t.version(), 1u);
  Tensor row = select(t, 0, 1);  // a view: one storage, one counter
  row.copy_(ones({3}));
  EXPECT_EQ(t.version(), 2u);
  EXPECT_EQ(row.version(), 2u);
  kernels::add_(t, ones({2, 3}));
  kernels::mul_scalar_(t, 2.0);
  t.zero_();
  EXPECT_EQ(t.version(), 5u);
  Tensor d = t.detach();  // detach shares storage, so it shares the count, as in PyTorch
  d.fill_(3.0);
  EXPECT_EQ(t.version(), 6u);
  // Out-of-place results and clones are new storage with their own count (what a fresh tensor
  // starts at is not PyTorch's number: only changes are compared).
  Tensor c = t.clone(), s = add(t, t);
  const uint32_t cv = c.version(), sv = s.version();
  t.fill_(4.0);
  EXPECT_EQ(c.version(), cv);
  EXPECT_EQ(s.version(), sv);
  EXPECT_EQ(t.version(), 7u);
}

// A write of no elements counts too (PyTorch's rule): an empty view of a buffer, such as a rank's
// empty shard of a parameter under FSDP, moves the buffer's count like its neighbours' writes.
TEST(VersionCounter, WritesOfNoElementsCount) {
  Tensor buffer = zeros({4});
  Tensor none = kernels::narrow(buffer, 0, 4, 0);
  const auto v0 = buffer.version();
  none.fill_(1.0);
  EXPECT_EQ(buffer.version(), v0 + 1);
  none.copy_(zeros({0}));
  EXPECT_EQ(buffer.version(), v0 + 2);
  Generator gen(1);
  uniform_(none, 0, 1, gen);  // the random fills too (an empty FSDP shard initialised)
  EXPECT_EQ(buffer.version(), v0 + 3);
}

TEST(VersionCounter, ACallRefusedByItsChecksCountsNoWrite) {
  Tensor t = zeros({2, 3});
  const uint32_t v = t.version();
  expect_error([&] { kernels::add_(t, ones({4})); }, "add_");
  EXPECT_EQ(t.version(), v);
}

TEST(VersionCounter, WritingASavedInputBeforeBackwardIsAnError) {
  Tensor a = leaf({1, 2, 3, 4}, {2, 2});
  Tensor b = leaf({1, 0, 0, 1}, {2, 2});
  Tensor loss = sum(matmul(a, b));  // matmul saves a and b
  {
    NoGradGuard no_grad;
    b.copy_(from_vector<float>({5, 5, 5, 5}, {2, 2}));  // what an optimizer step does
  }
  expect_error([&] { backward(loss); },
               {"modified by an in-place operation", "Tensor[2, 2] float32",
                "is at version 1; expected version 0"});
}

TEST(VersionCounter, WritingAViewOfASavedTensorIsAnError) {
  Tensor a = leaf({1, 2, 3, 4}, {2, 2});
  Tensor h = mul(a, 2.0);
  Tensor y = sum(exp(h));  // exp saves its output; mul's output h is saved by nothing
  Tensor e = exp(h);
  Tensor loss = sum(mul(e, e));  // saves e twice
  select(e.detach(), 0, 0).fill_(0.0);
  expect_error([&] { backward(loss); }, "modified by an in-place operation");
  // The graph that read h only through exp is unaffected by the write to e.
  backward(y);
  EXPECT_TRUE(a.grad().defined());
}

TEST(VersionCounter, WritesBeforeSavingOrToUnsavedTensorsAreFine) {
  Tensor a = leaf({1, 2, 3, 4}, {2, 2});
  Tensor b = ones({2, 2});
  b.fill_(2.0);          // before the graph saves it: the saved version is 1
  Tensor h = add(a, b);  // add saves nothing
  Tensor loss = sum(mul(h, b));
  Tensor unrelated = zeros({2, 2});
  unrelated.fill_(7.0);
  EXPECT_EQ(error_of([&] { backward(loss); }), "");
  // d(loss)/da = b = 2 everywhere
  EXPECT_EQ(a.grad().to_vector<float>(), std::vector<float>({2, 2, 2, 2}));
}

TEST(VersionCounter, AnOptimizerStepBetweenForwardAndBackwardIsAnError) {
  Generator gen(7);
  auto lin = std::make_shared<Linear>(3, 2, /*bias=*/true, gen);
  SGD opt(lin->parameters(), SGDOptions{.lr = 0.1});
  Tensor x = leaf({1, 2, 3}, {1, 3});  // its gradient needs the weight
  Tensor loss = sum(lin->forward(x));
  backward(loss, Tensor(), /*retain_graph=*/true);
  opt.step();  // updates the weight that linear saved for its input gradient
  expect_error([&] { backward(loss); }, {"modified by an in-place operation", "expected version"});
}

}  // namespace
