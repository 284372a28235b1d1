// Tensor parallelism end to end: the styles on single layers, the decoder plan (plain, sequence
// parallel, loss parallel, tied embeddings) trained with AdamW against the same decoder trained
// unparallelized in the same process, gradients, state dicts across degrees, and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "common/affine_batch.h"
#include "tessera/tessera.h"
#include "tessera/testing.h"

using namespace tessera;
using tessera::testing::affine_batch;
using tessera::testing::Batch;
using tessera::testing::error_of;
using tessera::testing::expect_error;

namespace {

constexpr int64_t kBatch = 4;
constexpr int64_t kSeq = 16;
constexpr int kSteps = 30;

DecoderConfig tiny_config(bool tied = false) {
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
DeviceMesh tp_mesh(int64_t tp) {
  const int64_t n = world_size();
  return DeviceMesh(Shape{n / tp, tp}, {"dp", "tp"})["tp"];
}

Batch make_batch(int step, int64_t vocab, int64_t seq = kSeq) {
  return affine_batch(step, kBatch, seq, vocab);
}

struct Variant {
  const char* name;
  DecoderTPOptions opts;
};

const std::vector<Variant>& variants() {
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

Model build(const DecoderConfig& cfg, const DeviceMesh* mesh, DecoderTPOptions opts = {}) {
  Model m{std::make_shared<Decoder>(cfg), mesh, mesh != nullptr && opts.loss_parallel};
  if (mesh) parallelize_module(m.net, *mesh, decoder_tp_plan(cfg, *mesh, opts));
  return m;
}

Tensor loss_of(Model& m, const Batch& b) {
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
Trajectory train(Model m, int steps, int64_t seq = kSeq) {
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

const std::map<std::string, Tensor>& final_state(const Trajectory& t) {
  return t.parameters.rbegin()->second;
}

// The reference run is the same for every variant and test: compute it once per config.
const Trajectory& reference_run(bool tied) {
  static std::map<bool, Trajectory> cache;
  auto it = cache.find(tied);
  if (it == cache.end())
    it = cache.emplace(tied, train(build(tiny_config(tied), nullptr), kSteps)).first;
  return it->second;
}

// |got - want| <= tol * max(1, |want|) elementwise, or with `relative_to_max`,
// |got - want| <= tol * max|want|: the gradients of a mean loss are far below 1, and would pass
// any absolute test.
void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what,
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
void expect_same_state(const std::map<std::string, Tensor>& got,
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
void expect_same_training(const Trajectory& run, const Trajectory& ref, const std::string& what) {
  const tessera::testing::ParityOptions opts{
      .steps = int(ref.losses.size()), .loss = {1e-5, 0}, .parameters = {1e-5, 1e-5}};
  const tessera::testing::ParityResult r = tessera::testing::compare_trajectories(run, ref, opts);
  EXPECT_FALSE(r.divergence) << what << ": " << r.str();
}

Tensor global_randn(const Shape& s, uint64_t seed) {
  Generator g(seed);
  return randn(s, g);
}

// This rank's chunk of `full` along `dim` (torch.chunk over the mesh).
Tensor chunk_of(const Tensor& full, int64_t dim, const DeviceMesh& mesh) {
  return distribute_tensor(full, mesh, {Shard(dim)}).to_local().clone();
}

}  // namespace

// --- the styles on single layers ---

TEST(TensorParallelStyles, ColwiseAndRowwiseLinearMatchPlain) {
  DeviceMesh mesh = tp_mesh(world_size());
  Generator g1(5), g2(5);
  auto col = std::make_shared<Linear>(6, 12, true, g1);
  auto row = std::make_shared<Linear>(12, 5, true, g1);
  auto col_ref = std::make_shared<Linear>(6, 12, true, g2);
  auto row_ref = std::make_shared<Linear>(12, 5, true, g2);
  ColwiseParallel{}.apply(*col, mesh);
  RowwiseParallel{}.apply(*row, mesh);
  EXPECT_EQ(col->weight.dtensor().placements(), Placements{Shard(0)});
  EXPECT_EQ(col->bias.dtensor().placements(), Placements{Shard(0)});
  EXPECT_EQ(row->weight.dtensor().placements(), Placements{Shard(1)});
  EXPECT_EQ(row->bias.dtensor().placements(), Placements{Replicate()});

  Tensor x = global_randn({3, 4, 6}, 7);
  Tensor h = (*col)(x);  // Shard(-1) output: this rank's feature slice
  Tensor h_ref = (*col_ref)(x);
  expect_close(h, chunk_of(h_ref, 2, mesh), 1e-6, "colwise local output");
  Tensor y = (*row)(h);  // Shard(-1) input, partial sums all-reduced
  Tensor y_ref = (*row_ref)(h_ref);
  expect_close(y, y_ref, 1e-5, "rowwise output");

  Tensor w = global_randn(y_ref.shape(), 8);
  backward(sum(mul(y, w)));
  backward(sum(mul(y_ref, w)));
  expect_close(col->weight.grad_dtensor().full_tensor(), col_ref->weight.grad(), 1e-5,
               "colwise dW");
  expect_close(col->bias.grad_dtensor().full_tensor(), col_ref->bias.grad(), 1e-5, "colwise db");
  expect_close(row->weight.grad_dtensor().full_tensor(), row_ref->weight.grad(), 1e-5,
               "rowwise dW");
  // A replicated bias is added once, and its gradient counted once.
  expect_close(row->bias.grad_dtensor().full_tensor(), row_ref->bias.grad(), 1e-5, "rowwise db");
}

TEST(TensorParallelStyles, EmbeddingColwiseAndRowwiseMatchPlain) {
  DeviceMesh mesh = tp_mesh(world_size());
  Tensor ids = from_vector<int64_t>({0, 9, 3, 3, 7, 1, 8, 2}, {2, 4});
  Tensor w = global_randn({2, 4, 8}, 11);
  for (bool rowwise : {false, true}) {
    Generator g1(9), g2(9);
    auto emb = std::make_shared<Embedding>(10, 8, g1);
    auto ref = std::make_shared<Embedding>(10, 8, g2);
    if (rowwise) {
      RowwiseParallel s;  // vocabulary parallel
      s.input_layouts = {Replicate()};
      s.apply(*emb, mesh);
      EXPECT_EQ(emb->weight.dtensor().placements(), Placements{Shard(0)});
    } else {
      ColwiseParallel s;
      s.output_layouts = {Replicate()};
      s.apply(*emb, mesh);
      EXPECT_EQ(emb->weight.dtensor().placements(), Placements{Shard(1)});
    }
    const std::string what = rowwise ? "rowwise embedding" : "colwise embedding";
    Tensor y = (*emb)(ids), y_ref = (*ref)(ids);
    expect_close(y, y_ref, 0, what);
    backward(sum(mul(y, w)));
    backward(sum(mul(y_ref, w)));
    expect_close(emb->weight.grad_dtensor().full_tensor(), ref->weight.grad(), 1e-6, what + " dW");
  }
}

TEST(TensorParallelStyles, SequenceParallelLayerNormSumsWeightGradients) {
  DeviceMesh mesh = tp_mesh(world_size());
  auto ln = std::make_shared<LayerNorm>(6), ref = std::make_shared<LayerNorm>(6);
  SequenceParallel{}.apply(*ln, mesh);
  EXPECT_EQ(ln->weight.dtensor().placements(), Placements{Replicate()});
  Tensor x = global_randn({2, 8, 6}, 12), w = global_randn({2, 8, 6}, 13);
  Tensor y = (*ln)(chunk_of(x, 1, mesh));
  Tensor y_ref = (*ref)(x);
  expect_close(y, chunk_of(y_ref, 1, mesh), 1e-6, "sequence-parallel LayerNorm");
  backward(sum(mul(y, chunk_of(w, 1, mesh))));
  backward(sum(mul(y_ref, w)));
  // Each rank saw only its tokens: the replicated weights' gradients are summed over the ranks.
  expect_close(ln->weight.grad_dtensor().full_tensor(), ref->weight.grad(), 1e-5, "dweight");
  expect_close(ln->bias.grad_dtensor().full_tensor(), ref->bias.grad(), 1e-5, "dbias");
}

// Under SequenceParallel a Dropout draws the mask one process would draw for the whole sequence.
TEST(TensorParallelStyles, SequenceParallelDropoutIsTheUnshardedDropout) {
  DeviceMesh mesh = tp_mesh(world_size());
  auto drop = std::make_shared<Dropout>(0.3);
  SequenceParallel{}.apply(*drop, mesh);
  Tensor x = global_randn({2, 9, 4}, 15), w = global_randn({2, 9, 4}, 16);  // 9: uneven chunks
  manual_seed(77);
  default_generator().set_offset(5);
  Tensor xl = chunk_of(x, 1, mesh).set_requires_grad(true);
  Tensor y = (*drop)(xl);
  Generator ref_gen(77);
  ref_gen.set_offset(5);
  Tensor xr = x.clone().set_requires_grad(true);
  Tensor y_ref = dropout(xr, 0.3, true, ref_gen);
  expect_close(y, chunk_of(y_ref, 1, mesh), 0, "this rank's tokens of the unsharded dropout");
  EXPECT_EQ(default_generator().offset(), ref_gen.offset());  // advanced by the global numel
  backward(sum(mul(y, chunk_of(w, 1, mesh))));
  backward(sum(mul(y_ref, w)));
  expect_close(xl.grad(), chunk_of(xr.grad(), 1, mesh), 0, "input gradient");
  drop->eval();
  expect_close((*drop)(xl), xl, 0, "eval is the identity");
}

TEST(TensorParallelStyles, PrepareModuleInputGathersTheInput) {
  DeviceMesh mesh = tp_mesh(world_size());
  Generator g1(3), g2(3);
  auto lin = std::make_shared<Linear>(5, 3, false, g1),
       ref = std::make_shared<Linear>(5, 3, false, g2);
  PrepareModuleInput s;
  s.input_layouts = {Shard(0)};
  s.desired_input_layouts = {Replicate()};
  s.apply(*lin, mesh);
  Tensor xg = global_randn({8, 5}, 14);
  Tensor x = chunk_of(xg, 0, mesh).set_requires_grad(true);
  Tensor y = (*lin)(x);  // the plain Linear receives the gathered [8, 5]
  Tensor y_ref = (*ref)(xg);
  expect_close(y, y_ref, 1e-6, "output on the gathered input");
  backward(sum(y));
  Tensor xr = xg.clone().set_requires_grad(true);
  backward(sum((*ref)(xr)));
  expect_close(x.grad(), chunk_of(xr.grad(), 0, mesh), 1e-6, "input gradient is this rank's chunk");
}

TEST(TensorParallelStyles, PrepareModuleOutputShardsTheOutput) {
  DeviceMesh mesh = tp_mesh(world_size());
  Generator g1(3), g2(3);
  auto lin = std::make_shared<Linear>(5, 3, false, g1),
       ref = std::make_shared<Linear>(5, 3, false, g2);
  PrepareModuleOutput s;
  s.output_layouts = {Replicate()};
  s.desired_output_layouts = {Shard(0)};
  parallelize_module(lin, mesh, {{"", std::make_shared<PrepareModuleOutput>(s)}});
  Tensor x = global_randn({8, 5}, 14);
  expect_close((*lin)(x), chunk_of((*ref)(x), 0, mesh), 0, "this rank's rows of the output");
}

// A plan key of '*' names the children, not the root (PyTorch matches keys against children).
TEST(TensorParallelStyles, WildcardPlanKeyNamesChildrenNotTheRoot) {
  struct TwoLinears : Module {
    std::shared_ptr<Linear> a, b;
    explicit TwoLinears(Generator& g) : Module("TwoLinears") {
      a = std::make_shared<Linear>(4, 6, true, g);
      b = std::make_shared<Linear>(4, 6, true, g);
      register_module("a", a);
      register_module("b", b);
    }
  };
  DeviceMesh mesh = tp_mesh(world_size());
  Generator g(4);
  auto m = std::make_shared<TwoLinears>(g);
  parallelize_module(m, mesh, {{"*", std::make_shared<ColwiseParallel>()}});
  EXPECT_EQ(m->a->weight.dtensor().placements(), Placements{Shard(0)});
  EXPECT_EQ(m->b->weight.dtensor().placements(), Placements{Shard(0)});
}

// As PyTorch's src_data_rank = 0: the parallel layer is the first rank's layer even where the
// ranks initialised differently, and its replicated bias is equal on every rank.
TEST(TensorParallelStyles, ParametersComeFromTheMeshsFirstRank) {
  DeviceMesh mesh = tp_mesh(world_size());
  Generator mine(100 + uint64_t(world_rank())), first(100);
  auto row = std::make_shared<Linear>(8, 3, true, mine);
  auto ref = std::make_shared<Linear>(8, 3, true, first);  // what rank 0 built
  RowwiseParallel{}.apply(*row, mesh);
  expect_close(row->weight.dtensor().full_tensor(), ref->weight.local(), 0, "weight");
  expect_close(row->bias.dtensor().to_local(), ref->bias.local(), 0, "replicated bias");
}

// A Linear whose input arrives sharded on dim 0 over `mesh` and is gathered before it.
std::shared_ptr<Linear> linear_on_dim0_pieces(const DeviceMesh& mesh) {
  Generator g(3);
  auto lin = std::make_shared<Linear>(5, 3, false, g);
  PrepareModuleInput s;
  s.input_layouts = {Shard(0)};
  s.desired_input_layouts = {Replicate()};
  s.apply(*lin, mesh);
  return lin;
}

// Pieces not cut as torch.chunk cuts them make every rank fail with the sizes, none wait.
TEST(TensorParallelStyles, PiecesNotCutAsChunkFailOnEveryRank) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "one rank holds the whole sequence";
  DeviceMesh mesh = tp_mesh(n);
  auto lin = linear_on_dim0_pieces(mesh);
  const int64_t total = 2 * n + 1;  // chunk: (3, 2) over 2 ranks, (3, 3, 3, 0) over 4
  const int64_t rows = chunk_of(total, n, n - 1 - world_rank()).length;  // the chunks reversed
  const std::string msg = error_of([&] { (*lin)(zeros({rows, 5})); });
  TESSERA_EXPECT_CONTAINS(msg, "PrepareModuleInput on Linear: the ranks' pieces along dim 0");
  TESSERA_EXPECT_CONTAINS(msg, n == 2 ? "sizes (2, 3)" : "sizes (0, 3, 3, 3)");
  TESSERA_EXPECT_CONTAINS(msg, n == 2 ? "pieces (3, 2)" : "pieces (3, 3, 3, 0)");
}

// Pieces that differ in a dim no mesh dim shards (a batch of another size on one rank) make
// every rank fail with the shapes, before any rank gathers pieces of different sizes.
TEST(TensorParallelStyles, PiecesDifferingOutsideTheShardedDimFailOnEveryRank) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "one rank has no other rank to differ from";
  DeviceMesh mesh = tp_mesh(n);
  auto lin = linear_on_dim0_pieces(mesh);
  const int64_t batch = world_rank() == 1 ? 3 : 2;
  const std::string msg = error_of([&] { (*lin)(zeros({2, batch, 5})); });
  TESSERA_EXPECT_CONTAINS(msg, "PrepareModuleInput on Linear: the ranks' pieces");
  TESSERA_EXPECT_CONTAINS(msg, "[2, 3, 5]");
  // A piece of another rank (dims) fails the same way on every rank.
  const std::string msg2 = error_of([&] {
    (*lin)(world_rank() == 1 ? zeros({2, 5}) : zeros({2, 1, 5}));
  });
  TESSERA_EXPECT_CONTAINS(msg2, "PrepareModuleInput on Linear: the ranks' pieces");
}

// On a mesh of two dims, pieces that only one group along the first mesh dim finds wrong (one
// data-parallel replica's second tensor-parallel piece is longer, cut as torch.chunk along tp
// but not matching its dp neighbour) make every rank of the mesh fail, not only that group's:
// the other ranks would otherwise wait for them in the gather along the second mesh dim.
TEST(TensorParallelStyles, PiecesWrongInOneGroupOfATwoDimMeshFailOnEveryRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs a 2x2 mesh";
  DeviceMesh mesh(Shape{2, 2}, {"dp", "tp"});
  Generator g(3);
  auto lin = std::make_shared<Linear>(5, 3, false, g);
  PrepareModuleInput s;
  s.input_layouts = {Shard(0), Shard(1)};
  s.desired_input_layouts = {Replicate(), Replicate()};
  s.apply(*lin, mesh);
  // Dim 1 pieces: (2, 2) along tp on dp 0 and (3, 2) on dp 1, both chunks; along dp, the tp 0
  // ranks (world 0 and 2) hold 2 and 3 rows there, which dp alone does not shard.
  const int64_t len = world_rank() == 2 ? 3 : 2;
  const std::string msg = error_of([&] { (*lin)(zeros({2, len, 5})); });
  TESSERA_EXPECT_CONTAINS(msg, "PrepareModuleInput on Linear: the ranks' pieces");
  TESSERA_EXPECT_CONTAINS(msg, "[2, 3, 5]");
  // The mesh is still usable: a call with pieces cut right goes through on every rank.
  const Tensor y = (*lin)(zeros({2, 2, 5}));
  EXPECT_EQ(y.shape(), (Shape{4, 4, 3}));
}

// --- the decoder plan ---

TEST(TensorParallel, PlanShardsTheProjectionsAndKeepsNames) {
  const DecoderConfig cfg = tiny_config();
  const int64_t tp = world_size();
  DeviceMesh mesh = tp_mesh(tp);
  for (bool sp : {false, true}) {
    Model m = build(cfg, &mesh, {sp, false});
    Model ref = build(cfg, nullptr);
    auto named = m.net->named_parameters(), ref_named = ref.net->named_parameters();
    ASSERT_EQ(named.size(), ref_named.size());
    for (size_t i = 0; i < named.size(); ++i) {
      const auto& [name, p] = named[i];
      EXPECT_EQ(name, ref_named[i].first);
      EXPECT_EQ(p->global_shape(), ref_named[i].second->global_shape()) << name;
      auto ends = [&](const std::string& s) {
        return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
      };
      Placements want;
      if (ends("wq.weight") || ends("wk.weight") || ends("wv.weight") || ends("w1.weight") ||
          ends("w3.weight") || name == "output.weight" || name == "tok_embeddings.weight")
        want = {Shard(0)};
      else if (ends("wo.weight") || ends("w2.weight"))
        want = {Shard(1)};
      else if (sp)
        want = {Replicate()};  // norms under sequence parallelism
      if (want.empty()) {
        EXPECT_FALSE(p->is_dtensor()) << name << " " << p->str();
        continue;
      }
      ASSERT_TRUE(p->is_dtensor()) << name;
      EXPECT_EQ(p->dtensor().placements(), want) << name;
      Shape local = p->global_shape();
      if (want[0].is_shard()) local[size_t(want[0].dim())] /= tp;
      EXPECT_EQ(p->local().shape(), local) << name;
    }
  }
}

TEST(TensorParallel, TrainingMatchesUnparallelizedDecoder) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  const Trajectory& ref = reference_run(false);
  // The reference learns: otherwise matching it would prove little.
  EXPECT_LT(ref.losses.back(), 0.7 * ref.losses.front());
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name);
    expect_same_training(train(build(cfg, &mesh, v.opts), kSteps), ref, v.name);
  }
}

