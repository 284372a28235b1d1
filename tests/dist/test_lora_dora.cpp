// DoRA (PEFT's use_dora): the forward and gradients against PEFT's formula computed by hand in
// float64, the magnitude's initial values (the global row norms of W + scale B A under every
// mesh), fine-tuning under TP, FSDP and FSDP x TP against one process, merge and unmerge on each
// rank's window of W, PEFT's files, and what DoRA shares a model with (other adapters, mixed
// batches, the adapter table, the trainable counts).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <tuple>

#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

LoraConfig dora_config(LoraInit init = LoraInit::Random) {
  LoraConfig c = lora_test_config(init);
  c.use_dora = true;
  return c;
}

std::vector<double> values(const Tensor& t) {
  return t.contiguous().to_vector<double>();
}

// Row-major [rows, cols] of doubles.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  double& at(int64_t r, int64_t c) { return v[size_t(r * cols + c)]; }
  double at(int64_t r, int64_t c) const { return v[size_t(r * cols + c)]; }
};

Mat mat(const Tensor& t) {
  return {t.size(0), t.size(1), values(t)};
}

// a [n, k] times b^T (b [m, k]): [n, m].
Mat times_t(const Mat& a, const Mat& b) {
  Mat out{a.rows, b.rows, std::vector<double>(size_t(a.rows * b.rows), 0.0)};
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < b.rows; ++j)
      for (int64_t k = 0; k < a.cols; ++k)
        out.at(i, j) += a.at(i, k) * b.at(j, k);
  return out;
}

// The row norms of W + scale B A, in float64.
std::vector<double> adapted_row_norms(const Mat& w, const Mat& a, const Mat& b, double scale) {
  std::vector<double> n(size_t(w.rows), 0.0);
  for (int64_t o = 0; o < w.rows; ++o) {
    for (int64_t i = 0; i < w.cols; ++i) {
      double v = w.at(o, i);
      for (int64_t k = 0; k < a.rows; ++k)
        v += scale * b.at(o, k) * a.at(k, i);
      n[size_t(o)] += v * v;
    }
    n[size_t(o)] = std::sqrt(n[size_t(o)]);
  }
  return n;
}

double largest_difference(const std::vector<double>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double d = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i)
    d = std::max(d, std::abs(got[i] - want[i]));
  return d;
}

// The magnitude of "default" scaled per row by 1 + 0.1 (row % 5): g = m / norm is then not 1,
// so that a wrong norm shows.
void perturb_magnitude(LoraModel& lora, const std::string& name = "default") {
  auto v = lora.read_adapter(name);
  for (auto& [key, t] : v) {
    if (key.find("lora_magnitude_vector") == std::string::npos) continue;
    std::vector<float> m = t.to_vector<float>();
    for (size_t i = 0; i < m.size(); ++i)
      m[i] *= float(1.0 + 0.1 * double(i % 5));
    t = from_vector<float>(m, t.shape());
  }
  lora.write_adapter(name, v);
}

}  // namespace

