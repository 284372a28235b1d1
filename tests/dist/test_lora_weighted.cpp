// PEFT's add_weighted_adapter on every layout: the combined adapter's values against the
// formulas ("cat", "linear", "ties", "magnitude_prune") and the properties of a truncated SVD
// ("svd" and the "_svd" forms), the same on every mesh as on one process, frozen; and what it
// refuses. Part of the test_lora binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

const LoraSlots kSlots{.max_adapters = 8, .max_rank = 8};

// "default" (r 4, alpha 8, every projection and the table), "b" (r 2, alpha 6, wq, wv and the
// table) and "c" (r 4, alpha 2, as "default"): random B, so that every update is non-zero.
LoraConfig config_of(const std::string& name) {
  LoraConfig c = lora_test_config(LoraInit::Random);
  c.target_modules.push_back("tok_embeddings");
  if (name == "b") {
    c.r = 2;
    c.lora_alpha = 6;
    c.seed = 5;
    c.target_modules = {"wq", "wv", "tok_embeddings"};
  } else if (name == "c") {
    c.lora_alpha = 2;
    c.seed = 7;
  }
  return c;
}

void add_sources(LoraModel& lora) {
  lora.add_adapter("b", config_of("b"));
  lora.add_adapter("c", config_of("c"));
}

// "svd", "ties" and "dare_ties" of "default" and "c", one weight negative.
void add_more(LoraModel& lora) {
  lora.add_weighted_adapter({"default", "c"}, {0.5, -2.0}, "svd", "svd");
  lora.add_weighted_adapter({"default", "c"}, {0.5, -2.0}, "ties", "ties", {.density = 0.5});
  lora.add_weighted_adapter({"default", "c"}, {0.5, -2.0}, "dare", "dare_ties",
                            {.density = 0.6, .seed = 4});
}

// scale B A of `adapter` in `layer`, from read_adapter's values (zero where it has none).
Tensor update(LoraModel& lora, const std::map<std::string, Tensor>& v, const std::string& adapter,
              const std::string& path, const LoraLayer& layer) {
  const auto a = v.find(path + "." + layer.adapter_key(true));
  if (a == v.end()) return zeros({layer.lora_out(), layer.lora_in()});
  const double s = layer.slot(lora.adapter_id(adapter)).scale;
  return mul(matmul(v.at(path + "." + layer.adapter_key(false)), a->second), s);
}

std::vector<double> host(const Tensor& t) {
  return t.to(DType::Float64).to_vector<double>();
}

// read_adapter's values, copied: in one process they may share the parameters' storage, which
// deleting the adapter zeroes.
std::map<std::string, Tensor> copy_of(const std::map<std::string, Tensor>& values) {
  std::map<std::string, Tensor> out;
  for (const auto& [key, t] : values)
    out[key] = t.clone();
  return out;
}

Tensor tensor_of(const std::vector<double>& v, const Shape& shape) {
  return from_vector<double>(v, shape).to(DType::Float32);
}

// PEFT's merge_utils written out plainly for the checks: each tensor keeps its int(density n)
// largest magnitudes (or, with `dare`, the values whose draws from it fall below density,
// rescaled); ties elects per element the sign of the pruned values' sum (or of their
// signs' sum) and averages the weighted values of that sign; without ties, the weighted sum.
std::vector<double> merged_ref(std::vector<std::vector<double>> tasks, const std::vector<double>& w,
                               double density, bool ties, bool frequency = false,
                               Generator* dare = nullptr) {
  for (auto& t : tasks) {
    if (density >= 1) break;
    if (dare) {  // each value kept where its uniform draw is below density, then rescaled
      const std::vector<double> u =
          rand({int64_t(t.size())}, *dare, DType::Float64).to_vector<double>();
      for (size_t e = 0; e < t.size(); ++e)
        t[e] = u[e] < density ? t[e] / density : 0.0;
      continue;
    }
    std::vector<double> mags;
    for (double v : t)
      mags.push_back(std::abs(v));
    std::sort(mags.rbegin(), mags.rend());
    const size_t keep = size_t(density * double(t.size()));
    const double cut = keep == 0 ? INFINITY : mags[keep - 1];
    for (double& v : t)
      if (std::abs(v) < cut) v = 0;
  }
  std::vector<double> out(tasks.front().size(), 0.0);
  for (size_t e = 0; e < out.size(); ++e) {
    double votes = 0, sum = 0, n = 0;
    for (const auto& t : tasks)
      votes += frequency ? double((t[e] > 0) - (t[e] < 0)) : t[e];
    for (size_t i = 0; i < tasks.size(); ++i) {
      const double v = tasks[i][e];
      if (!ties || (votes >= 0 ? v > 0 : v < 0)) {
        sum += w[i] * v;
        n += 1;
      }
    }
    out[e] = ties ? sum / std::max(n, 1.0) : sum;
  }
  return out;
}