TEST(TensorParallel, UnevenShardsTrainLikeTheUnparallelizedDecoder) {
  // Over 4 ranks: ffn 66 -> 17, 17, 17, 15 columns; vocabulary 50 -> 13, 13, 13, 11 rows;
  // sequence 15 -> 4, 4, 4, 3 tokens under sequence parallelism (over 2: 33/33, 25/25, 8/7).
  DecoderConfig cfg = tiny_config();
  cfg.ffn_dim = 66;
  cfg.vocab_size = 50;
  constexpr int64_t kUnevenSeq = 15;
  constexpr int kUnevenSteps = 10;
  DeviceMesh mesh = tp_mesh(world_size());
  const Trajectory ref = train(build(cfg, nullptr), kUnevenSteps, kUnevenSeq);
  for (const Variant& v : variants())
    expect_same_training(train(build(cfg, &mesh, v.opts), kUnevenSteps, kUnevenSeq), ref, v.name);
}

TEST(TensorParallel, TiedEmbeddingsTrainLikeTheUnparallelizedDecoder) {
  const DecoderConfig cfg = tiny_config(/*tied=*/true);
  DeviceMesh mesh = tp_mesh(world_size());
  const Trajectory& ref = reference_run(true);
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name);
    Model m = build(cfg, &mesh, v.opts);
    EXPECT_FALSE(m.net->tok_embeddings->weight.is_dtensor()) << "the tied weight stays replicated";
    expect_same_training(train(m, kSteps), ref, v.name);
  }
}