// One DoRA layer against PEFT's formula, by hand in float64: y = x W^T + b + (g - 1) x W^T +
// g scale (x A^T) B^T with g = m / ||W + scale B A|| (detached), and the gradients of A, B and m
// of sum(c * y). The magnitude starts as those norms (g = 1) and is then scaled per row.
TEST(LoraDora, ForwardAndGradientsMatchPeftsFormula) {
  Generator gen(21);
  const int64_t in = 6, out = 5, n = 3;
  auto model = std::make_shared<OneLayer>(std::make_shared<Linear>(in, out, true, gen));
  LoraConfig cfg = dora_config();
  cfg.r = 2;
  cfg.lora_alpha = 4;  // scale 2
  cfg.target_modules = {"proj"};
  auto lora = apply_lora(model, cfg);
  auto& layer = dynamic_cast<LoraLinear&>(*lora->layers().front().second);
  const Mat w = mat(layer.weight.full()), a = mat(layer.lora_A(0).full()),
            b = mat(layer.lora_B(0).full());
  const std::vector<double> bias = values(layer.bias.full());
  const double scale = 2.0;
  const std::vector<double> norms = adapted_row_norms(w, a, b, scale);
  EXPECT_LE(largest_difference(values(layer.lora_magnitude_vector(0).full()), norms), 1e-6)
      << "the magnitude starts as the row norms of W + scale B A";
  perturb_magnitude(*lora);
  const std::vector<double> m = values(layer.lora_magnitude_vector(0).full());

  const Tensor x = randn({n, in}, gen);
  const Tensor c = randn({n, out}, gen);
  const Tensor y = (*model)(x);
  backward(sum(mul(y, c)));

  const Mat xm = mat(x), cm = mat(c);
  const Mat xw = times_t(xm, w), xa = times_t(xm, a);  // [n, out], [n, r]
  const Mat low = times_t(xa, b);                      // [n, out]
  std::vector<double> want_y, want_m(size_t(out), 0.0);
  Mat want_a{a.rows, a.cols, std::vector<double>(a.v.size(), 0.0)};
  Mat want_b{b.rows, b.cols, std::vector<double>(b.v.size(), 0.0)};
  for (int64_t s = 0; s < n; ++s)
    for (int64_t o = 0; o < out; ++o) {
      const double g = m[size_t(o)] / norms[size_t(o)];
      want_y.push_back(xw.at(s, o) + bias[size_t(o)] + (g - 1) * xw.at(s, o) +
                       g * scale * low.at(s, o));
      // The norm is a constant of the graph: m's gradient is c (x W^T + scale x A^T B^T) / norm.
      want_m[size_t(o)] += cm.at(s, o) * (xw.at(s, o) + scale * low.at(s, o)) / norms[size_t(o)];
      for (int64_t k = 0; k < a.rows; ++k) {
        want_b.at(o, k) += cm.at(s, o) * g * scale * xa.at(s, k);
        for (int64_t i = 0; i < in; ++i)
          want_a.at(k, i) += cm.at(s, o) * g * scale * b.at(o, k) * xm.at(s, i);
      }
    }
  EXPECT_LE(largest_difference(values(y), want_y), 1e-5) << "forward";
  EXPECT_LE(largest_difference(values(layer.lora_magnitude_vector(0).grad()), want_m), 1e-5)
      << "m's gradient";
  EXPECT_LE(largest_difference(values(layer.lora_A(0).grad()), want_a.v), 1e-5) << "A's gradient";
  EXPECT_LE(largest_difference(values(layer.lora_B(0).grad()), want_b.v), 1e-5) << "B's gradient";
  EXPECT_FALSE(layer.weight.grad().defined()) << "the base stays frozen";
}

// With dropout in training PEFT feeds dropout(x) to both of DoRA's terms: y = x W^T + b +
// (g - 1) d W^T + g scale (d A^T) B^T, d = dropout(x). d comes from a LoRA layer with A = B = I
// and scale 1 drawing the same mask (the same seed, adapter name and path give the same stream).
TEST(LoraDora, DropoutFeedsBothTermsAsPeft) {
  const int64_t width = 8, n = 4;
  auto make = [&](bool dora) {
    Generator g(22);
    auto model = std::make_shared<OneLayer>(std::make_shared<Linear>(width, width, true, g));
    LoraConfig cfg = lora_test_config(LoraInit::Random);
    cfg.use_dora = dora;
    cfg.r = width;
    cfg.lora_alpha = double(width);  // scale 1
    cfg.target_modules = {"proj"};
    cfg.lora_dropout = 0.5;
    return std::make_pair(model, apply_lora(model, cfg));
  };
  auto [dora_model, dora] = make(true);
  auto [probe_model, probe] = make(false);
  std::vector<float> eye(size_t(width * width), 0.0f);
  for (int64_t i = 0; i < width; ++i)
    eye[size_t(i * width + i)] = 1.0f;
  const Tensor identity = from_vector<float>(eye, {width, width});
  probe->write_adapter("default",
                       {{"proj.lora_A.weight", identity}, {"proj.lora_B.weight", identity}});
  perturb_magnitude(*dora);
  Generator gen(23);
  const Tensor x = randn({n, width}, gen);
  auto& layer = dynamic_cast<LoraLinear&>(*dora->layers().front().second);
  const Tensor w = layer.weight.full(), bias = layer.bias.full();
  const Tensor base = linear(x, w, bias);
  const Mat d = mat(sub((*probe_model)(x), base));
  const Tensor y = (*dora_model)(x);
  const Mat wm = mat(w), a = mat(layer.lora_A(0).full()), b = mat(layer.lora_B(0).full());
  const std::vector<double> norms = adapted_row_norms(wm, a, b, 1.0);
  const std::vector<double> m = values(layer.lora_magnitude_vector(0).full());
  const Mat dw = times_t(d, wm), low = times_t(times_t(d, a), b), bm = mat(base);
  std::vector<double> want;
  int64_t dropped = 0;
  for (int64_t s = 0; s < n; ++s)
    for (int64_t o = 0; o < width; ++o) {
      const double g = m[size_t(o)] / norms[size_t(o)];
      want.push_back(bm.at(s, o) + (g - 1) * dw.at(s, o) + g * low.at(s, o));
    }
  for (double v : d.v)
    dropped += v == 0.0;
  EXPECT_GT(dropped, 0) << "the mask dropped nothing: the test would not see x used for d";
  EXPECT_LE(largest_difference(values(y), want), 1e-5);
}

