// The LLaMA-style decoder: config checks, parameter names and initialisation order, attention
// against a plain-loop reference, causality, gradients by finite differences, GQA against MHA,
// tied embeddings and a short training run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::expect_close;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;

namespace {

DecoderConfig tiny_config() {
  DecoderConfig c;
  c.vocab_size = 11;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 12;
  c.max_seq_len = 16;
  c.seed = 7;
  return c;
}

// Parameters are float32 by construction; gradchecks need float64 leaves. The registered slots
// are the Parameter members, so assigning through them swaps the module's tensors.
void to_float64(Module& m) {
  for (auto& [name, p] : m.named_parameters())
    *p = Parameter(p->local().detach().to(DType::Float64));
}

std::vector<Tensor> leaves(Module& m) {
  std::vector<Tensor> out;
  for (Parameter* p : m.parameters())
    out.push_back(p->local());
  return out;
}

Tensor random_ids(const Shape& shape, int64_t vocab, uint64_t seed) {
  Generator gen(seed);
  std::vector<double> u = rand(shape, gen, DType::Float64).to_vector<double>();
  std::vector<int64_t> ids;
  for (double v : u)
    ids.push_back(std::min<int64_t>(vocab - 1, int64_t(v * double(vocab))));
  return from_vector<int64_t>(ids, shape);
}

void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      const std::vector<Tensor>& inputs, const std::string& what) {
  GradcheckOptions opts;
  opts.atol = 1e-6;
  opts.rtol = 1e-4;
  GradcheckResult r = gradcheck(f, inputs, opts);
  EXPECT_TRUE(r.ok) << what << ": " << r.message;
}

// Plain-loop LLaMA attention on row-major values: x [B, T, D], wq [Hq*E, D], wk/wv [Hkv*E, D],
// wo [D, Hq*E]; interleaved rotary pairs, query head h reads kv head h / (Hq / Hkv).
std::vector<double> ref_attention(const std::vector<double>& x, const std::vector<double>& wq,
                                  const std::vector<double>& wk, const std::vector<double>& wv,
                                  const std::vector<double>& wo, int64_t b, int64_t t, int64_t d,
                                  int64_t hq, int64_t hkv, int64_t e, double theta) {
  auto project = [&](const std::vector<double>& w, int64_t heads) {
    std::vector<double> y(size_t(b * t * heads * e), 0.0);
    for (int64_t r = 0; r < b * t; ++r)
      for (int64_t o = 0; o < heads * e; ++o) {
        double acc = 0;
        for (int64_t c = 0; c < d; ++c)
          acc += x[size_t(r * d + c)] * w[size_t(o * d + c)];
        y[size_t(r * heads * e + o)] = acc;
      }
    return y;
  };
  auto rotate = [&](std::vector<double>& y, int64_t heads) {
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t ti = 0; ti < t; ++ti)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < e / 2; ++i) {
            size_t at = size_t(((bi * t + ti) * heads + h) * e + 2 * i);
            double angle = double(ti) * std::pow(theta, -2.0 * double(i) / double(e));
            double c = std::cos(angle), s = std::sin(angle), y0 = y[at], y1 = y[at + 1];
            y[at] = y0 * c - y1 * s;
            y[at + 1] = y0 * s + y1 * c;
          }
  };
  std::vector<double> q = project(wq, hq), k = project(wk, hkv), v = project(wv, hkv);
  rotate(q, hq);
  rotate(k, hkv);
  const int64_t groups = hq / hkv;
  std::vector<double> o(size_t(b * t * hq * e), 0.0);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kv = h / groups;
      for (int64_t i = 0; i < t; ++i) {
        std::vector<double> p(size_t(i + 1));
        double m = -std::numeric_limits<double>::infinity(), z = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double acc = 0;
          for (int64_t c = 0; c < e; ++c)
            acc += q[size_t(((bi * t + i) * hq + h) * e + c)] *
                   k[size_t(((bi * t + j) * hkv + kv) * e + c)];
          p[size_t(j)] = acc / std::sqrt(double(e));
          m = std::max(m, p[size_t(j)]);
        }
        for (double& pj : p) {
          pj = std::exp(pj - m);
          z += pj;
        }
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t c = 0; c < e; ++c)
            o[size_t(((bi * t + i) * hq + h) * e + c)] +=
                p[size_t(j)] / z * v[size_t(((bi * t + j) * hkv + kv) * e + c)];
      }
    }
  std::vector<double> out(size_t(b * t * d), 0.0);
  for (int64_t r = 0; r < b * t; ++r)
    for (int64_t c = 0; c < d; ++c) {
      double acc = 0;
      for (int64_t f = 0; f < hq * e; ++f)
        acc += o[size_t(r * hq * e + f)] * wo[size_t(c * hq * e + f)];
      out[size_t(r * d + c)] = acc;
    }
  return out;
}