Tensor identity(int64_t n) {
  std::vector<double> v(size_t(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i)
    v[size_t(i * n + i)] = 1;
  return tensor_of(v, {n, n});
}

// `t` with every value clamped to [-h, h].
Tensor clamped(const Tensor& t, double h) {
  std::vector<double> v = host(t);
  for (double& x : v)
    x = std::min(std::max(x, -h), h);
  return tensor_of(v, t.shape());
}

}  // namespace

TEST(LoraWeighted, CombinationsAreTheSameOnEveryLayout) {
  const DecoderConfig cfg = lora_decoder_config();
  const Batch batch = affine_batch(2, 4, cfg.max_seq_len, cfg.vocab_size);
  // One process: the reference values and logits, and the formulas.
  auto ref = std::make_shared<Decoder>(cfg);
  auto rl = apply_lora(ref, config_of("default"), "default", kSlots);
  add_sources(*rl);
  rl->add_weighted_adapter({"default", "b"}, {0.7, -1.5}, "cat", "cat");
  rl->add_weighted_adapter({"default", "c"}, {0.5, 2.0}, "lin", "linear");
  add_more(*rl);
  std::map<std::string, std::map<std::string, Tensor>> v;
  for (const std::string name : {"default", "b", "c", "cat", "lin", "svd", "ties", "dare"})
    v[name] = rl->read_adapter(name);
  for (const auto& [path, layer] : rl->layers()) {
    SCOPED_TRACE(path);
    // "cat" (scale 1): exactly 0.7 of default's update and -1.5 of b's.
    EXPECT_EQ(layer->slot(rl->adapter_id("cat")).scale, 1.0);
    const Tensor want = add(mul(update(*rl, v["default"], "default", path, *layer), 0.7),
                            mul(update(*rl, v["b"], "b", path, *layer), -1.5));
    expect_close(update(*rl, v["cat"], "cat", path, *layer), want, 1e-6, "cat's update");
    // "linear": A and B each the sum of sqrt(w s) times the adapters' (PEFT's).
    for (const bool is_a : {true, false}) {
      const std::string key = path + "." + layer->adapter_key(is_a);
      const double fa = std::sqrt(0.5 * layer->slot(rl->adapter_id("default")).scale);
      const double fc = std::sqrt(2.0 * layer->slot(rl->adapter_id("c")).scale);
      expect_close(v["lin"].at(key), add(mul(v["default"].at(key), fa), mul(v["c"].at(key), fc)),
                   1e-6, key);
    }
  }
  for (Parameter* p : rl->adapter_parameters("cat"))
    EXPECT_FALSE(p->requires_grad()) << "the combined adapter is frozen, as PEFT's";
  EXPECT_EQ(rl->config("cat").r, 6);
  EXPECT_EQ(rl->config("lin").r, 4);
  std::map<std::string, Tensor> ref_logits;
  {
    NoGradGuard no_grad;
    for (const std::string name : {"cat", "lin", "svd", "ties", "dare"}) {
      rl->set_adapter(name);
      ref_logits[name] = (*ref)(batch.ids);
    }
  }
  // Every layout: the same values (each rank's window of them) and logits.
  for (const LoraLayout& l : lora_layouts(kSlots)) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(cfg, config_of("default"));
    add_sources(*run.lora);
    run.lora->add_weighted_adapter({"default", "b"}, {0.7, -1.5}, "cat", "cat");
    run.lora->add_weighted_adapter({"default", "c"}, {0.5, 2.0}, "lin", "linear");
    add_more(*run.lora);
    for (const std::string name : {"cat", "lin", "svd", "ties", "dare"}) {
      const std::map<std::string, Tensor> got = run.lora->read_adapter(name);
      if (name != "svd")
        for (const auto& [key, t] : got)
          expect_close(t, v[name].at(key), 1e-6, name + " " + key);
      else  // factors of an SVD are unique up to signs: their products
        for (const auto& [path, layer] : run.lora->layers())
          expect_close(update(*run.lora, got, name, path, *layer),
                       update(*rl, v[name], name, path, *layer), 1e-5, "svd " + path);
      NoGradGuard no_grad;
      run.lora->set_adapter(name);
      expect_close(run.logits(batch.ids), ref_logits[name], 1e-5, name + "'s logits");
    }
  }
}

