// Embeddings with DTensor weights (set up by hand, as a parallel style would): vocabulary
// parallel and column parallel tables, sequence-sharded and strided-sharded ids, ids out of range
// failing on every rank, on 1-D and 2-D meshes, against the same lookups on one rank. Part of
// the test_nn_dtensor binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "dist/nn_dtensor_util.h"
#include "tessera/dtensor/nn_ops.h"
#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::expect_close;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;
using namespace tessera::nn_dtensor_test;

// --- Embedding ---

TEST(NnDTensor, VocabParallelEmbeddingMatchesSingleRank) {
  DeviceMesh mesh = world_mesh();
  // 13 rows: 7,6 over 2 ranks and 4,4,4,1 over 4; 3 rows over 4 ranks leaves one rank empty.
  for (int64_t vocab : {13, 3}) {
    for (bool seq_sharded_output : {false, true}) {
      Generator g1(8), g2(8);
      auto ref_ptr = std::make_shared<Embedding>(vocab, 4, g1);
      auto mod_ptr = std::make_shared<Embedding>(vocab, 4, g2);
      Embedding& ref = *ref_ptr;
      Embedding& emb = *mod_ptr;
      to_float64(ref);
      to_float64(emb);
      distribute(emb.weight, mesh, {Shard(0)});
      const Placements out = seq_sharded_output ? Placements{Shard(1)} : Placements{Replicate()};
      emb.set_dtensor_io({mesh, {Replicate()}, {Replicate()}, out});
      std::vector<int64_t> idv;
      for (int64_t i = 0; i < 16; ++i)
        idv.push_back((i * 5 + i / 3) % vocab);  // every row, several repeated
      Tensor ids = from_vector<int64_t>(idv, {2, 8});
      Tensor y = emb(ids), ry = ref(ids);
      Tensor w = random_tensor({2, 8, 4}, 9, DType::Float64);
      const std::string what =
          "vocab " + std::to_string(vocab) + (seq_sharded_output ? " (reduce-scattered)" : "");
      if (seq_sharded_output) {
        expect_close(gather(y, mesh, {Shard(1)}, {2, 8, 4}), ry, 1e-12, "y " + what);
        backward(sum(mul(y, distribute_tensor(w, mesh, {Shard(1)}).to_local())));
      } else {
        expect_close(y, ry, 1e-12, "y " + what);
        backward(sum(mul(y, w)));
      }
      backward(sum(mul(ry, w)));
      expect_close(full_grad(emb.weight), ref.weight.grad(), 1e-12, "dW " + what);
    }
  }
}

TEST(NnDTensor, VocabParallelEmbeddingRejectsOutOfRangeIdsOnEveryRank) {
  DeviceMesh mesh = world_mesh();
  Generator gen(1);
  auto mod_ptr = std::make_shared<Embedding>(13, 4, gen);
  Embedding& emb = *mod_ptr;
  distribute(emb.weight, mesh, {Shard(0)});
  emb.set_dtensor_io({mesh, {Replicate()}, {Replicate()}, {Replicate()}});
  expect_error(
      [&] {
        emb(from_vector<int64_t>({1, 13}));
      },
      {"embedding: id 13", "vocabulary of 13"});
}

TEST(NnDTensor, VocabParallelEmbeddingIgnoresNonFiniteRowsItDoesNotLookUp) {
  // Row 0 (the first row of rank 0's shard, which stands in for every id rank 0 does not own)
  // is infinite; no id selects it, so no output may be touched by it.
  DeviceMesh mesh = world_mesh();
  Tensor wg = random_tensor({13, 3}, 16, DType::Float64);
  for (int64_t d = 0; d < 3; ++d)
    wg.data<double>()[d] = std::numeric_limits<double>::infinity();
  DTensor w = distribute_tensor(wg, mesh, {Shard(0)});
  w.set_requires_grad(true);
  Tensor ids = from_vector<int64_t>({12, 1, 5, 9, 7, 3}, {6});
  DTensor y = embedding(DTensor::from_local(ids, mesh, {Replicate()}, ids.shape()), w);
  Tensor rw = wg.clone().set_requires_grad(true);
  Tensor ry = embedding(ids, rw);
  expect_close(y.full_tensor(), ry, 1e-12, "y");
  backward(sum(y.full_tensor()));
  backward(sum(ry));
  expect_close(w.grad().full_tensor(), rw.grad(), 0, "dW");
}

TEST(NnDTensor, ColwiseEmbeddingMatchesSingleRank) {
  DeviceMesh mesh = world_mesh();
  Generator g1(10), g2(10);
  auto ref_ptr = std::make_shared<Embedding>(9, 6, g1);  // 6 columns: 2,2,2,0 over 4 ranks
  auto mod_ptr = std::make_shared<Embedding>(9, 6, g2);
  Embedding& ref = *ref_ptr;
  Embedding& emb = *mod_ptr;
  to_float64(ref);
  to_float64(emb);
  distribute(emb.weight, mesh, {Shard(1)});
  Tensor ids = from_vector<int64_t>({8, 0, 3, 3, 5, 1}, {3, 2});
  // The op's own output placement, before any redistribution.
  DTensor yd = emb.forward_dtensor(DTensor::from_local(ids, mesh, {Replicate()}, ids.shape()));
  EXPECT_EQ(yd.placements(), (Placements{Shard(2)}));
  emb.set_dtensor_io({mesh, {Replicate()}, {Replicate()}, {Replicate()}});
  Tensor y = emb(ids), ry = ref(ids);
  expect_close(y, ry, 1e-12, "y");
  Tensor w = random_tensor({3, 2, 6}, 11, DType::Float64);
  backward(sum(mul(y, w)));
  backward(sum(mul(ry, w)));
  expect_close(full_grad(emb.weight), ref.weight.grad(), 1e-12, "dW");
}