// Mean next-token cross-entropy of logits [B, T, V] for ids [B, T].
Tensor next_token_loss(const Tensor& logits, const Tensor& ids) {
  const int64_t t = ids.size(1);
  return cross_entropy(narrow(logits, 1, 0, t - 1), narrow(ids, 1, 1, t - 1).contiguous());
}

}  // namespace

TEST(DecoderConfig, ValidateNamesTheOffendingField) {
  EXPECT_NO_THROW(tiny_config().validate());
  auto bad = [](auto edit, const std::string& needle) {
    DecoderConfig c = tiny_config();
    edit(c);
    expect_error([&] { c.validate(); }, needle);
    expect_error([&] { Decoder d(c); }, needle);
  };
  bad([](DecoderConfig& c) { c.vocab_size = 0; }, "vocab_size must be positive, got 0");
  bad([](DecoderConfig& c) { c.dim = -4; }, "dim must be positive, got -4");
  bad([](DecoderConfig& c) { c.n_layers = 0; }, "n_layers must be positive");
  bad([](DecoderConfig& c) { c.n_heads = 0; }, "n_heads must be positive");
  bad([](DecoderConfig& c) { c.n_kv_heads = 0; }, "n_kv_heads must be positive");
  bad([](DecoderConfig& c) { c.ffn_dim = 0; }, "ffn_dim must be positive");
  bad([](DecoderConfig& c) { c.max_seq_len = 0; }, "max_seq_len must be positive");
  bad([](DecoderConfig& c) { c.n_heads = 3; }, "dim (16) must be divisible by n_heads (3)");
  bad([](DecoderConfig& c) { c.n_kv_heads = 3; },
      "n_heads (4) must be a multiple of n_kv_heads (3)");
  bad([](DecoderConfig& c) { c.n_kv_heads = 8; },
      "n_heads (4) must be a multiple of n_kv_heads (8)");
  bad(
      [](DecoderConfig& c) {
        c.dim = 12;
        c.n_heads = 4;
      },
      "head_dim = dim / n_heads = 12 / 4 = 3 must be even");
  bad([](DecoderConfig& c) { c.norm_eps = 0; }, "norm_eps must be positive");
  bad([](DecoderConfig& c) { c.rope_theta = -1; }, "rope_theta must be positive");
}