// The magnitude's initial values are the global row norms of W + scale B A under every layout:
// a rank that took its window's norm (row parallel: a part of each row) would start elsewhere.
// With g = 1 at the start, DoRA's first output is LoRA's.
TEST(LoraDora, MagnitudeStartsAsTheGlobalRowNormsUnderEveryLayout) {
  const DecoderConfig cfg = lora_decoder_config();
  auto plain = std::make_shared<Decoder>(cfg);
  auto ref = apply_lora(plain, dora_config())->read_adapter("default");
  ASSERT_EQ(ref.size(), 3u * 2u * 7u);  // 2 layers x 7 projections x (A, B, m)
  auto lora_model = std::make_shared<Decoder>(cfg);
  apply_lora(lora_model, lora_test_config(LoraInit::Random));
  const Batch batch = affine_batch(0, 4, 8, cfg.vocab_size);
  const Tensor want = (*lora_model)(batch.ids);
  for (const LoraLayout& l : lora_layouts()) {
    LoraRun run = l.build(cfg, dora_config());
    const auto got = run.lora->read_adapter("default");
    ASSERT_EQ(got.size(), ref.size()) << l.name;
    for (const auto& [key, t] : ref)
      expect_close(got.at(key), t, 1e-6, l.name + " " + key);
    expect_close(run.logits(batch.ids), want, 1e-5, l.name + ": DoRA's first output is LoRA's");
  }
}

// One DoRA layer, 5 -> 3 with a bias, over every rank count: column parallel (3 rows over 4
// ranks: 1, 1, 1, 0), row parallel (5 columns: 2, 2, 1, 0), row parallel into sequence shards
// (6 positions: 2, 2, 2, 0), with and without dropout: the output and the gradients of A, B and
// m are one process's. Row parallel, a rank's window holds part of every row, whose norm needs
// the other ranks' parts.
TEST(LoraDora, UnevenAndEmptyShardsMatchOneProcess) {
  const int64_t n = world_size();
  const DeviceMesh mesh(Shape{n}, {"tp"});
  auto col = std::make_shared<ColwiseParallel>();
  col->output_layouts = {Replicate()};
  auto row = std::make_shared<RowwiseParallel>();
  row->input_layouts = {Replicate()};
  auto row_sp = std::make_shared<RowwiseParallel>(*row);
  row_sp->output_layouts = {Shard(1)};
  const std::vector<std::tuple<std::string, ParallelStylePtr, bool>> cases = {
      {"colwise", col, false},
      {"rowwise", row, false},
      {"rowwise into sequence shards", row_sp, true}};
  for (const double dropout : {0.0, 0.3}) {
    for (const auto& [name, style, seq] : cases) {
      const std::string what = name + (dropout > 0 ? " with dropout" : "");
      LoraConfig cfg = dora_config();
      cfg.r = 2;
      cfg.lora_alpha = 4;
      cfg.lora_dropout = dropout;
      cfg.target_modules = {"proj"};
      auto make = [&] {
        Generator g(1);
        return std::make_shared<OneLayer>(std::make_shared<Linear>(5, 3, true, g));
      };
      auto plain = make();
      auto plain_lora = apply_lora(plain, cfg);
      perturb_magnitude(*plain_lora);
      auto sharded = make();
      auto lora = apply_lora(sharded, cfg);
      parallelize_module(sharded, mesh, {{"proj", style}});
      perturb_magnitude(*lora);
      Generator gx(5);
      const Tensor x = randn({2, 6, 5}, gx);
      const Tensor c = randn({2, 6, 3}, gx);
      Tensor want = (*plain)(x);
      backward(sum(mul(want, c)));
      Tensor c_here = c;
      if (seq) {
        const Chunk ch = chunk_of(6, n, mesh.local_rank(0));
        want = kernels::narrow(want, 1, ch.start, ch.length).contiguous();
        c_here = kernels::narrow(c, 1, ch.start, ch.length).contiguous();
      }
      const Tensor got = (*sharded)(x);
      backward(sum(mul(got, c_here)));
      expect_close(got, want.detach(), 1e-5, what + ": output");
      auto& p = dynamic_cast<LoraLinear&>(*plain_lora->layers().front().second);
      auto& s = dynamic_cast<LoraLinear&>(*lora->layers().front().second);
      expect_close(full_grad(s.lora_A(0)), p.lora_A(0).grad(), 1e-5, what + ": A's gradient");
      expect_close(full_grad(s.lora_B(0)), p.lora_B(0).grad(), 1e-5, what + ": B's gradient");
      expect_close(full_grad(s.lora_magnitude_vector(0)), p.lora_magnitude_vector(0).grad(), 1e-5,
                   what + ": m's gradient");
    }
  }
}

