#pragma once
// The decoder under every parallelism a world size allows, for the state-dict and checkpoint
// tests: plain, tensor parallel, data parallel with TP on sub-meshes, FSDP, HSDP, FSDP x TP.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/affine_batch.h"
#include "common/small_decoder.h"
#include "tessera/tessera.h"

namespace tessera::testing {

constexpr int64_t kCkptBatch = kSmallBatch;
constexpr int64_t kCkptSeq = kSmallSeq;

inline DecoderConfig checkpoint_config(uint64_t seed = 7) {
  return small_decoder_config(seed);
}

// One way of running the decoder on this world: the model and which rows of the global batch
// this rank trains on.
struct Parallel {
  std::string name;
  std::shared_ptr<Decoder> model;
  int64_t dp_rank = 0, dp_size = 1;
  // Plain data parallelism averages the gradients itself; FSDP reduce-scatters them.
  ProcessGroupPtr average_grads_over;
};

struct Layout {
  std::string name;
  std::function<Parallel(uint64_t seed)> build;
};

inline void shard_blocks_and_root(const std::shared_ptr<Decoder>& net, const DeviceMesh& mesh) {
  for (auto& layer : net->layers)
    fully_shard(layer, mesh);
  fully_shard(net, mesh);
}

// Every layout of the decoder at this world size (its name says the world size).
inline std::vector<Layout> decoder_layouts() {
  const int64_t n = world_size();
  std::vector<Layout> out;
  auto make = [](const std::string& name, std::function<Parallel(uint64_t)> f) {
    return Layout{name, std::move(f)};
  };
  if (n == 1) {
    out.push_back(make("plain1", [](uint64_t seed) {
      return Parallel{"plain1", std::make_shared<Decoder>(checkpoint_config(seed)), 0, 1, nullptr};
    }));
    return out;
  }
  const std::string sn = std::to_string(n);
  out.push_back(make("fsdp" + sn, [n, sn](uint64_t seed) {
    auto net = std::make_shared<Decoder>(checkpoint_config(seed));
    DeviceMesh mesh(Shape{n}, {"dp"});
    shard_blocks_and_root(net, mesh);
    return Parallel{"fsdp" + sn, net, mesh.local_rank(0), n, nullptr};
  }));
  if (n == 2) {
    out.push_back(make("tp2", [](uint64_t seed) {
      const DecoderConfig cfg = checkpoint_config(seed);
      auto net = std::make_shared<Decoder>(cfg);
      DeviceMesh mesh(Shape{2}, {"tp"});
      parallelize_module(net, mesh, decoder_tp_plan(cfg, mesh));
      return Parallel{"tp2", net, 0, 1, nullptr};
    }));
  }
  if (n == 4 || n == 8) {
    const int64_t dp = n / 2;
    const std::string tag = std::to_string(dp) + "x2";
    out.push_back(make("fsdp_tp_" + tag, [dp, tag](uint64_t seed) {
      const DecoderConfig cfg = checkpoint_config(seed);
      auto net = std::make_shared<Decoder>(cfg);
      DeviceMesh mesh(Shape{dp, 2}, {"dp", "tp"});
      parallelize_module(net, mesh["tp"], decoder_tp_plan(cfg, mesh["tp"]));
      shard_blocks_and_root(net, mesh["dp"]);
      return Parallel{"fsdp_tp_" + tag, net, mesh.local_rank(0), dp, nullptr};
    }));
    const std::string htag = "2x" + std::to_string(n / 2);
    out.push_back(make("hsdp_" + htag, [n, htag](uint64_t seed) {
      auto net = std::make_shared<Decoder>(checkpoint_config(seed));
      DeviceMesh mesh(Shape{2, n / 2}, {"replicate", "shard"});
      shard_blocks_and_root(net, mesh);
      return Parallel{"hsdp_" + htag, net, world_rank(), n, nullptr};
    }));
  }
  if (n == 4) {
    // Plain data parallelism over tensor-parallel replicas: each replica's DTensors live on its
    // own TP sub-mesh, so the checkpoint sees two copies of every block.
    out.push_back(make("dp_tp_2x2", [](uint64_t seed) {
      const DecoderConfig cfg = checkpoint_config(seed);
      auto net = std::make_shared<Decoder>(cfg);
      DeviceMesh mesh(Shape{2, 2}, {"dp", "tp"});
      parallelize_module(net, mesh["tp"], decoder_tp_plan(cfg, mesh["tp"]));
      return Parallel{"dp_tp_2x2", net, mesh.local_rank(0), 2, mesh.group("dp")};
    }));
  }
  return out;
}

// One AdamW step on this rank's rows of global batch `step`; returns the loss averaged over the
// world (every rank of a data-parallel replica holds the same loss).
inline double train_step(Parallel& p, Optimizer& opt, int step) {
  Batch b = affine_batch(step, kCkptBatch, kCkptSeq, checkpoint_config().vocab_size);
  const int64_t rows = kCkptBatch / p.dp_size;
  Tensor ids = kernels::narrow(b.ids, 0, p.dp_rank * rows, rows).contiguous();
  Tensor targets = kernels::narrow(b.targets, 0, p.dp_rank * rows, rows).contiguous();
  opt.zero_grad();
  Tensor loss = cross_entropy((*p.model)(ids), targets);
  backward(loss);
  if (p.average_grads_over)
    for (Parameter* q : p.model->parameters()) {
      Tensor g = q->grad();
      if (g.defined()) p.average_grads_over->all_reduce(g, ReduceOp::Avg)->wait();
    }
  opt.step();
  Tensor l = from_vector<double>({double(loss.item<float>())});
  world_group()->all_reduce(l, ReduceOp::Sum)->wait();
  return l.item<double>() / double(world_size());
}

inline AdamWOptions checkpoint_adamw() {
  return AdamWOptions{.lr = 3e-3};
}

}  // namespace tessera::testing