TEST(Decoder, ParameterNamesAndShapesFollowLlama) {
  DecoderConfig c = tiny_config();  // head_dim 4, 2 kv heads
  auto dec = std::make_shared<Decoder>(c);
  std::vector<std::pair<std::string, Shape>> want = {{"tok_embeddings.weight", {11, 16}}};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    want.push_back({p + "attention_norm.weight", {16}});
    want.push_back({p + "attention.wq.weight", {16, 16}});
    want.push_back({p + "attention.wk.weight", {8, 16}});
    want.push_back({p + "attention.wv.weight", {8, 16}});
    want.push_back({p + "attention.wo.weight", {16, 16}});
    want.push_back({p + "ffn_norm.weight", {16}});
    want.push_back({p + "feed_forward.w1.weight", {12, 16}});
    want.push_back({p + "feed_forward.w2.weight", {16, 12}});
    want.push_back({p + "feed_forward.w3.weight", {12, 16}});
  }
  want.push_back({"norm.weight", {16}});
  want.push_back({"output.weight", {11, 16}});

  auto named = dec->named_parameters();
  ASSERT_EQ(named.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(named[i].first, want[i].first) << "parameter " << i;
    EXPECT_EQ(named[i].second->global_shape(), want[i].second) << want[i].first;
    EXPECT_EQ(named[i].second->dtype(), DType::Float32) << want[i].first;
    EXPECT_TRUE(named[i].second->requires_grad()) << want[i].first;
  }
  // The rotary tables are derived data: no buffers, and the state dict is the parameters.
  EXPECT_TRUE(dec->named_buffers().empty());
  auto sd = dec->state_dict();
  EXPECT_EQ(sd.size(), want.size());
  for (const auto& [name, shape] : want)
    EXPECT_EQ(sd.count(name), 1u) << name;

  c.tie_embeddings = true;
  auto tied = std::make_shared<Decoder>(c);
  EXPECT_EQ(tied->output, nullptr);
  auto tied_named = tied->named_parameters();
  ASSERT_EQ(tied_named.size(), want.size() - 1);
  EXPECT_EQ(tied_named.back().first, "norm.weight");
}

// RMSNorm's own default eps is the dtype's epsilon (PyTorch's); the decoder passes norm_eps.
TEST(Decoder, NormsUseTheConfiguredEps) {
  DecoderConfig cfg = tiny_config();
  auto net = std::make_shared<Decoder>(cfg);
  EXPECT_EQ(net->norm->eps(), std::optional<double>(1e-6));
  for (auto& [name, m] : net->named_modules())
    if (auto* norm = dynamic_cast<RMSNorm*>(m.get())) {
      EXPECT_EQ(norm->eps(), std::optional<double>(1e-6)) << name;
    }
}

TEST(Decoder, SubmodulePathsReachTheBlocks) {
  auto dec = std::make_shared<Decoder>(tiny_config());
  EXPECT_EQ(dec->get_submodule("layers.1.attention.wq").get(), dec->layers[1]->attention->wq.get());
  EXPECT_EQ(dec->get_submodule("layers.0.feed_forward").get(), dec->layers[0]->feed_forward.get());
  std::vector<std::string> names;
  for (auto& [name, m] : dec->named_modules())
    names.push_back(name);
  std::vector<std::string> head(names.begin(), names.begin() + 4);
  EXPECT_EQ(head, (std::vector<std::string>{"", "tok_embeddings", "layers", "layers.0"}));
  expect_error([&] { dec->get_submodule("layers.2"); }, "no child '2'");

  // Replacing a block through its path replaces the block the decoder runs.
  Generator gen(99);
  auto fresh = std::make_shared<DecoderBlock>(tiny_config(), gen);
  Tensor ids = random_ids({1, 5}, 11, 3);
  Tensor before = (*dec)(ids).detach();
  dec->replace_submodule("layers.1", fresh);
  EXPECT_EQ(dec->layers[1].get(), fresh.get());
  Tensor after = (*dec)(ids).detach();
  EXPECT_NE(before.to_vector<float>(), after.to_vector<float>());
}

