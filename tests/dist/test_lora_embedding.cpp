// LoRA on an Embedding (PEFT's lora.Embedding): the forward and its gradients against the one-hot
// product, the collectives of a vocabulary- and a column-split table, training, merging, mixed
// batches, PEFT's files and checkpoints under every layout, and what is refused. Part of the
// test_lora binary.
#include <gtest/gtest.h>

#include "dist/checkpoint_util.h"
#include "dist/lora_util.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// The decoder's table, two projections of each block's attention and one of its MLP.
LoraConfig with_table(LoraInit init = LoraInit::Random, uint64_t seed = 3, bool dora = false) {
  LoraConfig c = lora_test_config(init);
  c.target_modules = {"tok_embeddings", "wq", "w2"};
  c.seed = seed;
  c.use_dora = dora;
  return c;
}

// DoRA's magnitude `key` of `adapter` times 1 + k/10 for feature k: g = m / norm then differs
// per feature and from 1 (it starts at 1).
void bump_magnitude(LoraModel& lora, const std::string& key,
                    const std::string& adapter = "default") {
  std::map<std::string, Tensor> values = lora.read_adapter(adapter);
  const Tensor m = values.at(key);
  std::vector<float> ramp(size_t(m.numel()));
  for (size_t k = 0; k < ramp.size(); ++k)
    ramp[k] = 1.0f + 0.1f * float(k);
  values.at(key) = mul(m, from_vector<float>(ramp, m.shape()));
  lora.write_adapter(adapter, values);
}

Tensor ids_of(int step) {
  return affine_batch(step, 4, 8, lora_decoder_config().vocab_size).ids;
}

double largest(const Tensor& t) {
  return max_abs_diff(t, zeros(t.shape(), t.dtype()));
}

// [rows, num] with a 1 at each id.
Tensor one_hot(const Tensor& ids, int64_t num) {
  const std::vector<int64_t> v = ids.to_vector<int64_t>();
  std::vector<float> h(v.size() * size_t(num), 0.0f);
  for (size_t i = 0; i < v.size(); ++i)
    h[i * size_t(num) + size_t(v[i])] = 1.0f;
  return from_vector<float>(h, {int64_t(v.size()), num});
}

LoraConfig table_config(LoraInit init = LoraInit::Random, bool dora = false) {
  LoraConfig c;
  c.use_dora = dora;
  c.r = 3;
  c.lora_alpha = 6;
  c.target_modules = {"emb"};
  c.init_lora_weights = init;
  c.seed = 5;
  return c;
}

}  // namespace