// ||got - want|| / ||want||.
double relative_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> a = values(got), b = values(want);
  double d = 0, w = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
    w += b[i] * b[i];
  }
  return std::sqrt(d / std::max(w, 1e-300));
}

// A bfloat16 base under float32 adapters, against one rank and against a float32 base holding
// the same (bfloat16) values. m's gradient reads the base product x W^T, which a row-parallel
// layer rounds to bfloat16 after summing the ranks' partial products (one rank rounds its whole
// product once), so m's gradient is one rank's within bfloat16's rounding (1e-2 relative, the
// norm of the difference over the norm), A's and B's within 1e-3; all three within 1e-2 of the
// float32 base's. Merge and unmerge run in float32 and round once.
TEST(LoraDora, Bfloat16BaseUnderRowParallelism) {
  const int64_t n = world_size();
  LoraConfig cfg = dora_config();
  cfg.target_modules = {"proj"};
  Generator gx(5);
  const Tensor x = randn({4, 64}, gx).to(DType::BFloat16);
  const Tensor c = randn({4, 16}, gx);
  struct Result {
    Tensor y, grad_a, grad_b, grad_m, merged;
  };
  auto run = [&](DType dtype, bool parallel) {
    Generator gen(1);
    auto lin = std::make_shared<Linear>(64, 16, false, gen);
    lin->weight = Parameter(lin->weight.full().to(DType::BFloat16).to(dtype), false);
    auto m = std::make_shared<OneLayer>(lin);
    auto lora = apply_lora(m, cfg);
    if (parallel) {
      auto row = std::make_shared<RowwiseParallel>();
      row->input_layouts = {Replicate()};
      parallelize_module(m, DeviceMesh(Shape{n}, {"tp"}), {{"proj", row}});
    }
    perturb_magnitude(*lora);
    Result r;
    r.y = cast((*m)(x.to(dtype)), DType::Float32);
    backward(sum(mul(r.y, c)));
    auto& l = dynamic_cast<LoraLinear&>(*lora->layers().front().second);
    r.grad_a = full_grad(l.lora_A(0));
    r.grad_b = full_grad(l.lora_B(0));
    r.grad_m = full_grad(l.lora_magnitude_vector(0));
    const Tensor w = l.weight.full().to(DType::Float32);
    lora->merge_adapter("default");
    r.merged = cast((*m)(x.to(dtype)), DType::Float32);
    lora->unmerge_adapter("default");
    EXPECT_LE(max_abs_diff(l.weight.full().to(DType::Float32), w), 1e-2)
        << dtype_name(dtype) << ": unmerge";
    return r;
  };
  const Result one = run(DType::BFloat16, false), f32 = run(DType::Float32, false);
  const Result tp = run(DType::BFloat16, n > 1);
  EXPECT_LE(relative_error(tp.grad_m, one.grad_m), 1e-2) << "m's gradient, row parallel";
  EXPECT_LE(relative_error(tp.grad_b, one.grad_b), 1e-3) << "B's gradient, row parallel";
  EXPECT_LE(relative_error(tp.grad_a, one.grad_a), 1e-3) << "A's gradient, row parallel";
  expect_close(tp.y, one.y, 1e-2, "output, row parallel");
  expect_close(one.y, f32.y, 2e-2, "output against float32");
  expect_close(one.merged, f32.merged, 3e-2, "merged output against float32");
  for (const auto& [name, got, want] :
       {std::tuple{"m", one.grad_m, f32.grad_m}, std::tuple{"B", one.grad_b, f32.grad_b},
        std::tuple{"A", one.grad_a, f32.grad_a}})
    EXPECT_LE(relative_error(got, want), 1e-2) << name << "'s gradient against float32";
  if (world_rank() == 0)
    std::printf(
        "[dora bf16] tp%lld against one rank: m %.2e, B %.2e, A %.2e; one rank against float32: "
        "m %.2e, B %.2e, A %.2e (relative)\n",
        (long long)n, relative_error(tp.grad_m, one.grad_m), relative_error(tp.grad_b, one.grad_b),
        relative_error(tp.grad_a, one.grad_a), relative_error(one.grad_m, f32.grad_m),
        relative_error(one.grad_b, f32.grad_b), relative_error(one.grad_a, f32.grad_a));
}