TEST(TensorParallel, RepeatedRunsAreBitIdentical) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  Trajectory a = train(build(cfg, &mesh, {true, true}), kSteps);
  Trajectory b = train(build(cfg, &mesh, {true, true}), kSteps);
  EXPECT_EQ(a.losses, b.losses);
  expect_same_state(final_state(a), final_state(b), 0, "second run");
}

TEST(TensorParallel, GradientsMatchUnparallelizedDecoder) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  const Batch batch = make_batch(0, cfg.vocab_size);
  Model ref = build(cfg, nullptr);
  backward(loss_of(ref, batch));
  auto ref_params = ref.net->named_parameters();
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name);
    Model m = build(cfg, &mesh, v.opts);
    backward(loss_of(m, batch));
    auto params = m.net->named_parameters();
    ASSERT_EQ(params.size(), ref_params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, p] = params[i];
      ASSERT_TRUE(p->grad().defined()) << name;
      Tensor full = p->grad();
      if (p->is_dtensor()) {
        DTensor g = p->grad_dtensor();
        EXPECT_EQ(g.placements(), p->dtensor().placements()) << name;
        full = g.full_tensor();
      }
      expect_close(full, ref_params[i].second->grad(), 1e-5, name, /*relative_to_max=*/true);
    }
  }
}