// A single adapter is "linear" whatever the type asked (as in PEFT): its update scaled by the
// weight.
TEST(LoraWeighted, OneAdapterIsScaled) {
  auto model = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(model, config_of("default"), "default", kSlots);
  lora->add_weighted_adapter({"default"}, {2.0}, "twice", "cat");
  const auto v = lora->read_adapter("default"), w = lora->read_adapter("twice");
  for (const auto& [path, layer] : lora->layers())
    expect_close(update(*lora, w, "twice", path, *layer),
                 mul(update(*lora, v, "default", path, *layer), 2.0), 1e-6, path);
}

// PEFT's factor merges with a negative weight: A_i weighted by sign(w_i s_i) sqrt(|w_i s_i|),
// B_i by sqrt(|w_i s_i|), then summed ("linear"), averaged where the pruned signs agree
// ("ties", by sum or by frequency) or pruned and summed ("magnitude_prune"); the dare types
// prune at random, from draws that depend on the seed, the new adapter's name and the layer.
TEST(LoraWeighted, FactorMergesTakeNegativeWeights) {
  if (world_size() > 1) GTEST_SKIP() << "one process: the layouts are the first test's";
  auto model = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(model, config_of("default"), "default", kSlots);
  lora->add_adapter("c", config_of("c"));
  lora->add_weighted_adapter({"default"}, {-2.0}, "minus", "cat");
  lora->add_weighted_adapter({"default", "c"}, {0.5, -2.0}, "lin", "linear");
  struct Merge {
    std::string name, type;
    WeightedAdapterOptions options;
    bool ties, dare = false;
  };
  const std::vector<Merge> merges = {
      {"ties", "ties", {.density = 0.5}, true},
      {"tiesf", "ties", {.density = 0.7, .majority_sign_method = "frequency"}, true},
      {"prune", "magnitude_prune", {.density = 0.3}, false},
      {"darel", "dare_linear", {.density = 0.5, .seed = 3}, false, true},
      {"daret", "dare_ties", {.density = 0.6, .majority_sign_method = "frequency"}, true, true}};
  std::map<std::string, std::map<std::string, Tensor>> v;
  for (const std::string name : {"default", "c", "minus", "lin"})
    v[name] = lora->read_adapter(name);
  for (const Merge& m : merges) {
    // At most 5 slots: each merge in the slot of the one before.
    lora->add_weighted_adapter({"default", "c"}, {0.5, -2.0}, m.name, m.type, m.options);
    v[m.name] = copy_of(lora->read_adapter(m.name));
    lora->delete_adapter(m.name);
  }
  for (const auto& [path, layer] : lora->layers()) {
    SCOPED_TRACE(path);
    expect_close(update(*lora, v["minus"], "minus", path, *layer),
                 mul(update(*lora, v["default"], "default", path, *layer), -2.0), 1e-6, "-2 x");
    // The dare types' draws: per layer from (seed, name, path), A's tasks then B's.
    std::map<std::string, Generator> draws;
    for (const Merge& m : merges)
      draws.emplace(m.name, Generator(lora_slot_seed(m.options.seed, m.name, path)));
    const double sd = 0.5 * layer->slot(lora->adapter_id("default")).scale;
    const double sc = -2.0 * layer->slot(lora->adapter_id("c")).scale;
    for (const bool is_a : {true, false}) {
      const std::string key = path + "." + layer->adapter_key(is_a);
      const std::vector<double> w = {std::sqrt(sd), (is_a ? -1 : 1) * std::sqrt(-sc)};
      const std::vector<std::vector<double>> tasks = {host(v["default"].at(key)),
                                                      host(v["c"].at(key))};
      const Shape shape = v["default"].at(key).shape();
      expect_close(v["lin"].at(key), tensor_of(merged_ref(tasks, w, 1.0, false), shape), 1e-6,
                   "linear " + key);
      for (const Merge& m : merges)
        expect_close(v[m.name].at(key),
                     tensor_of(merged_ref(tasks, w, *m.options.density, m.ties,
                                          m.options.majority_sign_method == "frequency",
                                          m.dare ? &draws.at(m.name) : nullptr),
                               shape),
                     1e-6, m.name + " " + key);
    }
  }
}