// DoRA fine-tuning, 10 steps, under every layout (TP column and row parallel, FSDP, FSDP x TP,
// HSDP): the losses, A, B and m of one process on the whole batch.
TEST(LoraDora, FineTuningMatchesSingleRank) {
  static const LoraTrained ref = [] {
    LoraRun run{"plain", std::make_shared<Decoder>(lora_decoder_config()), nullptr, 0, 1};
    run.lora = apply_lora(run.model, dora_config());
    return lora_train(run, 10);
  }();
  const auto initial = std::make_shared<Decoder>(lora_decoder_config())->state_dict();
  for (const LoraLayout& l : lora_layouts()) {
    LoraRun run = l.build(lora_decoder_config(), dora_config());
    expect_lora_parity(run, lora_train(run, 10), ref, initial, "DoRA " + l.name);
  }
  EXPECT_LT(ref.losses.back(), ref.losses.front() * 0.95) << "the reference trained nothing";
  // The magnitudes moved: a DoRA whose m never trained would pass the rest.
  LoraRun fresh{"plain", std::make_shared<Decoder>(lora_decoder_config()), nullptr, 0, 1};
  fresh.lora = apply_lora(fresh.model, dora_config());
  const auto start = fresh.lora->read_adapter("default");
  const std::string key = "layers.1.attention.wo.lora_magnitude_vector";
  EXPECT_GT(max_abs_diff(ref.adapter.at(key), start.at(key)), 1e-4);
}

// merge folds (m / ||W + scale B A||) (W + scale B A) into each rank's window of W, the norms
// global: the merged model gives the unmerged output within 1e-5, unmerge restores W within
// 1e-6, under every layout; safe_merge too.
TEST(LoraDora, MergeAndUnmergeUnderEveryLayout) {
  const DecoderConfig cfg = lora_decoder_config();
  const Batch batch = affine_batch(1, 4, cfg.max_seq_len, cfg.vocab_size);
  for (const LoraLayout& l : lora_layouts()) {
    for (const bool safe : {false, true}) {
      LoraRun run = l.build(cfg, dora_config());
      perturb_magnitude(*run.lora);
      const Tensor before = run.logits(batch.ids);
      const auto base = base_weights(*run.model);
      run.lora->merge_adapter("default", safe);
      expect_close(run.logits(batch.ids), before, 1e-5, l.name + ": merged output");
      EXPECT_GT(largest_change(*run.model, base), 1e-3) << l.name << ": merging changed nothing";
      run.lora->unmerge_adapter("default");
      EXPECT_LE(largest_change(*run.model, base), 1e-6) << l.name << ": unmerge";
      expect_close(run.logits(batch.ids), before, 1e-5, l.name + ": unmerged output");
    }
  }
}

// merge_and_unload with a DoRA adapter (one process, and TP over every rank): a plain model with
// the merged weights, giving the DoRA model's output, and no adapter keys left.
TEST(LoraDora, MergeAndUnloadGivesThePlainModelItsOutput) {
  const DecoderConfig cfg = lora_decoder_config();
  const Batch batch = affine_batch(2, 4, cfg.max_seq_len, cfg.vocab_size);
  for (const LoraLayout& l : lora_layouts()) {
    if (l.name.find("sdp") != std::string::npos) continue;  // refused under fully_shard
    LoraRun run = l.build(cfg, dora_config());
    perturb_magnitude(*run.lora);
    const Tensor before = run.logits(batch.ids);
    ModulePtr plain = run.lora->merge_and_unload();
    expect_close((*plain)(batch.ids), before, 1e-5, l.name + ": merged and unloaded");
    for (const auto& [name, p] : plain->named_parameters())
      EXPECT_EQ(name.find("lora_"), std::string::npos) << l.name << ": " << name;
  }
}