// y = W[ids] + scale A^T[ids] B^T, which is the one-hot product onehot (W + scale (B A)^T); A's
// and B's gradients are that product's. PEFT's initialisation: A zero, B normal.
TEST(LoraEmbedding, TheForwardAndGradientsAreTheOneHotProducts) {
  if (world_size() > 1) GTEST_SKIP() << "one process: layouts are the next tests'";
  const int64_t num = 7, dim = 5;
  auto m = std::make_shared<OneTable>(num, dim);
  const Tensor w = m->emb->weight.full().clone();
  const Tensor ids = from_vector<int64_t>({3, 0, 6, 3, 2, 5}, {2, 3});
  {
    // PEFT's init: A zero, so the adapter starts as the identity; B drawn from N(0, 1).
    auto kaiming = apply_lora(std::make_shared<OneTable>(num, dim), table_config(LoraInit::Kaiming),
                              "default", {.max_rank = 4});
    LoraLayer& l = *kaiming->layers().front().second;
    EXPECT_EQ(largest(l.lora_A(0).full()), 0.0f);
    const Tensor b = l.lora_B(0).full();
    EXPECT_GT(largest(kernels::narrow(b, 1, 0, 3)), 0.5f);
    EXPECT_EQ(largest(kernels::narrow(b, 1, 3, 1)), 0.0f) << "padding";
    EXPECT_NE(dynamic_cast<LoraEmbedding*>(&l), nullptr);
  }
  auto lora = apply_lora(m, table_config(), "default", {.max_rank = 4});
  const auto names = m->state_dict();
  EXPECT_EQ(names.at("emb.lora_embedding_A.0.weight").shape(), (Shape{4, num}));
  EXPECT_EQ(names.at("emb.lora_embedding_B.0.weight").shape(), (Shape{dim, 4}));
  EXPECT_EQ(names.count("emb.weight"), 1u);
  const auto values = lora->read_adapter("default");
  const Tensor a = values.at("emb.lora_embedding_A"), b = values.at("emb.lora_embedding_B");
  EXPECT_EQ(a.shape(), (Shape{3, num}));
  EXPECT_EQ(b.shape(), (Shape{dim, 3}));
  EXPECT_GT(largest(a), 0.0f);
  const double scale = 2.0;

  const Tensor grad_out = random_tensor({2, 3, dim}, 17, DType::Float32);
  const Tensor y = (*m)(ids);
  backward(sum(mul(y, grad_out)));

  // The one-hot product, with A and B as leaves of their own.
  Tensor ra = a.clone(), rb = b.clone();
  ra.set_requires_grad(true);
  rb.set_requires_grad(true);
  const Tensor oh = one_hot(ids, num);
  const Tensor want =
      add(matmul(oh, w), mul(matmul(matmul(oh, transpose(ra, 0, 1)), transpose(rb, 0, 1)), scale));
  backward(sum(mul(want, reshape(grad_out, {6, dim}))));
  expect_close(reshape(y, {6, dim}), want, 1e-6, "forward");
  LoraLayer& l = *lora->layers().front().second;
  expect_close(kernels::narrow(l.lora_A(0).grad(), 0, 0, 3), ra.grad(), 1e-6, "A's gradient");
  expect_close(kernels::narrow(l.lora_B(0).grad(), 1, 0, 3), rb.grad(), 1e-6, "B's gradient");
  EXPECT_EQ(largest(kernels::narrow(l.lora_A(0).grad(), 0, 3, 1)), 0.0f);
  EXPECT_FALSE(m->emb->weight.requires_grad()) << "the table is frozen";
}

// PEFT applies no dropout to an Embedding's adapters: two training forwards agree.
TEST(LoraEmbedding, LoraDropoutLeavesTheTableAlone) {
  if (world_size() > 1) GTEST_SKIP() << "one process";
  auto m = std::make_shared<OneTable>(7, 5);
  LoraConfig c = table_config();
  c.lora_dropout = 0.5;
  auto lora = apply_lora(m, c);
  const Tensor ids = from_vector<int64_t>({1, 2, 3, 4}, {2, 2});
  const Tensor first = (*m)(ids);
  expect_close((*m)(ids), first, 0, "a second training forward");
  lora->set_adapter("");
  EXPECT_GT(max_abs_diff((*m)(ids), first), 1e-3) << "the adapter applies";
}