TEST(Decoder, TheBlockListItselfCannotBeReplaced) {
  // forward runs Decoder::layers: another list in the "layers" slot was listed, saved and handed
  // to optimizers while forward went on running the decoder's own blocks.
  auto dec = std::make_shared<Decoder>(tiny_config());
  DecoderConfig other_cfg = tiny_config();
  other_cfg.seed = 7;
  auto other = std::make_shared<Decoder>(other_cfg);
  const ModulePtr list = dec->get_submodule("layers");
  expect_error([&] { dec->replace_submodule("layers", other->get_submodule("layers")); },
               {"'layers' is part of Decoder", "\"layers.0\""});
  EXPECT_EQ(dec->get_submodule("layers").get(), list.get());
  EXPECT_EQ(dec->get_submodule("layers.0").get(), dec->layers[0].get());
  const auto names = dec->named_parameters();
  const auto it = std::find_if(names.begin(), names.end(), [](const auto& np) {
    return np.first == "layers.0.ffn_norm.weight";
  });
  ASSERT_NE(it, names.end());
  EXPECT_EQ(it->second, &dec->layers[0]->ffn_norm->weight);
}

TEST(Decoder, TheBlockListHeldAloneKeepsItsBlocks) {
  // The list's slots are the decoder's elements of `layers`: held alone, it must keep them (they
  // were freed with the decoder, and the list read freed memory).
  auto dec = std::make_shared<Decoder>(tiny_config());
  const std::weak_ptr<DecoderBlock> block = dec->layers[1];
  const Tensor weight = dec->layers[1]->ffn_norm->weight.stored();
  const ModulePtr list = dec->get_submodule("layers");
  dec.reset();
  ASSERT_FALSE(block.expired()) << "the blocks died with the decoder while its list was held";
  EXPECT_EQ(list->get_submodule("1").get(), block.lock().get());
  const auto params = list->named_parameters();
  const auto it = std::find_if(params.begin(), params.end(),
                               [](const auto& np) { return np.first == "1.ffn_norm.weight"; });
  ASSERT_NE(it, params.end());
  EXPECT_TRUE(it->second->stored().is_same(weight));
}

TEST(Decoder, DrawsParametersFromTheSeedInRegistrationOrder) {
  DecoderConfig c = tiny_config();
  auto a = std::make_shared<Decoder>(c);
  auto b = std::make_shared<Decoder>(c);
  auto sa = a->state_dict(), sb = b->state_dict();
  for (const auto& [name, t] : sa)
    EXPECT_EQ(t.to_vector<float>(), sb.at(name).to_vector<float>()) << name;

  // Replaying the construction with the layers themselves gives the same values: the
  // embedding first, then per block wq, wk, wv, wo, w1, w2, w3, then the output projection.
  Generator gen(c.seed);
  const int64_t e = c.head_dim();
  std::vector<std::pair<std::string, Tensor>> replay;
  replay.push_back({"tok_embeddings.weight", Embedding(c.vocab_size, c.dim, gen).weight.local()});
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    replay.push_back(
        {p + "attention.wq.weight", Linear(c.dim, c.n_heads * e, false, gen).weight.local()});
    replay.push_back(
        {p + "attention.wk.weight", Linear(c.dim, c.n_kv_heads * e, false, gen).weight.local()});
    replay.push_back(
        {p + "attention.wv.weight", Linear(c.dim, c.n_kv_heads * e, false, gen).weight.local()});
    replay.push_back(
        {p + "attention.wo.weight", Linear(c.n_heads * e, c.dim, false, gen).weight.local()});
    replay.push_back(
        {p + "feed_forward.w1.weight", Linear(c.dim, c.ffn_dim, false, gen).weight.local()});
    replay.push_back(
        {p + "feed_forward.w2.weight", Linear(c.ffn_dim, c.dim, false, gen).weight.local()});
    replay.push_back(
        {p + "feed_forward.w3.weight", Linear(c.dim, c.ffn_dim, false, gen).weight.local()});
  }
  replay.push_back({"output.weight", Linear(c.dim, c.vocab_size, false, gen).weight.local()});
  for (const auto& [name, t] : replay)
    EXPECT_EQ(sa.at(name).to_vector<float>(), t.to_vector<float>()) << name;
  for (const char* n : {"norm.weight", "layers.0.attention_norm.weight"})
    EXPECT_EQ(sa.at(n).to_vector<float>(), std::vector<float>(16, 1.0f)) << n;

  c.seed = 8;
  auto other = std::make_shared<Decoder>(c);
  auto so = other->state_dict();
  EXPECT_NE(so.at("tok_embeddings.weight").to_vector<float>(),
            sa.at("tok_embeddings.weight").to_vector<float>());
  EXPECT_NE(so.at("layers.1.attention.wv.weight").to_vector<float>(),
            sa.at("layers.1.attention.wv.weight").to_vector<float>());
}