// "svd": the merged update sum_i w_i s_i B_i A_i factored by its SVD. At rank 8 (two rank-4
// updates) it is exact, with A's rows orthonormal and B's columns orthogonal, largest first: an
// SVD. At the default rank (4) it is that SVD cut to its first 4 values (the best rank-4
// approximation); svd_clamp clamps both factors to a quantile of their values; "ties_svd"
// projects the TIES-merged update onto A's rows.
TEST(LoraWeighted, SvdFactorsTheMergedUpdate) {
  if (world_size() > 1) GTEST_SKIP() << "one process: the layouts are the first test's";
  auto model = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(model, config_of("default"), "default", kSlots);
  lora->add_adapter("c", config_of("c"));
  const std::vector<double> w = {0.7, -1.5};
  lora->add_weighted_adapter({"default", "c"}, w, "svd8", "svd", {.svd_rank = 8});
  lora->add_weighted_adapter({"default", "c"}, w, "svd", "svd");
  std::map<std::string, std::map<std::string, Tensor>> v;
  EXPECT_EQ(lora->config("svd8").r, 8);
  EXPECT_EQ(lora->config("svd").r, 4);
  for (const std::string name : {"default", "c", "svd8", "svd"})
    v[name] = copy_of(lora->read_adapter(name));
  lora->delete_adapter("svd8");
  lora->add_weighted_adapter({"default", "c"}, w, "clamped", "svd", {.svd_clamp = 0.8});
  v["clamped"] = copy_of(lora->read_adapter("clamped"));
  lora->delete_adapter("clamped");
  lora->add_weighted_adapter({"default", "c"}, w, "ties_svd", "ties_svd", {.density = 0.5});
  v["ties_svd"] = lora->read_adapter("ties_svd");
  for (const auto& [path, layer] : lora->layers()) {
    SCOPED_TRACE(path);
    EXPECT_EQ(layer->slot(lora->adapter_id("svd")).scale, 1.0);
    const std::string ka = path + "." + layer->adapter_key(true);
    const std::string kb = path + "." + layer->adapter_key(false);
    const Tensor ud = update(*lora, v["default"], "default", path, *layer);
    const Tensor uc = update(*lora, v["c"], "c", path, *layer);
    const Tensor delta = add(mul(ud, w[0]), mul(uc, w[1]));
    const Tensor& a8 = v["svd8"].at(ka);
    const Tensor& b8 = v["svd8"].at(kb);
    expect_close(matmul(b8, a8), delta, 1e-5, "rank 8: exact");
    expect_close(matmul(a8, transpose(a8, 0, 1)), identity(8), 1e-5, "A's rows orthonormal");
    const std::vector<double> g = host(matmul(transpose(b8, 0, 1), b8));
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t j = 0; j < 8; ++j) {
        if (i != j) {
          EXPECT_NEAR(g[size_t(i * 8 + j)], 0.0, 1e-5 * g[0]) << "B's columns " << i << ", " << j;
        } else if (i > 0) {
          EXPECT_LE(g[size_t(i * 9)], g[size_t((i - 1) * 9)] * (1 + 1e-6)) << "largest first";
        }
      }
    const Tensor top4 = matmul(kernels::narrow(b8, 1, 0, 4), kernels::narrow(a8, 0, 0, 4));
    expect_close(matmul(v["svd"].at(kb), v["svd"].at(ka)), top4, 1e-5, "rank 4: the first 4");
    // The clamped factors: the unclamped ones cut at their 0.8-quantile h.
    std::vector<double> all = host(v["svd"].at(kb)), av = host(v["svd"].at(ka));
    all.insert(all.end(), av.begin(), av.end());
    std::sort(all.begin(), all.end());
    const double pos = 0.8 * double(all.size() - 1), lo = std::floor(pos);
    const double h = all[size_t(lo)] + (all[size_t(std::ceil(pos))] - all[size_t(lo)]) * (pos - lo);
    for (const std::string& k : {ka, kb})
      expect_close(v["clamped"].at(k), clamped(v["svd"].at(k), h), 1e-6, "clamped " + k);
    // ties_svd: the TIES merge of the updates, projected onto A's (orthonormal) rows.
    const Tensor ties = tensor_of(merged_ref({host(ud), host(uc)}, w, 0.5, true), delta.shape());
    const Tensor& at = v["ties_svd"].at(ka);
    expect_close(matmul(at, transpose(at, 0, 1)), identity(4), 1e-5, "ties_svd A's rows");
    expect_close(v["ties_svd"].at(kb), matmul(ties, transpose(at, 0, 1)), 1e-5, "ties_svd B");
  }
}