TEST(TensorParallel, StateDictIsTheUnparallelizedOne) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  for (const Variant& v : variants()) {
    Model m = build(cfg, &mesh, v.opts);
    expect_same_state(m.net->state_dict(), build(cfg, nullptr).net->state_dict(), 0, v.name);
  }
}

TEST(TensorParallel, StateDictLoadsIntoEveryDegree) {
  const DecoderConfig cfg = tiny_config();
  const int64_t n = world_size();
  DeviceMesh mesh = tp_mesh(n);
  // Trained a little, so the weights are no longer what any seed draws.
  Model src = build(cfg, &mesh);
  train(src, 3);
  const std::map<std::string, Tensor> state = src.net->state_dict();
  const Batch batch = make_batch(100, cfg.vocab_size);
  Tensor want;
  {
    NoGradGuard no_grad;
    want = (*src.net)(batch.ids);  // Replicate output: the whole logits
  }
  DecoderConfig other = cfg;
  other.seed = cfg.seed + 1;
  std::vector<DeviceMesh> meshes;
  for (int64_t tp = 1; tp <= n; ++tp)
    if (n % tp == 0) meshes.push_back(tp_mesh(tp));
  for (size_t i = 0; i <= meshes.size(); ++i) {
    const bool plain = i == meshes.size();
    const std::string what = plain ? "unparallelized" : "tp=" + std::to_string(meshes[i].size());
    for (bool sp : plain ? std::vector<bool>{false} : std::vector<bool>{false, true}) {
      Model dst = build(other, plain ? nullptr : &meshes[i], {sp, false});
      ASSERT_NE(dst.net->state_dict().at("output.weight").to_vector<float>(),
                state.at("output.weight").to_vector<float>());
      dst.net->load_state_dict(state);
      expect_same_state(dst.net->state_dict(), state, 0, what + " after load");
      NoGradGuard no_grad;
      expect_close((*dst.net)(batch.ids), want, 1e-5, what + " logits");
    }
  }
}