TEST(Decoder, ForwardShapesAndInputErrors) {
  for (bool tied : {false, true}) {
    DecoderConfig c = tiny_config();
    c.tie_embeddings = tied;
    auto dec = std::make_shared<Decoder>(c);
    Tensor logits = (*dec)(random_ids({3, 7}, c.vocab_size, 1));
    EXPECT_EQ(logits.shape(), (Shape{3, 7, 11})) << "tied " << tied;
    EXPECT_EQ(logits.dtype(), DType::Float32);
    for (float v : logits.to_vector<float>())
      ASSERT_TRUE(std::isfinite(v));
    expect_error(
        [&] {
          (*dec)(random_ids({1, 17}, c.vocab_size, 1));
        },
        "sequence length 17 of ids [1, 17] exceeds max_seq_len 16");
    expect_error([&] { (*dec)(zeros({2, 3})); }, "token ids must be int64 [B, T]");
    expect_error([&] { (*dec)(random_ids({6}, c.vocab_size, 1)); },
                 "token ids must be int64 [B, T]");
  }
}

TEST(Attention, InputErrorsNameShapes) {
  DecoderConfig c = tiny_config();
  Generator gen(1);
  auto attn = std::make_shared<Attention>(c, gen);
  expect_error(
      [&] {
        (*attn)(zeros({4, 16}));
      },
      "Attention: input must be [B, T, dim], got [4, 16]");
  expect_error([&] { (*attn)(zeros({1, 17, 16})); }, "sequence length 17 exceeds max_seq_len 16");
  // A projection that cuts a head in two (as a bad tensor-parallel degree would) is caught.
  attn->wk->weight = Parameter(zeros({6, 16}));
  attn->wv->weight = Parameter(zeros({6, 16}));
  expect_error([&] { (*attn)(zeros({1, 3, 16})); }, "are not whole heads of head_dim 4");
  // Whole heads, but not the query heads these kv heads serve.
  attn->wk->weight = Parameter(zeros({4, 16}));
  attn->wv->weight = Parameter(zeros({4, 16}));
  expect_error([&] { (*attn)(zeros({1, 3, 16})); }, "holds 4 query heads and 1 kv heads");
}

TEST(Attention, MatchesPlainLoopReference) {
  for (int64_t kv_heads : {4, 2, 1}) {
    DecoderConfig c = tiny_config();
    c.n_kv_heads = kv_heads;
    c.rope_theta = 100.0;  // large angles even at short positions
    Generator gen(5);
    auto attn = std::make_shared<Attention>(c, gen);
    to_float64(*attn);
    const int64_t b = 2, t = 6, e = c.head_dim();
    Tensor x = random_tensor({b, t, c.dim}, 11, DType::Float64);
    Tensor y = (*attn)(x);
    ASSERT_EQ(y.shape(), (Shape{b, t, c.dim}));
    auto w = [](const std::shared_ptr<Linear>& l) { return l->weight.local().to_vector<double>(); };
    std::vector<double> want =
        ref_attention(x.to_vector<double>(), w(attn->wq), w(attn->wk), w(attn->wv), w(attn->wo), b,
                      t, c.dim, c.n_heads, kv_heads, e, c.rope_theta);
    expect_close(y, from_vector<double>(want, {b, t, c.dim}), 1e-10,
                 "attention with " + std::to_string(kv_heads) + " kv heads");
  }
}

