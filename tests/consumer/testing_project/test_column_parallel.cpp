// Tests of ColumnParallelLinear with the testing kit, at every world size they are registered
// for. Built twice: COLUMN_PARALLEL_BUGGY selects the variant with the placement bug.
#include <gtest/gtest.h>
#include <tessera/tessera.h>
#include <tessera/testing.h>

#include "column_parallel.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

#ifdef COLUMN_PARALLEL_BUGGY
constexpr bool kInterleaved = true;
#else
constexpr bool kInterleaved = false;
#endif

constexpr int64_t kIn = 3, kBatch = 5;

int64_t out_features() {
  return 2 * world_size();  // even over the mesh: the layer asks for it
}

DeviceMesh mesh() {
  return DeviceMesh(Shape{world_size()}, {"tp"});
}

}  // namespace

// Index-valued weights: a wrong element names the global index it came from.
TEST(ColumnParallelLinear, ShardsAreWhereShard0SaysTheyAre) {
  const Tensor w = index_tensor({out_features(), kIn}, DType::Float32);
  const Tensor b = index_tensor({out_features()}, DType::Float32);
  ColumnParallelLinear layer(w, b, mesh(), kInterleaved);
  expect_local_matches(layer.weight, w);
  expect_local_matches(layer.bias, b);
}

TEST(ColumnParallelLinear, OutputMatchesTheUnshardedLayer) {
  const Tensor w = dyadic_tensor({out_features(), kIn}, 1, DType::Float32);
  const Tensor b = dyadic_tensor({out_features()}, 2, DType::Float32);
  const Tensor x = dyadic_tensor({kBatch, kIn}, 3, DType::Float32);
  ColumnParallelLinear layer(w, b, mesh(), kInterleaved);
  const DTensor y = layer.forward(x);
  expect_close_global(y, add(matmul(x, transpose(w, 0, 1)), b), 1e-6);
  expect_replicas_equal(y.redistribute({Replicate()}));
}

// Training with plain SGD on the sharded pieces matches training the plain layer on one rank.
TEST(ColumnParallelLinear, TrainingMatchesOneRank) {
  const MakeRun make = [](const DeviceMesh* m) {
    struct State {
      std::shared_ptr<Linear> plain;
      std::shared_ptr<ColumnParallelLinear> sharded;
    };
    auto st = std::make_shared<State>();
    Generator gen(5);
    auto init = std::make_shared<Linear>(kIn, out_features(), true, gen);
    if (m)
      st->sharded = std::make_shared<ColumnParallelLinear>(init->weight.full(), init->bias.full(),
                                                           *m, kInterleaved);
    else
      st->plain = init;
    TrainingRun run;
    run.step = [st](int step) {
      const Tensor x = dyadic_tensor({kBatch, kIn}, 10 + uint64_t(step), DType::Float32);
      const Tensor target =
          dyadic_tensor({kBatch, out_features()}, 20 + uint64_t(step), DType::Float32);
      Tensor y = st->plain ? (*st->plain)(x) : st->sharded->forward(x).full_tensor();
      Tensor loss = mean(square(sub(y, target)));
      backward(loss);
      NoGradGuard no_grad;
      std::vector<Tensor> params;
      if (st->plain) {
        params = {st->plain->weight.stored(), st->plain->bias.stored()};
      } else {
        params = {st->sharded->weight.to_local(), st->sharded->bias.to_local()};
      }
      for (Tensor& p : params) {
        p.copy_(sub(p, mul(p.grad(), 0.1)));
        p.set_grad(Tensor());
      }
      return double(loss.item<float>());
    };
    run.parameters = [st] {
      if (st->plain) return st->plain->state_dict();
      return std::map<std::string, Tensor>{{"weight", st->sharded->weight.full_tensor()},
                                           {"bias", st->sharded->bias.full_tensor()}};
    };
    return run;
  };
  const auto results = expect_parity(make, {mesh()}, ParityOptions{.steps = 4});
  if (world_rank() == 0)
    for (const auto& r : results)
      std::printf("[parity] %s\n", r.str().c_str());
}