// --- errors ---

TEST(TensorParallelErrors, HeadsNotDivisibleByTheDegree) {
  const int64_t n = world_size();
  if (n == 1) GTEST_SKIP() << "every head count divides by 1";
  DecoderConfig cfg = tiny_config();
  cfg.dim = 48;
  cfg.n_heads = 6;
  cfg.n_kv_heads = 3;  // odd: divides by neither 2 nor 4
  expect_error([&] { decoder_tp_plan(cfg, tp_mesh(n)); },
               {"heads not divisible by the tensor-parallel degree", "n_heads = 6",
                "n_kv_heads = 3", "tensor-parallel degree = " + std::to_string(n)});
}

// A hand-written plan that splits heads unevenly (one head of 6 features over 4 ranks: 2, 2, 2,
// 0) leaves ranks 0-2 partial heads while rank 3 holds none and would go on into wo's
// all-gather: every rank refuses, naming a position whose share is not whole heads.
TEST(TensorParallelErrors, AnUnevenHeadSplitFailsOnEveryRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DecoderConfig cfg = tiny_config();
  cfg.dim = 6;
  cfg.n_heads = 1;
  cfg.n_kv_heads = 1;
  Generator gen(3);
  auto attn = std::make_shared<Attention>(cfg, gen);
  parallelize_module(attn, tp_mesh(4),
                     {{"wq", std::make_shared<ColwiseParallel>()},
                      {"wk", std::make_shared<ColwiseParallel>()},
                      {"wv", std::make_shared<ColwiseParallel>()},
                      {"wo", std::make_shared<RowwiseParallel>()}});
  const Tensor x = tessera::testing::random_tensor({1, 4, 6}, 5, DType::Float32);
  expect_error([&] { (*attn)(x); }, {"Attention: the tensor-parallel split gives mesh position 0",
                                     "q width 2", "not whole heads of head_dim 6"});
}