// PEFT's DoraEmbeddingVariant: m starts as the norms of the columns of W + scale (B A)^T (one
// per output feature), and y = g (W[ids] + scale A^T[ids] B^T) with g = m / those norms,
// detached; A, B and m get that product's gradients. PEFT's key for m in the files.
TEST(LoraEmbedding, DoraIsPeftsDoraEmbedding) {
  if (world_size() > 1) GTEST_SKIP() << "one process: layouts are the other tests'";
  const int64_t num = 7, dim = 5;
  auto m = std::make_shared<OneTable>(num, dim);
  const Tensor w = m->emb->weight.full().clone();
  auto lora = apply_lora(m, table_config(LoraInit::Random, /*dora=*/true));
  const auto initial = lora->read_adapter("default");
  const Tensor a = initial.at("emb.lora_embedding_A"), b = initial.at("emb.lora_embedding_B");
  const double scale = 2.0;
  const Tensor v = add(w, mul(transpose(matmul(b, a), 0, 1), scale));  // [num, dim]
  const Tensor norms = sqrt(sum(mul(v, v), {0}));
  expect_close(initial.at("emb.lora_magnitude_vector"), norms, 1e-6, "m at init");
  bump_magnitude(*lora, "emb.lora_magnitude_vector");
  const Tensor mag = lora->read_adapter("default").at("emb.lora_magnitude_vector");

  const Tensor ids = from_vector<int64_t>({3, 0, 6, 3, 2, 5}, {2, 3});
  const Tensor grad_out = random_tensor({2, 3, dim}, 19, DType::Float32);
  const Tensor y = (*m)(ids);
  backward(sum(mul(y, grad_out)));
  Tensor ra = a.clone(), rb = b.clone(), rm = mag.clone();
  for (Tensor* t : {&ra, &rb, &rm})
    t->set_requires_grad(true);
  const Tensor oh = one_hot(ids, num);
  const Tensor z =
      add(matmul(oh, w), mul(matmul(matmul(oh, transpose(ra, 0, 1)), transpose(rb, 0, 1)), scale));
  const Tensor want = mul(z, div(rm, norms));
  backward(sum(mul(want, reshape(grad_out, {6, dim}))));
  expect_close(reshape(y, {6, dim}), want, 1e-6, "forward");
  LoraLayer& l = *lora->layers().front().second;
  expect_close(l.lora_A(0).grad(), ra.grad(), 1e-5, "A's gradient");
  expect_close(l.lora_B(0).grad(), rb.grad(), 1e-5, "B's gradient");
  expect_close(l.lora_magnitude_vector(0).grad(), rm.grad(), 1e-5, "m's gradient");

  const std::string dir = scratch_dir("lora_embedding_dora");
  lora->save_adapter(dir, "default");
  const SafetensorsFile file = load_safetensors(dir + "/adapter_model.safetensors");
  ASSERT_EQ(file.tensors.count("base_model.model.emb.lora_magnitude_vector"), 1u);
  EXPECT_EQ(file.tensors.at("base_model.model.emb.lora_magnitude_vector").shape(), (Shape{dim}));
  auto fresh = std::make_shared<OneTable>(num, dim);
  auto loaded = apply_lora(fresh, table_config(LoraInit::Kaiming, true), "x", {.max_adapters = 2});
  loaded->load_adapter(dir, "default");
  loaded->set_adapter("default");
  NoGradGuard no_grad;
  expect_close((*fresh)(ids), y, 1e-6, "loaded from PEFT's files");
}