TEST(Attention, GradcheckGroupedQuery) {
  DecoderConfig c = tiny_config();
  c.dim = 8;  // 4 heads of 2, 2 kv heads
  Generator gen(2);
  auto attn = std::make_shared<Attention>(c, gen);
  to_float64(*attn);
  Tensor x = random_tensor({2, 4, 8}, 4, DType::Float64).set_requires_grad(true);
  std::vector<Tensor> inputs = {x};
  for (Tensor& p : leaves(*attn))
    inputs.push_back(p);
  expect_gradcheck([&](const std::vector<Tensor>& in) { return (*attn)(in[0]); }, inputs,
                   "Attention");
}

TEST(FeedForward, SwiGluValueAndGradcheck) {
  DecoderConfig c = tiny_config();
  c.dim = 6;
  c.n_heads = 3;
  c.n_kv_heads = 1;
  c.ffn_dim = 5;
  Generator gen(3);
  auto ff = std::make_shared<FeedForward>(c, gen);
  to_float64(*ff);
  Tensor x = random_tensor({2, 3, 6}, 6, DType::Float64).set_requires_grad(true);

  // w2(silu(w1 x) * w3 x) by loops.
  auto xv = x.to_vector<double>();
  auto w1 = ff->w1->weight.local().to_vector<double>(),
       w2 = ff->w2->weight.local().to_vector<double>(),
       w3 = ff->w3->weight.local().to_vector<double>();
  std::vector<double> want(size_t(6 * 6), 0.0);
  for (int64_t r = 0; r < 6; ++r) {
    std::vector<double> hidden(5);
    for (int64_t f = 0; f < 5; ++f) {
      double a = 0, g = 0;
      for (int64_t i = 0; i < 6; ++i) {
        a += xv[size_t(r * 6 + i)] * w1[size_t(f * 6 + i)];
        g += xv[size_t(r * 6 + i)] * w3[size_t(f * 6 + i)];
      }
      hidden[size_t(f)] = a / (1.0 + std::exp(-a)) * g;
    }
    for (int64_t o = 0; o < 6; ++o)
      for (int64_t f = 0; f < 5; ++f)
        want[size_t(r * 6 + o)] += hidden[size_t(f)] * w2[size_t(o * 5 + f)];
  }
  expect_close((*ff)(x), from_vector<double>(want, {2, 3, 6}), 1e-12, "FeedForward");

  std::vector<Tensor> inputs = {x};
  for (Tensor& p : leaves(*ff))
    inputs.push_back(p);
  expect_gradcheck([&](const std::vector<Tensor>& in) { return (*ff)(in[0]); }, inputs,
                   "FeedForward");
}

TEST(Decoder, GradcheckTinyFloat64Model) {
  for (bool tied : {false, true}) {
    DecoderConfig c;
    c.vocab_size = 7;
    c.dim = 8;
    c.n_layers = 2;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.ffn_dim = 6;
    c.max_seq_len = 8;
    c.tie_embeddings = tied;
    c.seed = 21;
    auto dec = std::make_shared<Decoder>(c);
    to_float64(*dec);
    Tensor ids = random_ids({2, 4}, c.vocab_size, 5);
    expect_gradcheck([&](const std::vector<Tensor>&) { return (*dec)(ids); }, leaves(*dec),
                     tied ? "tied decoder" : "decoder");
  }
}