// "cat" of an orthogonally initialised adapter (r 2) and one of r 3 has rank 5, which the
// orthogonal init refuses: the combined adapter is written, not drawn, so it takes its values.
TEST(LoraWeighted, AnOddCombinedRankAfterAnOrthogonalAdapter) {
  auto model = std::make_shared<Decoder>(lora_decoder_config());
  LoraConfig first = config_of("b");
  first.init_lora_weights = LoraInit::Orthogonal;
  auto lora = apply_lora(model, first, "default", kSlots);
  LoraConfig second = config_of("b");
  second.r = 3;
  second.seed = 9;
  lora->add_adapter("three", second);
  lora->add_weighted_adapter({"default", "three"}, {1.0, 0.5}, "five", "cat");
  EXPECT_EQ(lora->config("five").r, 5);
  const auto d = lora->read_adapter("default"), t = lora->read_adapter("three"),
             f = lora->read_adapter("five");
  for (const auto& [path, layer] : lora->layers())
    expect_close(update(*lora, f, "five", path, *layer),
                 add(update(*lora, d, "default", path, *layer),
                     mul(update(*lora, t, "three", path, *layer), 0.5)),
                 1e-6, path);
}

// An adapter's rank is its largest, rank_pattern's included, as PEFT counts it: "svd" keeps a
// layer of the pattern's rank whole (it was cut to r), and "cat" makes room for every layer's
// ranks side by side (it refused a layer whose ranks added up past the sum of the r).
TEST(LoraWeighted, RankPatternsCountInTheCombinedRank) {
  if (world_size() > 1) GTEST_SKIP() << "one process: the layouts are the first test's";
  auto model = std::make_shared<Decoder>(lora_decoder_config());
  LoraConfig c = config_of("default");
  c.r = 2;
  c.rank_pattern = {{"wq", 4}};
  auto lora = apply_lora(model, c, "default", kSlots);
  c.seed = 9;
  lora->add_adapter("c", c);
  lora->add_weighted_adapter({"default", "c"}, {0.5, 0.0}, "svd", "svd");
  lora->add_weighted_adapter({"default", "c"}, {0.5, 1.5}, "cat", "cat");
  EXPECT_EQ(lora->config("svd").r, 4);
  EXPECT_EQ(lora->config("cat").r, 8);
  std::map<std::string, std::map<std::string, Tensor>> v;
  for (const std::string name : {"default", "c", "svd", "cat"})
    v[name] = copy_of(lora->read_adapter(name));
  for (const auto& [path, layer] : lora->layers()) {
    SCOPED_TRACE(path);
    const Tensor ud = update(*lora, v["default"], "default", path, *layer);
    const Tensor uc = update(*lora, v["c"], "c", path, *layer);
    expect_close(update(*lora, v["svd"], "svd", path, *layer), mul(ud, 0.5), 1e-5,
                 "svd: default's update, whole at the pattern's rank");
    expect_close(update(*lora, v["cat"], "cat", path, *layer), add(mul(ud, 0.5), mul(uc, 1.5)),
                 1e-5, "cat: both updates");
  }
}