// PEFT's files for a DoRA adapter: the magnitude under PEFT's key (".weight" dropped), "use_dora":
// true in the config; loaded onto every layout the values and the output come back. A model
// whose slots hold no magnitude refuses the file, naming the adapter, and keeps nothing of it;
// a use_dora that is not a boolean is refused.
TEST(LoraDora, PeftFilesRoundTrip) {
  const std::string dir = scratch_dir("lora_dora");
  const DecoderConfig cfg = lora_decoder_config();
  const LoraSlots slots{.max_adapters = 2, .max_rank = 4, .use_dora = true};
  const auto layouts = lora_layouts(slots);
  LoraRun src = layouts.back().build(cfg, dora_config());
  perturb_magnitude(*src.lora);
  src.lora->save_adapter(dir + "/adapter", "default");
  const auto saved = src.lora->read_adapter("default");
  const Batch batch = affine_batch(3, 4, cfg.max_seq_len, cfg.vocab_size);
  const Tensor want = src.logits(batch.ids);
  if (world_rank() == 0) {
    const SafetensorsFile f = load_safetensors(dir + "/adapter/adapter_model.safetensors");
    EXPECT_EQ(f.tensors.size(), 3u * 14u);
    EXPECT_EQ(f.tensors.at("base_model.model.layers.0.attention.wq.lora_magnitude_vector").shape(),
              (Shape{32}));
    EXPECT_EQ(
        f.tensors.at("base_model.model.layers.1.feed_forward.w1.lora_magnitude_vector").shape(),
        (Shape{64}));
    std::ifstream j(dir + "/adapter/adapter_config.json");
    const std::string text((std::istreambuf_iterator<char>(j)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("\"use_dora\": true"), std::string::npos) << text;
  }
  world_group()->barrier()->wait();
  for (const LoraLayout& l : layouts) {
    LoraConfig other = lora_test_config();
    other.seed = 5;
    LoraRun run = l.build(cfg, other);
    run.lora->load_adapter(dir + "/adapter", "loaded", /*is_trainable=*/true);
    EXPECT_TRUE(run.lora->config("loaded").use_dora) << l.name;
    const auto got = run.lora->read_adapter("loaded");
    ASSERT_EQ(got.size(), saved.size()) << l.name;
    for (const auto& [k, t] : saved)
      expect_identical(got.at(k), t, l.name + " loaded " + k);
    run.lora->set_adapter("loaded");
    expect_close(run.logits(batch.ids), want, 1e-5, l.name + ": loaded DoRA output");
  }
  // For inference (is_trainable false), the magnitude stays frozen with A and B.
  LoraRun frozen = layouts.front().build(cfg, lora_test_config());
  frozen.lora->load_adapter(dir + "/adapter", "serve");
  for (Parameter* p : frozen.lora->adapter_parameters("serve"))
    EXPECT_FALSE(p->requires_grad()) << p->str();
  EXPECT_EQ(frozen.lora->adapter_parameters("serve").size(), 3u * 14u);
  // Slots without magnitudes: refused before anything changes.
  LoraRun no_m =
      lora_layouts({.max_adapters = 2, .max_rank = 4}).front().build(cfg, lora_test_config());
  expect_error([&] { no_m.lora->load_adapter(dir + "/adapter", "dora"); },
               {"adapter 'dora' uses DoRA", "LoraSlots::use_dora"});
  EXPECT_EQ(no_m.lora->adapters(), (std::vector<std::string>{"default"}));
  const std::string bad =
      peft_config_variant(dir, "not_bool", "\"use_dora\": true", "\"use_dora\": \"yes\"");
  expect_error([&] { frozen.lora->load_adapter(bad, "bad"); }, {"use_dora is not a boolean"});
}

// A DoRA and a LoRA adapter in one model, the DoRA one added after fully_shard (its magnitude
// then comes from W's shards): each gives what it gives alone; a mixed batch naming the DoRA
// adapter is refused (PEFT refuses DoRA with adapter_names) and one without it runs; the
// trainable counts include the magnitude slots.
TEST(LoraDora, SharesAModelWithLoraAdapters) {
  const DecoderConfig cfg = lora_decoder_config();
  const Batch batch = affine_batch(4, 4, cfg.max_seq_len, cfg.vocab_size);
  const LoraConfig plain_cfg = lora_test_config(LoraInit::Random);
  auto alone = [&](const LoraConfig& c, const std::string& name) {
    auto m = std::make_shared<Decoder>(cfg);
    auto l = apply_lora(m, c, name);
    if (c.use_dora) perturb_magnitude(*l, name);
    return (*m)(batch.ids);
  };
  const Tensor want_dora = alone(dora_config(), "dora");
  const Tensor want_plain = alone(plain_cfg, "default");
  for (const LoraLayout& l : lora_layouts({.max_adapters = 2, .max_rank = 4, .use_dora = true})) {
    LoraRun run = l.build(cfg, plain_cfg);
    run.lora->add_adapter("dora", dora_config());
    perturb_magnitude(*run.lora, "dora");
    expect_close(run.logits(batch.ids), want_plain, 1e-5, l.name + ": LoRA beside DoRA");
    run.lora->set_adapter("dora");
    expect_close(run.logits(batch.ids), want_dora, 1e-5, l.name + ": DoRA beside LoRA");
    const int64_t rows = 4;
    std::vector<int64_t> ids(size_t(rows), run.lora->adapter_id("default"));
    run.lora->set_batch_adapters(from_vector<int64_t>(ids, {rows}));
    expect_close(run.logits(batch.ids), want_plain, 1e-5, l.name + ": a mixed batch without DoRA");
    ids[1] = run.lora->adapter_id("dora");
    expect_error([&] { run.lora->set_batch_adapters(from_vector<int64_t>(ids, {rows})); },
                 {"adapter 'dora'", "uses DoRA", "adapter_names"});
    run.lora->set_batch_adapters(Tensor());
    // Counts: every slot's A [4, in], B [out, 4] and m [out] in every wrapped layer.
    int64_t slots = 0;
    for (const auto& [path, layer] : run.lora->layers())
      slots += 2 * (4 * layer->lora_in() + 5 * layer->lora_out());
    const auto [trainable, all] = run.lora->get_nb_trainable_parameters();
    EXPECT_EQ(trainable, slots) << l.name;
    EXPECT_GT(all, trainable) << l.name;
    EXPECT_EQ(run.lora->adapter_parameters("dora").size(), 3u * 14u) << l.name;
    EXPECT_EQ(run.lora->adapter_parameters("default").size(), 2u * 14u) << l.name;
  }
}

// The adapter table keeps use_dora (an adapter restored into a model that added it as LoRA
// becomes DoRA again), a table written before the field existed loads as LoRA, and a DoRA
// adapter saved merged is refused, naming it: its unmerge norms are in no checkpoint.
TEST(LoraDora, AdapterTableKeepsUseDora) {
  const DecoderConfig cfg = lora_decoder_config();
  const LoraSlots slots{.max_adapters = 2, .max_rank = 4, .use_dora = true};
  auto m = std::make_shared<Decoder>(cfg);
  auto lora = apply_lora(m, dora_config(), "default", slots);
  const StateDict table = lora->state_dict();
  const std::string text = std::get<std::string>(table.at("adapters"));
  EXPECT_NE(text.find("\"use_dora\":true"), std::string::npos) << text;
  EXPECT_NE(text.find("\"format\":2"), std::string::npos) << text;
  auto m2 = std::make_shared<Decoder>(cfg);
  auto other = apply_lora(m2, lora_test_config(), "default", slots);
  other->load_state_dict(table);
  EXPECT_TRUE(other->config("default").use_dora);
  // An older table: no use_dora field.
  auto m3 = std::make_shared<Decoder>(cfg);
  auto lora3 = apply_lora(m3, lora_test_config(), "default", slots);
  std::string old = std::get<std::string>(lora3->state_dict().at("adapters"));
  const std::string field = "\"use_dora\":false,";
  ASSERT_NE(old.find(field), std::string::npos) << old;
  old.erase(old.find(field), field.size());
  other->load_state_dict(StateDict{{"adapters", old}});
  EXPECT_FALSE(other->config("default").use_dora);
  // Merged DoRA.
  lora->merge_adapter("default");
  expect_error([&] { other->load_state_dict(lora->state_dict()); },
               {"adapter 'default'", "DoRA adapter saved merged"});
  EXPECT_FALSE(other->config("default").use_dora) << "the refused table changed the model";
}
