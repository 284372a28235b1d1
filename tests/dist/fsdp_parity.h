#pragma once
// What the fully_shard tests share (test_fsdp.cpp, test_fsdp_state.cpp): the batches, the
// sharding of the parity decoder, its training loop and the single-process reference run.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/affine_batch.h"
#include "common/small_decoder.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/tessera.h"
#include "tessera/testing.h"

namespace tessera::fsdp_test {

using tessera::testing::affine_batch;
using tessera::testing::Batch;
using tessera::testing::compare_trajectories;
using tessera::testing::kSmallBatch;
using tessera::testing::kSmallSeq;
using tessera::testing::ParityOptions;
using tessera::testing::ParityResult;
using tessera::testing::small_decoder_config;
using tessera::testing::Trajectory;
using tessera::testing::world_mean;

inline constexpr int64_t kBatch = kSmallBatch;
inline constexpr int64_t kSeq = kSmallSeq;

inline Batch make_batch(int step, int64_t rows = kBatch) {
  return affine_batch(step, rows, kSeq, small_decoder_config().vocab_size);
}

inline Batch rows_of(const Batch& b, int64_t dp_rank, int64_t dp_size) {
  const int64_t n = b.ids.size(0) / dp_size;
  return {kernels::narrow(b.ids, 0, dp_rank * n, n).contiguous(),
          kernels::narrow(b.targets, 0, dp_rank * n, n).contiguous()};
}

// How a test shards the model; returns the groups, root last.
using Apply = std::function<std::vector<std::shared_ptr<FSDPState>>(std::shared_ptr<Decoder>)>;

inline std::vector<std::shared_ptr<FSDPState>> shard_blocks_and_root(
    const std::shared_ptr<Decoder>& net, const DeviceMesh& mesh, FSDPOptions opts = {}) {
  std::vector<std::shared_ptr<FSDPState>> states;
  for (auto& layer : net->layers)
    states.push_back(fully_shard(layer, mesh, opts));
  states.push_back(fully_shard(net, mesh, opts));
  return states;
}

// The losses of every step (mean over the ranks) and the parameters after the last.
inline Trajectory train(const std::shared_ptr<Decoder>& net, int steps, int64_t dp_rank,
                        int64_t dp_size, const std::function<void(Decoder&)>& check_step = {}) {
  AdamW opt(net->parameters(), AdamWOptions{.lr = 3e-3});
  Trajectory run;
  for (int s = 0; s < steps; ++s) {
    Batch b = rows_of(make_batch(s), dp_rank, dp_size);
    opt.zero_grad();
    Tensor loss = cross_entropy((*net)(b.ids), b.targets);
    backward(loss);
    if (check_step) check_step(*net);
    opt.step();
    run.losses.push_back(world_mean(loss.item<float>()));
  }
  run.parameters[steps - 1] = net->state_dict();
  return run;
}

inline const std::map<std::string, Tensor>& final_state(const Trajectory& t) {
  return t.parameters.rbegin()->second;
}

// Losses within tol relative, parameters within tol * (1 + |want|). Prints the margins on rank 0
// so that a run shows how much room the tolerance leaves.
inline void expect_same_run(const Trajectory& got, const Trajectory& want, double tol,
                            const std::string& label = {}) {
  const ParityOptions opts{
      .steps = int(want.losses.size()), .loss = {tol, 0}, .parameters = {tol, tol}};
  const ParityResult r = compare_trajectories(got, want, opts);
  EXPECT_FALSE(r.divergence) << label << ": " << r.str();
  if (!label.empty() && world_rank() == 0)
    std::printf("[parity] %s, %zu steps: %s (tolerance %.0e)\n", label.c_str(), got.losses.size(),
                r.str().c_str(), tol);
}

// The parity tests' decoder, optionally with the output projection tied to the embedding.
inline DecoderConfig decoder_config(bool tied = false) {
  DecoderConfig cfg = small_decoder_config();
  cfg.tie_embeddings = tied;
  return cfg;
}

inline std::string tied_label(bool tied) {
  return tied ? ", tied embeddings" : "";
}

// Plain Decoder, whole batch, no DTensor: shares nothing with the sharded runs but the seed.
inline const Trajectory& reference_run(bool tied = false) {
  static const Trajectory untied =
      train(std::make_shared<Decoder>(decoder_config(false)), 30, 0, 1);
  static const Trajectory with_tied =
      train(std::make_shared<Decoder>(decoder_config(true)), 30, 0, 1);
  return tied ? with_tied : untied;
}

inline DeviceMesh dp_mesh() {
  return DeviceMesh(Shape{world_size()}, {"dp"});
}

}  // namespace tessera::fsdp_test