namespace {

// A vocabulary-parallel table (RowwiseParallel) and one split on dim 1 (ColwiseParallel), with
// LoRA applied before or after parallelize_module: one process's output and adapter gradients,
// A and B laid out as the table, and the plain table's collectives (the column split: one
// all-reduce more in the backward, of the activations' gradient), in a mixed batch too.
void check_split_table(int64_t num, int64_t dim, bool dora) {
  SCOPED_TRACE("table [" + std::to_string(num) + ", " + std::to_string(dim) + "]" +
               (dora ? ", DoRA" : ""));
  const LoraConfig config = table_config(LoraInit::Random, dora);
  const std::string m_key = "emb.lora_magnitude_vector";
  const int64_t n = world_size();
  const DeviceMesh mesh(Shape{n}, {"tp"});
  std::vector<int64_t> v = {9, 0, 4, 4, 7, 2};
  for (int64_t& id : v)
    id %= num;
  const Tensor ids = from_vector<int64_t>(v, {2, 3});
  auto ref = std::make_shared<OneTable>(num, dim);
  auto ref_lora = apply_lora(ref, config);
  if (dora) bump_magnitude(*ref_lora, m_key);
  backward(sum(mul((*ref)(ids), (*ref)(ids))));
  const Tensor want = (*ref)(ids);
  LoraLayer& rl = *ref_lora->layers().front().second;
  for (const bool vocab : {true, false}) {
    ParallelizePlan plan;
    if (vocab) {
      RowwiseParallel s;
      s.input_layouts = {Replicate()};
      plan.emplace_back("emb", std::make_shared<RowwiseParallel>(s));
    } else {
      ColwiseParallel s;
      s.output_layouts = {Replicate()};
      plan.emplace_back("emb", std::make_shared<ColwiseParallel>(s));
    }
    auto plain = std::make_shared<OneTable>(num, dim);
    parallelize_module(plain, mesh, plan);
    const auto [plain_fwd, plain_bwd] = table_collectives(*plain, ids);
    for (const bool lora_first : {true, false}) {
      const std::string what = std::string(vocab ? "vocabulary parallel" : "column parallel") +
                               (lora_first ? ", LoRA first" : ", LoRA after");
      SCOPED_TRACE(what);
      auto m = std::make_shared<OneTable>(num, dim);
      std::shared_ptr<LoraModel> lora;
      if (lora_first) lora = apply_lora(m, config, "default", {.max_adapters = 2});
      parallelize_module(m, mesh, plan);
      if (!lora_first) lora = apply_lora(m, config, "default", {.max_adapters = 2});
      if (dora) bump_magnitude(*lora, m_key);
      LoraLayer& l = *lora->layers().front().second;
      EXPECT_EQ(placements_str(l.lora_A(0).stored_dtensor().placements()),
                placements_str({vocab ? Placement(Shard(1)) : Placement(Replicate())}));
      EXPECT_EQ(placements_str(l.lora_B(0).stored_dtensor().placements()),
                placements_str({vocab ? Placement(Replicate()) : Placement(Shard(0))}));
      const auto [fwd, bwd] = table_collectives(*m, ids);
      auto expected_fwd = plain_fwd;
      if (vocab && dora) ++expected_fwd["all_reduce"];  // the norms' squares over the vocabulary
      EXPECT_EQ(counts_str(fwd), counts_str(expected_fwd)) << "forward";
      auto expected_bwd = plain_bwd;
      if (!vocab) ++expected_bwd["all_reduce"];
      EXPECT_EQ(counts_str(bwd), counts_str(expected_bwd)) << "backward";
      expect_close((*m)(ids), want, 1e-5, "output");
      expect_close(l.lora_A(0).grad_dtensor().full_tensor(), rl.lora_A(0).grad(), 1e-5,
                   "A's gradient");
      expect_close(l.lora_B(0).grad_dtensor().full_tensor(), rl.lora_B(0).grad(), 1e-5,
                   "B's gradient");
      if (dora) {
        expect_close(l.lora_magnitude_vector(0).grad_dtensor().full_tensor(),
                     rl.lora_magnitude_vector(0).grad(), 1e-5, "m's gradient");
        continue;  // PEFT refuses DoRA in mixed batches, and so does Tessera
      }
      // A mixed batch: each sample as its adapter alone, with the collectives of one adapter.
      LoraConfig second = table_config();
      second.seed = 8;
      lora->add_adapter("second", second);
      Tensor first, other;
      {
        NoGradGuard no_grad;
        first = (*m)(ids);
        lora->set_adapter("second");
        other = (*m)(ids);
      }
      lora->set_batch_adapters(from_vector<int64_t>({lora->adapter_id("second"), 0}));
      const auto [mixed_fwd, mixed_bwd] = table_collectives(*m, ids);
      EXPECT_EQ(counts_str(mixed_fwd), counts_str(expected_fwd)) << "forward, mixed batch";
      EXPECT_EQ(counts_str(mixed_bwd), counts_str(expected_bwd)) << "backward, mixed batch";
      NoGradGuard no_grad;
      const Tensor mixed = (*m)(ids);
      expect_close(kernels::narrow(mixed, 0, 0, 1), kernels::narrow(other, 0, 0, 1), 1e-6, "row 0");
      expect_close(kernels::narrow(mixed, 0, 1, 1), kernels::narrow(first, 0, 1, 1), 1e-6, "row 1");
      EXPECT_GT(max_abs_diff(first, other), 1e-3);
    }
  }
}

}  // namespace

TEST(LoraEmbedding, ASplitTableGivesOneProcesssValuesAndItsCollectives) {
  if (world_size() == 1) GTEST_SKIP() << "needs a split table";
  for (const bool dora : {false, true}) {
    check_split_table(10, 8, dora);
    check_split_table(3, 3, dora);  // uneven shards, and an empty one at 4 ranks
  }
}