TEST(TensorParallelErrors, PatternMatchingNothingNamesItAndChangesNothing) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  auto net = std::make_shared<Decoder>(cfg);
  auto col = std::make_shared<const ColwiseParallel>();
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"layers.*.attention.wz", col}});
      },
      {"'layers.*.attention.wz'", "matches no module", "wq, wk, wv, wo"});
  // '*' stands for exactly one path component.
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"layers.*.attention.wq", col}, {"layers.*.wq", col}});
      },
      {"'layers.*.wq'", "attention_norm"});
  // The first pattern was fine, but nothing is applied before every pattern has matched.
  EXPECT_FALSE(net->layers[0]->attention->wq->weight.is_dtensor());
  EXPECT_FALSE(net->layers[0]->attention->wq->dtensor_io().has_value());
  // Within a component '*' matches any run of characters, as fnmatch does.
  parallelize_module(net, mesh, {{"layers.*.feed_forward.w*", col}});
  for (const auto& layer : net->layers) {
    EXPECT_TRUE(layer->feed_forward->w1->weight.is_dtensor());
    EXPECT_TRUE(layer->feed_forward->w2->weight.is_dtensor());
    EXPECT_TRUE(layer->feed_forward->w3->weight.is_dtensor());
    EXPECT_FALSE(layer->attention->wq->weight.is_dtensor());
  }
}

TEST(TensorParallelErrors, StyleOnTheWrongModuleType) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  auto net = std::make_shared<Decoder>(cfg);
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"norm", std::make_shared<ColwiseParallel>()}});
      },
      {"ColwiseParallel", "Linear or Embedding", "RMSNorm"});
  expect_error(
      [&] {
        parallelize_module(net, mesh,
                           {{"layers.0.attention", std::make_shared<RowwiseParallel>()}});
      },
      {"RowwiseParallel", "Attention"});
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"output", std::make_shared<SequenceParallel>()}});
      },
      {"SequenceParallel", "RMSNorm, LayerNorm or Dropout", "Linear"});
  // A second style on an already sharded layer would cut its shards again.
  parallelize_module(net, mesh, {{"output", std::make_shared<ColwiseParallel>()}});
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"output", std::make_shared<RowwiseParallel>()}});
      },
      {"RowwiseParallel", "already tensor-parallel"});
}

// Every style checks every target before any style changes the model: a plan refused for its
// last entry (a wrong module type, a module taken twice, a plan applied again) leaves the model
// as it was, where the entries before it used to stay applied.
TEST(TensorParallelErrors, ARefusedPlanChangesNothing) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  auto net = std::make_shared<Decoder>(cfg);
  auto col = std::make_shared<const ColwiseParallel>();
  auto untouched = [&](const char* what) {
    EXPECT_FALSE(net->layers[0]->attention->wq->weight.is_dtensor()) << what;
    EXPECT_FALSE(net->layers[0]->attention->wq->dtensor_io().has_value()) << what;
  };
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"layers.*.attention.wq", col}, {"norm", col}});
      },
      {"ColwiseParallel", "Linear or Embedding", "RMSNorm"});
  untouched("a wrong type last");
  expect_error(
      [&] {
        parallelize_module(net, mesh,
                           {{"layers.*.attention.wq", col},
                            {"layers.0.attention.wq", std::make_shared<RowwiseParallel>()}});
      },
      {"'layers.0.attention.wq' is targeted by 'layers.*.attention.wq' and by "
       "'layers.0.attention.wq'"});
  untouched("a module taken twice");
  const ParallelizePlan plan = decoder_tp_plan(cfg, mesh, {.sequence_parallel = true});
  parallelize_module(net, mesh, plan);
  const Batch b = affine_batch(0, 2, cfg.max_seq_len, cfg.vocab_size);
  const Tensor logits = (*net)(b.ids);
  expect_error([&] { parallelize_module(net, mesh, plan); }, {"already"});
  // The refused second plan added no hook: the same logits, of the full shape.
  tessera::testing::expect_close(logits, (*net)(b.ids), 0, "after the refused second plan");
}