TEST(LoraWeighted, WhatCannotBeCombinedIsRefusedAndChangesNothing) {
  auto model = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(model, config_of("default"), "default",
                         {.max_adapters = 5, .max_rank = 8, .use_dora = true});
  add_sources(*lora);
  LoraConfig dora = config_of("c");
  dora.use_dora = true;
  lora->add_adapter("d", dora);
  const std::vector<std::string> before = lora->adapters();
  auto refused = [&](const std::vector<std::string>& adapters, const std::vector<double>& weights,
                     const std::string& name, const std::string& type,
                     const std::vector<std::string>& what) {
    expect_error([&] { lora->add_weighted_adapter(adapters, weights, name, type); }, what);
    EXPECT_EQ(lora->adapters(), before) << type;
  };
  refused({"default", "b"}, {1, 1}, "c", "cat", {"add_weighted_adapter", "'c' exists already"});
  refused({"default", "zz"}, {1, 1}, "n", "cat", {"add_weighted_adapter", "no adapter 'zz'"});
  refused({"default", "b"}, {1}, "n", "cat", {"2 adapters (default, b) and 1 weights"});
  refused({"default", "b"}, {1, 1}, "n", "concat", {"'concat' is no combination type"});
  refused({"default", "c"}, {1, 1}, "n", "linear_svd", {"'linear_svd' is no combination type"});
  refused({"default", "b"}, {1, 1}, "n", "linear",
          {"\"linear\" needs equal ranks", "'b' has rank 2 in tok_embeddings"});
  for (const char* type : {"ties", "magnitude_prune_svd"})
    refused({"default", "c"}, {1, 1}, "n", type, {"prunes and needs a density", "none given"});
  auto refused_with = [&](const std::string& type, const WeightedAdapterOptions& o,
                          const std::vector<std::string>& what) {
    expect_error([&] { lora->add_weighted_adapter({"default", "c"}, {1, 1}, "n", type, o); }, what);
    EXPECT_EQ(lora->adapters(), before) << type;
  };
  refused_with("ties", {.density = -0.5}, {"density >= 0"});
  refused_with("dare_linear", {.density = 0}, {"density 0 keeps nothing"});
  refused_with("ties", {.density = 0.5, .majority_sign_method = "mean"},
               {"majority_sign_method 'mean'"});
  refused_with("svd", {.svd_rank = 0}, {"svd_rank 0 is not a rank"});
  refused_with("svd", {.svd_clamp = 1.5}, {"svd_clamp 1.5 is not a quantile"});
  refused_with("svd", {.svd_rank = 9}, {"rank 9", "at most rank 8"});
  expect_error(
      [&] {
        lora->add_weighted_adapter({"default", "b"}, {1, 1}, "n", "ties", {.density = 0.5});
      },
      {"\"ties\" needs equal ranks"});
  refused({"default", "c", "b"}, {1, 1, 1}, "n", "cat", {"rank 10", "at most rank 8"});
  refused({"default", "d"}, {1, 1}, "n", "cat", {"'d' uses DoRA"});
  // The last free slot taken: add_adapter's refusal, and nothing left behind.
  lora->add_adapter("e", config_of("c"));
  expect_error(
      [&] {
        lora->add_weighted_adapter({"default", "c"}, {1, 1}, "n", "cat");
      },
      {"add_adapter"});
  EXPECT_EQ(lora->adapters().size(), 5u);
}