// A vocabulary-parallel table whose output goes to sequence shards (decoder_tp_plan's with
// sequence parallelism): the adapter activations need the full sum, so the layer all-reduces
// where the plain table reduce-scatters, and cuts its sequence shard: one collective either way.
// Each rank's shard is one process's, and so are the adapters' gradients.
TEST(LoraEmbedding, AVocabularyParallelTableIntoSequenceShards) {
  const int64_t n = world_size(), num = 10, dim = 8, seq = 4;
  if (n == 1) GTEST_SKIP() << "needs a split table";
  const DeviceMesh mesh(Shape{n}, {"tp"});
  const Tensor ids = from_vector<int64_t>({9, 0, 4, 4, 7, 2, 1, 8}, {2, seq});
  auto ref = std::make_shared<OneTable>(num, dim);
  auto ref_lora = apply_lora(ref, table_config());
  const Tensor want = (*ref)(ids);
  backward(sum(mul(want, want)));
  RowwiseParallel s;
  s.input_layouts = {Replicate()};
  s.output_layouts = {Shard(1)};
  const ParallelizePlan plan = {{"emb", std::make_shared<RowwiseParallel>(s)}};
  auto plain = std::make_shared<OneTable>(num, dim);
  parallelize_module(plain, mesh, plan);
  const auto [plain_fwd, plain_bwd] = table_collectives(*plain, ids);
  auto m = std::make_shared<OneTable>(num, dim);
  parallelize_module(m, mesh, plan);
  auto lora = apply_lora(m, table_config());
  const auto [fwd, bwd] = table_collectives(*m, ids);
  EXPECT_EQ(counts_total(fwd), counts_total(plain_fwd))
      << "forward: LoRA " << counts_str(fwd) << "; plain " << counts_str(plain_fwd);
  EXPECT_EQ(counts_total(bwd), counts_total(plain_bwd))
      << "backward: LoRA " << counts_str(bwd) << "; plain " << counts_str(plain_bwd);
  const int64_t rows = seq / n, first = world_rank() * rows;
  expect_close((*m)(ids), kernels::narrow(want, 1, first, rows), 1e-5, "this rank's shard");
  LoraLayer& l = *lora->layers().front().second;
  LoraLayer& rl = *ref_lora->layers().front().second;
  // table_collectives' backward is of sum(y * y) over each rank's shard: the global sum's.
  expect_close(l.lora_A(0).grad_dtensor().full_tensor(), rl.lora_A(0).grad(), 1e-5, "A's gradient");
  expect_close(l.lora_B(0).grad_dtensor().full_tensor(), rl.lora_B(0).grad(), 1e-5, "B's gradient");
}