// A target refused on one rank only (its model differs there: the output layer is already
// tensor-parallel) is refused on every rank, naming that rank, before any rank changes anything:
// the others used to go on into the first target's distribution and wait there for the rank
// that had thrown.
TEST(TensorParallelErrors, ATargetRefusedOnOneRankIsRefusedOnEveryRank) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "one rank has no other rank to differ from";
  DeviceMesh mesh = tp_mesh(n);
  auto net = std::make_shared<Decoder>(tiny_config());
  if (world_rank() == n - 1)
    net->output->set_dtensor_io(DTensorIO{mesh, {Replicate()}, {Replicate()}, {Replicate()}});
  auto col = std::make_shared<const ColwiseParallel>();
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"layers.*.attention.wq", col}, {"output", col}});
      },
      {"parallelize_module(Decoder)", "[rank " + std::to_string(n - 1) + "]",
       "already tensor-parallel"});
  for (const auto& layer : net->layers) {
    EXPECT_FALSE(layer->attention->wq->weight.is_dtensor());
    EXPECT_FALSE(layer->attention->wq->dtensor_io().has_value());
  }
  EXPECT_FALSE(net->output->weight.is_dtensor());
}

// A parameter whose shape differs on one rank (a model built with another vocabulary there) is
// found before anything is distributed: every rank throws, naming both shapes, and the first
// target is left as it was, where it used to be distributed before the second one's
// distribution failed.
TEST(TensorParallelErrors, ParametersDifferingAcrossRanksChangeNothing) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "one rank has no other rank to differ from";
  DeviceMesh mesh = tp_mesh(n);
  DecoderConfig cfg = tiny_config();
  if (world_rank() == n - 1) cfg.vocab_size = 40;
  auto net = std::make_shared<Decoder>(cfg);
  auto col = std::make_shared<const ColwiseParallel>();
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"layers.*.attention.wq", col}, {"output", col}});
      },
      {"parallelize_module(Decoder)", "[rank " + std::to_string(n - 1) + "]", "differs from rank 0",
       "'output.weight' float32 [48, 32]", "'output.weight' float32 [40, 32]"});
  for (const auto& layer : net->layers) {
    EXPECT_FALSE(layer->attention->wq->weight.is_dtensor());
    EXPECT_FALSE(layer->attention->wq->dtensor_io().has_value());
  }
  EXPECT_FALSE(net->output->weight.is_dtensor());
}

// A style given other layouts on one rank would make that rank run other collectives in every
// forward (an all-gather of the output where the others keep their slices): refused on every
// rank before anything changes, naming both.
TEST(TensorParallelErrors, LayoutsDifferingAcrossRanksAreRefused) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "one rank has no other rank to differ from";
  DeviceMesh mesh = tp_mesh(n);
  auto net = std::make_shared<Decoder>(tiny_config());
  auto col = std::make_shared<ColwiseParallel>();
  if (world_rank() == n - 1) col->output_layouts = {Replicate()};
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"output", col}});
      },
      {"parallelize_module(Decoder)", "[rank " + std::to_string(n - 1) + "]",
       "ColwiseParallel(input [R], output [S(-1)])", "ColwiseParallel(input [R], output [R])"});
  EXPECT_FALSE(net->output->weight.is_dtensor());
  EXPECT_FALSE(net->output->dtensor_io().has_value());
}

// A parameter tied by assignment to another name would be distributed under one name only: the
// style is refused, naming both, before anything changes.
TEST(TensorParallelErrors, DistributingATiedParameterIsRefused) {
  const DecoderConfig cfg = tiny_config();
  DeviceMesh mesh = tp_mesh(world_size());
  auto net = std::make_shared<Decoder>(cfg);
  net->output->weight = net->tok_embeddings->weight;  // tied by assignment
  auto row = std::make_shared<RowwiseParallel>();
  row->input_layouts = {Replicate()};
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"tok_embeddings", row}});
      },
      {"would distribute 'tok_embeddings.weight'", "shared with 'output.weight'",
       "tied by assignment"});
  EXPECT_FALSE(net->tok_embeddings->weight.is_dtensor());
  EXPECT_FALSE(net->tok_embeddings->dtensor_io().has_value());
}

TEST(TensorParallelErrors, MeshMustBeOneDimensional) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  auto net = std::make_shared<Decoder>(tiny_config());
  expect_error(
      [&] {
        parallelize_module(net, mesh, {{"output", std::make_shared<ColwiseParallel>()}});
      },
      {"1-D mesh", "DeviceMesh(dp=2, tp=2)"});
  expect_error([&] { decoder_tp_plan(tiny_config(), mesh); }, {"must be 1-D"});
}

namespace {

// Every parameter gradient of a parallelized block (gathered where it is a DTensor) against the
// plain block's, within 1e-5 (1 + |want|).
void expect_same_parameter_grads(Module& parallel, Module& plain) {
  std::map<std::string, Parameter*> want;
  for (auto& [name, p] : plain.named_parameters())
    want[name] = p;
  for (auto& [name, p] : parallel.named_parameters())
    tessera::testing::expect_close(p->is_dtensor() ? p->grad_dtensor().full_tensor() : p->grad(),
                                   want.at(name)->grad(), 1e-5, name);
}

}  // namespace

