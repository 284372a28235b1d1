#pragma once
// Shared by the tensor parallelism tests: a tiny decoder and its batches, tensor-parallel meshes,
// the plan variants (plain, sequence, loss parallel), training runs and the unparallelized
// reference run, and comparisons of states and trajectories.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "common/affine_batch.h"
#include "tessera/tessera.h"
#include "tessera/testing.h"

namespace tessera::tensor_parallel_test {

using tessera::testing::affine_batch;
using tessera::testing::Batch;

inline constexpr int64_t kBatch = 4;
inline constexpr int64_t kSeq = 16;
inline constexpr int kSteps = 30;

inline DecoderConfig tiny_config(bool tied = false) {
  DecoderConfig c;
  c.vocab_size = 48;
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 8;
  c.n_kv_heads = 4;  // grouped-query: two query heads per kv head, at every TP degree up to 4
  c.ffn_dim = 64;
  c.max_seq_len = kSeq;
  c.tie_embeddings = tied;
  c.seed = 20240611;
  return c;
}

// A tensor-parallel mesh of `tp` ranks; the remaining factor of the world runs copies of it.
inline DeviceMesh tp_mesh(int64_t tp) {
  const int64_t n = world_size();
  return DeviceMesh(Shape{n / tp, tp}, {"dp", "tp"})["tp"];
}

inline Batch make_batch(int step, int64_t vocab, int64_t seq = kSeq) {
  return affine_batch(step, kBatch, seq, vocab);
}

struct Variant {
  const char* name;
  DecoderTPOptions opts;
};

inline const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {{"plain", {false, false}},
                                         {"sequence_parallel", {true, false}},
                                         {"loss_parallel", {false, true}},
                                         {"sequence_and_loss_parallel", {true, true}}};
  return v;
}

// A decoder, parallelized when a mesh is given (nullptr: the unparallelized reference).
struct Model {
  std::shared_ptr<Decoder> net;
  const DeviceMesh* mesh = nullptr;
  bool loss_parallel = false;
};

inline Model build(const DecoderConfig& cfg, const DeviceMesh* mesh, DecoderTPOptions opts = {}) {
  Model m{std::make_shared<Decoder>(cfg), mesh, mesh != nullptr && opts.loss_parallel};
  if (mesh) parallelize_module(m.net, *mesh, decoder_tp_plan(cfg, *mesh, opts));
  return m;
}

inline Tensor loss_of(Model& m, const Batch& b) {
  Tensor logits = (*m.net)(b.ids);
  if (!m.loss_parallel) return cross_entropy(logits, b.targets);
  // The global shape is passed: with an uneven vocabulary the ranks' pieces differ.
  const Shape global = {b.ids.size(0), b.ids.size(1), m.net->config().vocab_size};
  return vocab_parallel_cross_entropy(DTensor::from_local(logits, *m.mesh, {Shard(-1)}, global),
                                      b.targets)
      .to_local();
}

using tessera::testing::Trajectory;

// The losses of every step and the parameters after the last, as the testing kit compares them.
inline Trajectory train(Model m, int steps, int64_t seq = kSeq) {
  AdamW opt(m.net->parameters(), AdamWOptions{.lr = 3e-3});
  Trajectory r;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    Tensor loss = loss_of(m, make_batch(s, m.net->config().vocab_size, seq));
    backward(loss);
    opt.step();
    r.losses.push_back(loss.item<float>());
  }
  r.parameters[steps - 1] = m.net->state_dict();
  return r;
}

inline const std::map<std::string, Tensor>& final_state(const Trajectory& t) {
  return t.parameters.rbegin()->second;
}

// The reference run is the same for every variant and test: compute it once per config.
inline const Trajectory& reference_run(bool tied) {
  static std::map<bool, Trajectory> cache;
  auto it = cache.find(tied);
  if (it == cache.end())
    it = cache.emplace(tied, train(build(tiny_config(tied), nullptr), kSteps)).first;
  return it->second;
}

// |got - want| <= tol * max(1, |want|) elementwise, or with `relative_to_max`,
// |got - want| <= tol * max|want|: the gradients of a mean loss are far below 1, and would pass
// any absolute test.
inline void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what,
                         bool relative_to_max = false) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  auto g = got.to_vector<double>(), w = want.to_vector<double>();
  double scale = 0;
  for (double v : w)
    scale = std::max(scale, std::abs(v));
  if (relative_to_max) {
    ASSERT_GT(scale, 0) << what << ": the reference is all zeros";
  }
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    double err = std::abs(g[i] - w[i]) / (relative_to_max ? scale : std::max(1.0, std::abs(w[i])));
    if (!(err <= worst)) {
      worst = err;
      at = i;
    }
  }
  EXPECT_LE(worst, tol) << what << ": element " << at << " is " << g[at] << ", expected " << w[at];
}

// Exact with tol 0, else |got - want| <= tol * (1 + |want|) per element.
inline void expect_same_state(const std::map<std::string, Tensor>& got,
                              const std::map<std::string, Tensor>& want, double tol,
                              const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, t] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << what << ": missing " << name;
    tessera::testing::expect_close(it->second, t, tessera::testing::Tolerance{tol, tol},
                                   what + ": " + name);
  }
}

// Losses within 1e-5 relative at every step, final parameters within 1e-5 (1 + |want|).
inline void expect_same_training(const Trajectory& run, const Trajectory& ref,
                                 const std::string& what) {
  const tessera::testing::ParityOptions opts{
      .steps = int(ref.losses.size()), .loss = {1e-5, 0}, .parameters = {1e-5, 1e-5}};
  const tessera::testing::ParityResult r = tessera::testing::compare_trajectories(run, ref, opts);
  EXPECT_FALSE(r.divergence) << what << ": " << r.str();
}

// This rank's chunk of `full` along `dim` (torch.chunk over the mesh).
inline Tensor chunk_of(const Tensor& full, int64_t dim, const DeviceMesh& mesh) {
  return distribute_tensor(full, mesh, {Shard(dim)}).to_local().clone();
}

}  // namespace tessera::tensor_parallel_test