// A bfloat16 table beside float32 adapters: the adapters' product is added in float32 and rounded
// once, so a vocabulary-parallel table (whose partial lookups are reduced in float32 with the
// adapter activations) gives one process's output bit for bit and its gradients within 1e-5;
// a merge rounds the table once too.
TEST(LoraEmbedding, ABfloat16TableWithFloat32Adapters) {
  const int64_t n = world_size(), num = 10, dim = 8;
  const Tensor ids = from_vector<int64_t>({9, 0, 4, 4, 7, 2}, {2, 3});
  const Tensor g = random_tensor({2, 3, dim}, 23, DType::Float32);
  struct Result {
    Tensor y, grad_a, grad_b, merged;
  };
  auto run = [&](bool split) {
    auto m = std::make_shared<OneTable>(num, dim);
    m->emb->weight = Parameter(m->emb->weight.full().to(DType::BFloat16), false);
    if (split) {
      RowwiseParallel s;
      s.input_layouts = {Replicate()};
      parallelize_module(m, DeviceMesh(Shape{n}, {"tp"}),
                         {{"emb", std::make_shared<RowwiseParallel>(s)}});
    }
    auto lora = apply_lora(m, table_config());
    Result r;
    r.y = (*m)(ids);
    EXPECT_EQ(r.y.dtype(), DType::BFloat16);
    backward(sum(mul(cast(r.y, DType::Float32), g)));
    LoraLayer& l = *lora->layers().front().second;
    r.grad_a =
        l.lora_A(0).is_dtensor() ? l.lora_A(0).grad_dtensor().full_tensor() : l.lora_A(0).grad();
    r.grad_b =
        l.lora_B(0).is_dtensor() ? l.lora_B(0).grad_dtensor().full_tensor() : l.lora_B(0).grad();
    lora->merge_adapter("default");
    r.merged = m->emb->weight.full();
    EXPECT_EQ(r.merged.dtype(), DType::BFloat16);
    return r;
  };
  const Result one = run(false);
  const Result tp = run(n > 1);
  EXPECT_EQ(max_abs_diff(tp.y, one.y), 0.0);
  expect_close(tp.grad_a, one.grad_a, 1e-5, "A's gradient");
  expect_close(tp.grad_b, one.grad_b, 1e-5, "B's gradient");
  EXPECT_EQ(max_abs_diff(tp.merged, one.merged), 0.0);
  // Merged in float32 and rounded once: within bfloat16's half step of the float32 sum.
  auto f32 = std::make_shared<OneTable>(num, dim);
  const Tensor w = f32->emb->weight.full().to(DType::BFloat16).to(DType::Float32);
  f32->emb->weight = Parameter(w, false);
  auto lora = apply_lora(f32, table_config());
  lora->merge_adapter("default");
  expect_close(one.merged.to(DType::Float32), f32->emb->weight.full(), 4e-3, "rounded once");
}

namespace {

void train_on_every_layout(const LoraConfig& c) {
  LoraRun ref{"plain", std::make_shared<Decoder>(lora_decoder_config()), nullptr, 0, 1};
  ref.lora = apply_lora(ref.model, c);
  const auto initial = base_weights(*ref.model);
  const Tensor want = ref.logits(ids_of(0));
  const LoraTrained reference = lora_train(ref, 3);
  ASSERT_EQ(reference.adapter.count("tok_embeddings.lora_embedding_A"), 1u);
  ASSERT_EQ(reference.adapter.count("tok_embeddings.lora_embedding_B"), 1u);
  for (const LoraLayout& l : lora_layouts()) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(lora_decoder_config(), c);
    LoraLayer& table = *run.lora->layers().front().second;
    ASSERT_EQ(run.lora->layers().front().first, "tok_embeddings");
    if (l.name.rfind("tp", 0) == 0) {  // vocabulary parallel (decoder_tp_plan)
      EXPECT_EQ(placements_str(table.lora_A(0).stored_dtensor().placements()), "[S(1)]");
      EXPECT_EQ(placements_str(table.lora_B(0).stored_dtensor().placements()), "[R]");
    }
    expect_close(run.logits(ids_of(0)), want, 1e-5, "logits");
    const LoraTrained got = lora_train(run, 3);
    expect_lora_parity(run, got, reference, initial, l.name);
  }
}

void merge_on(const LoraLayout& l, bool dora) {
  LoraRun run = l.build(lora_decoder_config(), with_table(LoraInit::Random, 3, dora));
  if (dora) bump_magnitude(*run.lora, "tok_embeddings.lora_magnitude_vector");
  auto& table = dynamic_cast<LoraEmbedding&>(*run.lora->layers().front().second);
  const Tensor w0 = table.weight.full().clone();
  const Tensor before = run.logits(ids_of(1));
  run.lora->merge_adapter("default");
  EXPECT_GT(max_abs_diff(table.weight.full(), w0), 1e-3) << "merged into the table";
  expect_close(run.logits(ids_of(1)), before, 1e-5, "merged");
  run.lora->unmerge_adapter("default");
  // DoRA divides by m / norms, here up to 4.1 on values up to about 3: float32's rounding then
  // leaves up to 1.5e-6.
  EXPECT_LE(max_abs_diff(table.weight.full(), w0), dora ? 3e-6 : 1e-6) << "unmerged";
  expect_close(run.logits(ids_of(1)), before, 1e-5, "unmerged");
  if (l.name.rfind("tp", 0) != 0 && l.name != "plain") return;  // FSDP refuses unloading
  ModulePtr base = run.lora->merge_and_unload();
  auto* decoder = dynamic_cast<Decoder*>(base.get());
  ASSERT_NE(decoder, nullptr);
  EXPECT_EQ(decoder->tok_embeddings->type_name(), "Embedding");
  for (const auto& [key, t] : base->state_dict())
    EXPECT_EQ(key.find("lora_"), std::string::npos) << key;
  expect_close(run.logits(ids_of(1)), before, 1e-5, "merge_and_unload");
}

}  // namespace

