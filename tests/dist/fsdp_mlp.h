#pragma once
// A small MLP of two residual blocks and a head, built of Linear layers in custom modules, and its
// training loop (AdamW, this rank's rows of each batch): the FSDP state and precision tests'.
#include <functional>
#include <memory>
#include <vector>

#include "dist/fsdp_parity.h"

namespace tessera::fsdp_test {

class MlpBlock : public Module {
 public:
  explicit MlpBlock(Generator& gen) : Module("MlpBlock") {
    fc1 = std::make_shared<Linear>(16, 24, true, gen);
    fc2 = std::make_shared<Linear>(24, 16, true, gen);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  Tensor forward(const Tensor& x) override { return add(x, (*fc2)(silu((*fc1)(x)))); }
  std::shared_ptr<Linear> fc1, fc2;
};

class Mlp : public Module {
 public:
  Mlp() : Module("Mlp") {
    Generator gen(11);
    b0 = std::make_shared<MlpBlock>(gen);
    b1 = std::make_shared<MlpBlock>(gen);
    head = std::make_shared<Linear>(16, 5, true, gen);
    register_module("b0", b0);
    register_module("b1", b1);
    register_module("head", head);
  }
  Tensor forward(const Tensor& x) override { return (*head)((*b1)((*b0)(x))); }
  std::shared_ptr<MlpBlock> b0, b1;
  std::shared_ptr<Linear> head;
};

inline std::vector<double> train_mlp(const std::shared_ptr<Mlp>& net, int steps, int64_t dp_rank,
                                     int64_t dp_size,
                                     const std::function<void(Mlp&)>& check_step = {}) {
  AdamW opt(net->parameters(), AdamWOptions{.lr = 1e-2});
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Generator gen(uint64_t(100 + s));
    Tensor x = randn({kBatch, 16}, gen), t = randn({kBatch, 5}, gen);
    const int64_t n = kBatch / dp_size;
    x = kernels::narrow(x, 0, dp_rank * n, n).contiguous();
    t = kernels::narrow(t, 0, dp_rank * n, n).contiguous();
    opt.zero_grad();
    Tensor y = (*net)(x);
    EXPECT_EQ(y.dtype(), DType::Float32);
    Tensor loss = mean(square(sub(y, t)));
    backward(loss);
    if (check_step) check_step(*net);
    opt.step();
    losses.push_back(world_mean(loss.item<float>()));
  }
  return losses;
}

}  // namespace tessera::fsdp_test
