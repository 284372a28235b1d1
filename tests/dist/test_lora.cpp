// LoRA under every parallelism: initial values that do not depend on the mesh, forwards equal to
// the plain model, the collectives of the layer without adapters and no more, read/write of
// global tensors, mixed-adapter batches, merge/unmerge, and bad use.
#include <gtest/gtest.h>

#include <cmath>

#include "common/expect_close.h"
#include "common/expect_error.h"
#include "dist/checkpoint_models.h"
#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"

using namespace tessera;
using namespace tessera::testing;

TEST(Lora, InitialValuesDoNotDependOnTheMesh) {
  // Random init: B is drawn too, so both matrices carry values to compare.
  const LoraConfig cfg = lora_test_config(LoraInit::Random);
  auto plain = std::make_shared<Decoder>(lora_decoder_config());
  auto ref = apply_lora(plain, cfg)->read_adapter("default");
  ASSERT_EQ(ref.size(), 2u * 2u * 7u);  // 2 layers x 7 projections x (A, B)
  for (const LoraLayout& l : lora_layouts()) {
    LoraRun run = l.build(lora_decoder_config(), cfg);
    const auto got = run.lora->read_adapter("default");
    ASSERT_EQ(got.size(), ref.size()) << l.name;
    for (const auto& [key, t] : ref)
      expect_identical(got.at(key), t, l.name + " " + key);
  }
}

TEST(Lora, ForwardEqualsThePlainModelUnderEveryLayout) {
  const LoraConfig cfg = lora_test_config(LoraInit::Random);
  auto plain = std::make_shared<Decoder>(lora_decoder_config());
  apply_lora(plain, cfg);
  const Batch b = affine_batch(0, 4, 8, lora_decoder_config().vocab_size);
  const Tensor want = (*plain)(b.ids);
  for (const LoraLayout& l : lora_layouts()) {
    LoraRun run = l.build(lora_decoder_config(), cfg);
    const Tensor got = run.logits(b.ids);
    expect_close(got, want, 1e-5, l.name + " logits");
  }
}

namespace {

// Every rank that holds a window of `p` identical to another rank's holds the same bytes: what
// replicated adapter matrices must satisfy after training.
void expect_replicas_identical(const Parameter& p, const std::string& what) {
  if (!p.is_dtensor()) return;
  const LocalLayout l = p.stored_dtensor().spec().local_layout();
  const Tensor local = p.stored().contiguous();
  uint64_t h = 1469598103934665603ull;
  const auto* bytes = static_cast<const unsigned char*>(local.raw_data());
  for (size_t i = 0; i < local.nbytes(); ++i)
    h = (h ^ bytes[i]) * 1099511628211ull;
  std::vector<int64_t> mine = {int64_t(h & 0x7fffffffffffffffull)};
  for (int64_t d : l.global_offset)
    mine.push_back(d);
  for (int64_t d : l.local_shape)
    mine.push_back(d);
  const int64_t n = int64_t(mine.size());
  Tensor all = empty({world_size() * n}, DType::Int64);
  world_group()->all_gather_into_tensor(all, from_vector<int64_t>(mine, {n}))->wait();
  const std::vector<int64_t> v = all.to_vector<int64_t>();
  for (int a = 0; a < world_size(); ++a)
    for (int b = a + 1; b < world_size(); ++b) {
      const bool same_window =
          std::equal(v.begin() + a * n + 1, v.begin() + (a + 1) * n, v.begin() + b * n + 1);
      if (same_window) {
        EXPECT_EQ(v[size_t(a * n)], v[size_t(b * n)])
            << what << ": ranks " << a << " and " << b << " hold the same window but differ";
      }
    }
}

struct Trained {
  std::vector<double> losses;
  std::map<std::string, Tensor> adapter;
  std::map<std::string, Tensor> base;
};

Trained train(LoraRun& run, int steps) {
  // eps 1e-6: where a gradient is as small as Adam's eps (the first layer's key adapters see
  // gradients near 1e-8), eps 1e-8 turns its last-bit differences between layouts into 2e-6
  // differences of the update, which says nothing about the sharding.
  AdamW opt(run.lora->parameters(), AdamWOptions{.lr = 3e-3, .eps = 1e-6, .weight_decay = 0.0});
  Trained t;
  for (int s = 0; s < steps; ++s)
    t.losses.push_back(lora_train_step(run, opt, s));
  t.adapter = run.lora->read_adapter("default");
  for (auto& [name, p] : run.model->named_parameters())
    if (name.find("lora_") == std::string::npos) t.base[name] = p->full();
  return t;
}

const Trained& reference() {
  static const Trained r = [] {
    LoraRun run{"plain", std::make_shared<Decoder>(lora_decoder_config()), nullptr, 0, 1};
    run.lora = apply_lora(run.model, lora_test_config());
    return train(run, 20);
  }();
  return r;
}

}  // namespace

// LoRA fine-tuning of the decoder, 20 steps, under every layout: the losses and adapters of the
// single-rank run within 1e-6 relative, the frozen base untouched, every replicated adapter
// matrix bitwise identical on the ranks that hold it.
TEST(Lora, FineTuningMatchesSingleRank) {
  const Trained& ref = reference();
  const auto initial = std::make_shared<Decoder>(lora_decoder_config())->state_dict();
  for (const LoraLayout& l : lora_layouts()) {
    LoraRun run = l.build(lora_decoder_config(), lora_test_config());
    const Trained got = train(run, 20);
    double worst_loss = 0, worst_param = 0;
    for (size_t s = 0; s < ref.losses.size(); ++s) {
      EXPECT_NEAR(got.losses[s], ref.losses[s], 1e-6 * std::abs(ref.losses[s]))
          << l.name << " step " << s;
      worst_loss = std::max(worst_loss, std::abs(got.losses[s] - ref.losses[s]) / ref.losses[s]);
    }
    // Each adapter matrix within 1e-6 of the reference, relative to its norm.
    for (const auto& [key, t] : ref.adapter) {
      const auto a = got.adapter.at(key).to_vector<double>(), b = t.to_vector<double>();
      double diff = 0, norm = 0, worst_elem = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        diff += (a[i] - b[i]) * (a[i] - b[i]);
        norm += b[i] * b[i];
        worst_elem = std::max(worst_elem, std::abs(a[i] - b[i]));
      }
      const double rel = std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
      EXPECT_LE(rel, 1e-6) << l.name << " " << key << " (largest element difference " << worst_elem
                           << ")";
      worst_param = std::max(worst_param, rel);
    }
    for (const auto& [name, t] : got.base)
      expect_identical(t, initial.at(name), l.name + ": frozen " + name);
    for (Parameter* p : run.lora->parameters())
      expect_replicas_identical(*p, l.name + " " + p->str());
    if (world_rank() == 0)
      std::printf(
          "[lora parity] %s: worst relative loss %.2e, worst relative adapter matrix "
          "%.2e (tolerance 1e-6)\n",
          l.name.c_str(), worst_loss, worst_param);
  }
  // The reference itself moved: a run that trained nothing could not pass.
  EXPECT_LT(ref.losses.back(), ref.losses.front() * 0.9);
}