// Three AdamW steps on the table and two projections per block give one process's losses and
// adapters under TP (LoRA before and after), FSDP, FSDP x TP and HSDP.
TEST(LoraEmbedding, EveryLayoutTrainsAsOneProcess) {
  for (const bool dora : {false, true}) {
    SCOPED_TRACE(dora ? "DoRA" : "LoRA");
    train_on_every_layout(with_table(LoraInit::Random, 3, dora));
  }
}

// Merging adds scale (B A)^T to each rank's window of the table (DoRA: and scales its columns):
// the same logits, and unmerging gives the table back. merge_and_unload puts a plain Embedding
// back.
TEST(LoraEmbedding, MergeAndUnmergeOnEveryLayout) {
  for (const bool dora : {false, true})
    for (const LoraLayout& l : lora_layouts()) {
      SCOPED_TRACE(l.name + (dora ? ", DoRA" : ""));
      merge_on(l, dora);
    }
}

// A mixed batch gives each sample what its adapter alone gives, the table's adapters included.
TEST(LoraEmbedding, AMixedBatchGivesEachSampleItsAdapter) {
  for (const LoraLayout& l : lora_layouts({.max_adapters = 3})) {
    SCOPED_TRACE(l.name);
    LoraRun run = l.build(lora_decoder_config(), with_table());
    run.lora->add_adapter("second", with_table(LoraInit::Random, 5));
    LoraConfig other = with_table(LoraInit::Random, 7);
    other.target_modules = {"tok_embeddings"};
    run.lora->add_adapter("table", other);
    const std::vector<Tensor> alone =
        expect_mixed_batch_as_alone(run, {"table", "default", "", "second"}, ids_of(2));
    EXPECT_GT(max_abs_diff(kernels::narrow(alone[0], 0, 0, 1), kernels::narrow(alone[2], 0, 0, 1)),
              1e-3)
        << "the table's adapter changes its sample";
  }
}

// PEFT's files hold the table's adapter as base_model.model.tok_embeddings.lora_embedding_A
// [r, vocab] and .lora_embedding_B [dim, r]; they load onto another mesh as the same model, and
// so does a checkpoint with the adapter table.
TEST(LoraEmbedding, PeftFilesAndCheckpointsLoadOnAnotherMesh) {
  const std::string dir = scratch_dir("lora_embedding");
  const std::vector<LoraLayout> layouts = lora_layouts({.max_adapters = 2});
  const DecoderConfig cfg = lora_decoder_config();
  for (const LoraLayout& from : layouts) {
    SCOPED_TRACE(from.name + " -> " + layouts.back().name);
    LoraRun run = from.build(cfg, with_table());
    AdamW opt(run.lora->parameters(), AdamWOptions{.lr = 1e-2, .weight_decay = 0.0});
    lora_train_step(run, opt, 0);
    const Tensor want = run.logits(ids_of(4));
    run.lora->save_adapter(dir + "/adapter", "default");
    const SafetensorsFile file = load_safetensors(dir + "/adapter/adapter_model.safetensors");
    const std::string key = "base_model.model.tok_embeddings.lora_embedding_";
    ASSERT_EQ(file.tensors.count(key + "A"), 1u);
    EXPECT_EQ(file.tensors.at(key + "A").shape(), (Shape{4, cfg.vocab_size}));
    EXPECT_EQ(file.tensors.at(key + "B").shape(), (Shape{cfg.dim, 4}));
    save_lora_checkpoint(run, dir + "/checkpoint.h5");

    LoraRun peft = layouts.back().build(cfg, with_table(LoraInit::Random, 9));
    peft.lora->load_adapter(dir + "/adapter", "loaded");
    peft.lora->set_adapter("loaded");
    expect_close(peft.logits(ids_of(4)), want, 1e-5, "from PEFT's files");

    LoraRun fresh = layouts.back().build(cfg, with_table(LoraInit::Random, 9));
    EXPECT_GT(max_abs_diff(fresh.logits(ids_of(4)), want), 1e-3);
    load_lora_checkpoint(fresh, dir + "/checkpoint.h5");
    expect_close(fresh.logits(ids_of(4)), want, 1e-5, "from the checkpoint");
  }
}

