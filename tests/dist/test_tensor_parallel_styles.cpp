// Tensor parallelism's styles on single layers: colwise and rowwise Linear and Embedding,
// sequence parallel norms and dropout, preparing module inputs and outputs, plan keys, where the
// parameters come from, and pieces not cut as torch.chunk cuts them. Part of the
// test_tensor_parallel binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "common/affine_batch.h"
#include "dist/tensor_parallel_util.h"
#include "tessera/tessera.h"
#include "tessera/testing.h"

using namespace tessera;
using namespace tessera::tensor_parallel_test;
using tessera::testing::affine_batch;
using tessera::testing::Batch;
using tessera::testing::error_of;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;

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

  Tensor x = random_tensor({3, 4, 6}, 7, DType::Float32);
  Tensor h = (*col)(x);  // Shard(-1) output: this rank's feature slice
  Tensor h_ref = (*col_ref)(x);
  expect_close(h, chunk_of(h_ref, 2, mesh), 1e-6, "colwise local output");
  Tensor y = (*row)(h);  // Shard(-1) input, partial sums all-reduced
  Tensor y_ref = (*row_ref)(h_ref);
  expect_close(y, y_ref, 1e-5, "rowwise output");

  Tensor w = random_tensor(y_ref.shape(), 8, DType::Float32);
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
  Tensor w = random_tensor({2, 4, 8}, 11, DType::Float32);
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
  Tensor x = random_tensor({2, 8, 6}, 12, DType::Float32),
         w = random_tensor({2, 8, 6}, 13, DType::Float32);
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
  Tensor x = random_tensor({2, 9, 4}, 15, DType::Float32),
         w = random_tensor({2, 9, 4}, 16, DType::Float32);  // 9: uneven chunks
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
  Tensor xg = random_tensor({8, 5}, 14, DType::Float32);
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
  Tensor x = random_tensor({8, 5}, 14, DType::Float32);
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