TEST(NnDTensor, EmbeddingWithSequenceShardedIdsSumsReplicatedWeightGradient) {
  DeviceMesh mesh = world_mesh();
  Generator g1(12), g2(12);
  auto ref_ptr = std::make_shared<Embedding>(6, 3, g1);
  auto mod_ptr = std::make_shared<Embedding>(6, 3, g2);
  Embedding& ref = *ref_ptr;
  Embedding& emb = *mod_ptr;
  to_float64(ref);
  to_float64(emb);
  Tensor ids = from_vector<int64_t>({0, 1, 2, 3, 4, 5, 5, 4, 3, 2, 1, 0, 2, 2}, {2, 7});
  DTensor idd = distribute_tensor(ids, mesh, {Shard(1)});  // 7 positions: uneven
  DTensor y = emb.forward_dtensor(idd);
  EXPECT_EQ(y.placements(), (Placements{Shard(1)}));
  Tensor ry = ref(ids);
  expect_close(y.full_tensor(), ry, 1e-12, "y");
  Tensor w = random_tensor({2, 7, 3}, 13, DType::Float64);
  backward(sum(mul(y.full_tensor(), w)));
  backward(sum(mul(ry, w)));
  expect_close(emb.weight.grad(), ref.weight.grad(), 1e-12, "dW summed over sequence shards");
}

// Ids that stay sharded are looked up where they lie: an out-of-range id held by one rank must
// fail every rank (the others would go on to their next collective and wait there).
TEST(NnDTensor, SequenceShardedIdsOutOfRangeFailOnEveryRank) {
  DeviceMesh mesh = world_mesh();
  Generator gen(12);
  auto emb = std::make_shared<Embedding>(6, 3, gen);
  // The last position belongs to the last rank only.
  Tensor ids = from_vector<int64_t>({0, 1, 2, 3, 4, 5, 9}, {1, 7});
  DTensor idd = distribute_tensor(ids, mesh, {Shard(1)});
  expect_error([&] { emb->forward_dtensor(idd); },
               {"embedding: ", " 9 ", "out of range for num_embeddings 6"});
}

TEST(NnDTensor, EmbeddingOnTwoDimMesh) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  Tensor wg = random_tensor({11, 5}, 14, DType::Float64);
  Tensor ids = from_vector<int64_t>({10, 0, 4, 7, 7, 2, 9, 1}, {4, 2});
  DTensor w = distribute_tensor(wg, mesh, {Replicate(), Shard(0)});
  w.set_requires_grad(true);
  DTensor idd = distribute_tensor(ids, mesh, {Shard(0), Replicate()});
  DTensor y = embedding(idd, w);
  EXPECT_EQ(y.placements(), (Placements{Shard(0), Partial()}));
  Tensor rw = wg.clone().set_requires_grad(true);
  Tensor ry = embedding(ids, rw);
  expect_close(y.full_tensor(), ry, 1e-12, "y");
  Tensor wt = random_tensor({4, 2, 5}, 15, DType::Float64);
  backward(sum(mul(y.full_tensor(), wt)));
  backward(sum(mul(ry, wt)));
  expect_close(w.grad().full_tensor(), rw.grad(), 1e-12, "dW");
}

// Data-parallel ids beside a vocabulary- or column-parallel table: the ranks of one replica
// hold a bad id, and every rank of the mesh fails, where those of the other replica used to go
// on into the next collective and wait there. The ids sharded on both mesh dims are gathered
// over tp first, so ranks that never held the bad id see it too.
TEST(NnDTensor, OutOfRangeIdsOfOneReplicaFailEveryRankOfATwoDimMesh) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  Tensor ids = from_vector<int64_t>({10, 0, 4, 7, 7, 2, 9, 11}, {4, 2});  // 11: row 3, dp 1
  const Tensor wg = random_tensor({11, 4}, 17, DType::Float64);
  for (const auto& [wp, ip] : std::vector<std::pair<Placements, Placements>>{
           {{Replicate(), Shard(0)}, {Shard(0), Replicate()}},
           {{Replicate(), Shard(0)}, {Shard(0), Shard(0)}},
           {{Replicate(), Shard(1)}, {Shard(0), Shard(0)}}}) {
    SCOPED_TRACE("weight " + placements_str(wp) + ", ids " + placements_str(ip));
    DTensor w = distribute_tensor(wg, mesh, wp);
    DTensor idd = distribute_tensor(ids, mesh, ip);
    expect_error([&] { embedding(idd, w); }, {"embedding: id 11", "num_embeddings 11"});
  }
}

// Ids strided-sharded beside a vocabulary-parallel table are looked up as the plain ids are.
TEST(NnDTensor, StridedShardedIdsBesideAVocabParallelTable) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  const Tensor ids = from_vector<int64_t>({10, 0, 4, 7, 7, 2, 9, 1}, {4, 2});
  const Tensor wg = random_tensor({11, 4}, 18, DType::Float64);
  DTensor w = distribute_tensor(wg, mesh, {Replicate(), Shard(0)});
  DTensor idd = distribute_tensor(ids, mesh, {StridedShard(0, 2), Shard(0)});
  expect_close(embedding(idd, w).full_tensor(), embedding(ids, wg), 0, "strided-sharded ids");
}