TEST(Decoder, IsCausal) {
  auto dec = std::make_shared<Decoder>(tiny_config());
  Tensor a = random_ids({2, 9}, 11, 13);
  std::vector<int64_t> changed = a.to_vector<int64_t>();
  const int64_t pos = 4;
  for (int64_t bi = 0; bi < 2; ++bi) {
    int64_t& id = changed[size_t(bi * 9 + pos)];
    id = (id + 5) % 11;
  }
  Tensor la = (*dec)(a), lb = (*dec)(from_vector<int64_t>(changed, {2, 9}));
  auto va = la.to_vector<float>(), vb = lb.to_vector<float>();
  for (int64_t bi = 0; bi < 2; ++bi)
    for (int64_t t = 0; t < 9; ++t) {
      double diff = 0;
      for (int64_t v = 0; v < 11; ++v) {
        size_t i = size_t((bi * 9 + t) * 11 + v);
        diff = std::max(diff, double(std::abs(va[i] - vb[i])));
      }
      if (t < pos)
        EXPECT_EQ(diff, 0.0) << "position " << t << " saw a later token";
      else
        EXPECT_GT(diff, 1e-6) << "position " << t << " ignored token " << pos;
    }
}

TEST(Decoder, GroupedQueryEqualsMhaWithDuplicatedKvHeads) {
  DecoderConfig gc = tiny_config();  // 4 query heads, 2 kv heads of dim 4
  DecoderConfig mc = gc;
  mc.n_kv_heads = 4;
  auto gqa = std::make_shared<Decoder>(gc);
  auto mha = std::make_shared<Decoder>(mc);
  auto state = gqa->state_dict();
  // MHA head h takes the rows of GQA kv head h / 2.
  std::vector<int64_t> rows;
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t i = 0; i < 4; ++i)
      rows.push_back((h / 2) * 4 + i);
  Tensor index = from_vector<int64_t>(rows);
  for (auto& [name, t] : state)
    if (name.ends_with("attention.wk.weight") || name.ends_with("attention.wv.weight"))
      t = kernels::index_select(t, 0, index);
  mha->load_state_dict(state);
  Tensor ids = random_ids({2, 8}, 11, 17);
  expect_close((*mha)(ids), (*gqa)(ids), 1e-5, "GQA vs MHA logits");
}

TEST(Decoder, TiedEmbeddingGetsBothGradients) {
  DecoderConfig c = tiny_config();
  c.tie_embeddings = true;
  auto tied = std::make_shared<Decoder>(c);
  c.tie_embeddings = false;
  auto untied = std::make_shared<Decoder>(c);
  auto state = tied->state_dict();
  state["output.weight"] = state.at("tok_embeddings.weight");
  untied->load_state_dict(state);

  Tensor ids = random_ids({2, 6}, 11, 23);
  Tensor lt = (*tied)(ids), lu = (*untied)(ids);
  expect_close(lt, lu, 1e-6, "tied vs untied logits");
  backward(next_token_loss(lt, ids));
  backward(next_token_loss(lu, ids));
  Tensor want = kernels::binary(kernels::BinaryOp::Add, untied->tok_embeddings->weight.grad(),
                                untied->output->weight.grad());
  expect_close(tied->tok_embeddings->weight.grad(), want, 1e-5, "tied embedding gradient");
}

TEST(Decoder, SgdOnARepeatedSequenceLowersTheLoss) {
  DecoderConfig c = tiny_config();
  auto dec = std::make_shared<Decoder>(c);
  std::vector<int64_t> seq;
  for (int64_t i = 0; i < 16; ++i)
    seq.push_back((3 * i) % 7 + 1);  // period 7
  Tensor ids = from_vector<int64_t>(seq, {1, 16});
  std::vector<double> losses;
  for (int step = 0; step < 40; ++step) {
    dec->zero_grad();
    Tensor loss = next_token_loss((*dec)(ids), ids);
    losses.push_back(loss.item<float>());
    backward(loss);
    for (Parameter* p : dec->parameters()) {
      ASSERT_TRUE(p->grad().defined());
      Tensor w = p->local().detach();
      kernels::add_(w, p->grad(), -0.1);
    }
  }
  EXPECT_GT(losses.front(), 1.5);
  EXPECT_LT(losses.back(), 0.5 * losses.front())
      << "first " << losses.front() << ", last " << losses.back();
}