// One tensor-parallel decoder block's backward issues one all-reduce for the input of q, k and v
// (their gradients are added locally first) and one for the input of w1 and w3: two in all,
// where reducing each projection's gradient on its own took five. The gradients are those of the
// plain block.
TEST(TensorParallel, BlockBackwardReducesEachSharedInputOnce) {
  if (world_size() == 1) GTEST_SKIP() << "no collectives on one rank";
  const DeviceMesh mesh(Shape{world_size()}, {"tp"});
  if (tiny_config().n_kv_heads % mesh.size() != 0) GTEST_SKIP() << "kv heads do not split";
  const DecoderConfig cfg = tiny_config();
  Generator g1(3), g2(3);
  auto plain = std::make_shared<DecoderBlock>(cfg, g1);
  auto block = std::make_shared<DecoderBlock>(cfg, g2);
  const auto colwise = std::make_shared<ColwiseParallel>();
  const auto rowwise = std::make_shared<RowwiseParallel>();
  parallelize_module(block, mesh,
                     {{"attention.wq", colwise},
                      {"attention.wk", colwise},
                      {"attention.wv", colwise},
                      {"attention.wo", rowwise},
                      {"feed_forward.w1", colwise},
                      {"feed_forward.w3", colwise},
                      {"feed_forward.w2", rowwise}});
  const Tensor x = tessera::testing::random_tensor({2, kSeq, cfg.dim}, 5, DType::Float32);
  Tensor xp = x.clone().set_requires_grad(true), xt = x.clone().set_requires_grad(true);
  backward(sum((*plain)(xp)));
  Tensor y = (*block)(xt);
  world_group()->barrier()->wait();
  reset_comm_op_counts();
  backward(sum(y));
  const auto counts = comm_op_counts();
  int64_t total = 0;
  for (const auto& [op, n] : counts)
    total += n;
  EXPECT_EQ(counts.count("all_reduce") ? counts.at("all_reduce") : 0, 2);
  EXPECT_EQ(total, 2);
  tessera::testing::expect_close(xt.grad(), xp.grad(), 1e-5, "input gradient");
  expect_same_parameter_grads(*block, *plain);
}

// With sequence parallelism the attention and MLP inputs are gathered once each in forward; in
// backward the gradient terms of q, k and v (and of w1 and w3) are reduce-scattered straight
// into this rank's sequence chunk, instead of all-reduced and then cut. The backward's only
// all-reduces are the two norm weights' gradients. The gradients are those of the plain block.
TEST(TensorParallel, SequenceParallelBlockReduceScattersSharedInputs) {
  if (world_size() == 1) GTEST_SKIP() << "no collectives on one rank";
  const DeviceMesh mesh(Shape{world_size()}, {"tp"});
  const int64_t n = mesh.size();
  if (tiny_config().n_kv_heads % n != 0 || kSeq % n != 0) GTEST_SKIP() << "does not split";
  const DecoderConfig cfg = tiny_config();
  Generator g1(3), g2(3);
  auto plain = std::make_shared<DecoderBlock>(cfg, g1);
  auto block = std::make_shared<DecoderBlock>(cfg, g2);
  ColwiseParallel col;
  RowwiseParallel row;
  row.output_layouts = {Shard(1)};
  PrepareModuleInput gather;
  gather.input_layouts = {Shard(1)};
  gather.desired_input_layouts = {Replicate()};
  auto style = [](auto s) -> ParallelStylePtr { return std::make_shared<decltype(s)>(s); };
  parallelize_module(block, mesh,
                     {{"attention_norm", style(SequenceParallel{})},
                      {"attention", style(gather)},
                      {"attention.wq", style(col)},
                      {"attention.wk", style(col)},
                      {"attention.wv", style(col)},
                      {"attention.wo", style(row)},
                      {"ffn_norm", style(SequenceParallel{})},
                      {"feed_forward", style(gather)},
                      {"feed_forward.w1", style(col)},
                      {"feed_forward.w3", style(col)},
                      {"feed_forward.w2", style(row)}});
  const Tensor x = tessera::testing::random_tensor({2, kSeq, cfg.dim}, 5, DType::Float32);
  const int64_t chunk = kSeq / n;
  Tensor xp = x.clone().set_requires_grad(true);
  Tensor xt = kernels::narrow(x, 1, world_rank() * chunk, chunk).contiguous();
  xt.set_requires_grad(true);
  backward(sum((*plain)(xp)));
  Tensor y = (*block)(xt);
  world_group()->barrier()->wait();
  reset_comm_op_counts();
  backward(sum(y));
  auto counts = comm_op_counts();
  EXPECT_EQ(counts["all_reduce"], 2);
  EXPECT_EQ(counts["reduce_scatter_tensor"] + counts["reduce_scatter"], 2);
  tessera::testing::expect_close(
      xt.grad(), kernels::narrow(xp.grad(), 1, world_rank() * chunk, chunk).contiguous(), 1e-5,
      "input gradient chunk");
  expect_same_parameter_grads(*block, *plain);
}