// Refused before anything changes, naming the table: a table the output projection reads too
// (without ensure_weight_tying: test_lora_tied.cpp); "all-linear" leaves tables out, as PEFT's
// does.
TEST(LoraEmbedding, WhatCannotBeAdaptedIsRefusedNamingIt) {
  if (world_size() > 1) GTEST_SKIP() << "one process";
  DecoderConfig tied = lora_decoder_config();
  tied.tie_embeddings = true;
  auto tied_model = std::make_shared<Decoder>(tied);
  expect_error([&] { apply_lora(tied_model, with_table()); },
               {"apply_lora: 'tok_embeddings' is also the Decoder's output projection",
                "ensure_weight_tying"});
  EXPECT_EQ(tied_model->tok_embeddings->type_name(), "Embedding") << "left as it was";
  EXPECT_TRUE(tied_model->layers[0]->attention->wq->weight.requires_grad()) << "left unfrozen";
  auto assigned = std::make_shared<Decoder>(lora_decoder_config());
  assigned->output->weight = assigned->tok_embeddings->weight;
  expect_error([&] { apply_lora(assigned, with_table()); },
               {"apply_lora: 'tok_embeddings' (Embedding, a LoRA target): its 'weight' is tied to "
                "'output.weight'"});

  LoraConfig all = lora_test_config();
  all.target_modules = {kAllLinear};
  auto every = apply_lora(std::make_shared<Decoder>(lora_decoder_config()), all);
  for (const auto& [path, layer] : every->layers())
    EXPECT_NE(path, "tok_embeddings");
}

// PEFT's per-module fields reach a table as any target: its own r (rank_pattern) and alpha
// (alpha_pattern), exclude_modules, and set_requires_grad freezing its matrices.
TEST(LoraEmbedding, ModuleFieldsReachTheTable) {
  if (world_size() > 1) GTEST_SKIP() << "one process";
  LoraConfig c = with_table();
  c.rank_pattern = {{"tok_embeddings", 2}};
  c.alpha_pattern = {{"tok_embeddings", 6.0}};
  auto m = std::make_shared<Decoder>(lora_decoder_config());
  auto lora = apply_lora(m, c);
  const auto values = lora->read_adapter("default");
  EXPECT_EQ(values.at("tok_embeddings.lora_embedding_A").shape(), (Shape{2, 32}));
  EXPECT_EQ(values.at("tok_embeddings.lora_embedding_B").shape(), (Shape{32, 2}));
  EXPECT_EQ(values.at("layers.0.attention.wq.lora_A.weight").shape(), (Shape{4, 32}));
  LoraLayer& table = *lora->layers().front().second;
  EXPECT_EQ(table.slot(0).r, 2);
  EXPECT_DOUBLE_EQ(table.slot(0).scale, 3.0);
  lora->set_requires_grad({"default"}, false);
  EXPECT_FALSE(table.lora_A(0).requires_grad());
  EXPECT_FALSE(table.lora_B(0).requires_grad());
  LoraConfig excluded = with_table();
  excluded.exclude_modules = {"tok_embeddings"};
  auto other = apply_lora(std::make_shared<Decoder>(lora_decoder_config()), excluded);
  for (const auto& [path, layer] : other->layers())
    EXPECT_NE(path, "tok_embeddings");
}
