// Layers with DTensor parameters (set up by hand, as a parallel style would), optimizers on
// DTensor parameters and clip_grad_norm_ over mixed placements: every result and every gradient
// equals the same computation on one rank with plain tensors. Shapes are uneven on purpose.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "tessera/dtensor/nn_ops.h"
#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/stand_in_device.h"

using namespace tessera;
using tessera::testing::expect_close;
using tessera::testing::expect_error;

namespace {

Tensor global_randn(const Shape& s, uint64_t seed, DType dtype = DType::Float64) {
  Generator g(seed);
  return randn(s, g, dtype);
}

DeviceMesh world_mesh() {
  return DeviceMesh(Shape{world_size()}, {"tp"});
}

// Makes every parameter float64 with the same values on every rank.
void to_float64(Module& m) {
  for (auto& [name, p] : m.named_parameters())
    *p = Parameter(p->full().to(DType::Float64));
}

void distribute(Parameter& p, const DeviceMesh& mesh, const Placements& placements) {
  p = Parameter(distribute_tensor(p.full(), mesh, placements));
}

// The gradient of a parameter as a global tensor (gathered when it is a DTensor).
Tensor full_grad(const Parameter& p) {
  if (!p.is_dtensor()) return p.grad();
  return p.grad_dtensor().full_tensor();
}

// This rank's piece of `global` under `placements` (a fresh leaf).
Tensor local_leaf(const Tensor& global, const DeviceMesh& mesh, const Placements& placements) {
  return distribute_tensor(global, mesh, placements).to_local().clone().set_requires_grad(true);
}

Tensor gather(const Tensor& local, const DeviceMesh& mesh, const Placements& placements,
              const Shape& global_shape) {
  return DTensor::from_local(local, mesh, placements, global_shape).full_tensor();
}

}  // namespace

// --- Linear ---

TEST(NnDTensor, ColwiseLinearMatchesSingleRank) {
  DeviceMesh mesh = world_mesh();
  for (bool shard_output : {false, true}) {
    Generator g1(3), g2(3);
    auto ref_ptr = std::make_shared<Linear>(6, 10, true, g1);  // 10 rows: uneven over 4 ranks
    auto mod_ptr = std::make_shared<Linear>(6, 10, true, g2);
    Linear& ref = *ref_ptr;
    Linear& lin = *mod_ptr;
    to_float64(ref);
    to_float64(lin);
    distribute(lin.weight, mesh, {Shard(0)});
    distribute(lin.bias, mesh, {Shard(0)});
    const Placements out = shard_output ? Placements{Shard(-1)} : Placements{Replicate()};
    lin.set_dtensor_io({mesh, {Replicate()}, {Replicate()}, out});

    Tensor xg = global_randn({2, 3, 6}, 1);
    Tensor x = xg.clone().set_requires_grad(true), rx = xg.clone().set_requires_grad(true);
    Tensor y = lin(x), ry = ref(rx);
    Tensor w = global_randn({2, 3, 10}, 2);
    if (shard_output) {
      expect_close(gather(y, mesh, {Shard(2)}, {2, 3, 10}), ry, 1e-12, "y (sharded)");
      backward(sum(mul(y, distribute_tensor(w, mesh, {Shard(2)}).to_local())));
    } else {
      expect_close(y, ry, 1e-12, "y");
      backward(sum(mul(y, w)));
    }
    backward(sum(mul(ry, w)));
    expect_close(x.grad(), rx.grad(), 1e-12, "dx");
    expect_close(full_grad(lin.weight), ref.weight.grad(), 1e-12, "dW");
    expect_close(full_grad(lin.bias), ref.bias.grad(), 1e-12, "db");
    EXPECT_EQ(lin.weight.grad().shape(), lin.weight.local().shape());
  }
}

TEST(NnDTensor, RowwiseLinearMatchesSingleRank) {
  DeviceMesh mesh = world_mesh();
  for (bool dtensor_bias : {false, true}) {
    Generator g1(4), g2(4);
    auto ref_ptr = std::make_shared<Linear>(8, 5, true, g1);
    auto mod_ptr = std::make_shared<Linear>(8, 5, true, g2);
    Linear& ref = *ref_ptr;
    Linear& lin = *mod_ptr;
    to_float64(ref);
    to_float64(lin);
    distribute(lin.weight, mesh, {Shard(1)});
    // A plain bias is taken as replicated; a Replicate DTensor bias is the same thing.
    if (dtensor_bias) distribute(lin.bias, mesh, {Replicate()});
    lin.set_dtensor_io({mesh, {Shard(-1)}, {Shard(-1)}, {Replicate()}});

    Tensor xg = global_randn({3, 8}, 5);
    Tensor x = local_leaf(xg, mesh, {Shard(1)}), rx = xg.clone().set_requires_grad(true);
    Tensor y = lin(x), ry = ref(rx);
    expect_close(y, ry, 1e-12, "y");
    Tensor w = global_randn({3, 5}, 6);
    backward(sum(mul(y, w)));
    backward(sum(mul(ry, w)));
    expect_close(gather(x.grad(), mesh, {Shard(1)}, {3, 8}), rx.grad(), 1e-12, "dx");
    expect_close(full_grad(lin.weight), ref.weight.grad(), 1e-12, "dW");
    // The bias is added once and its gradient is the full one on every rank.
    expect_close(full_grad(lin.bias), ref.bias.grad(), 1e-12, "db");
  }
}

TEST(NnDTensor, RowwiseLinearUnevenInputThroughForwardDTensor) {
  DeviceMesh mesh = world_mesh();
  Generator g1(5), g2(5);
  auto ref_ptr = std::make_shared<Linear>(7, 3, false, g1);  // 7 inputs: 2,2,2,1 over 4 ranks
  auto mod_ptr = std::make_shared<Linear>(7, 3, false, g2);
  Linear& ref = *ref_ptr;
  Linear& lin = *mod_ptr;
  to_float64(ref);
  to_float64(lin);
  distribute(lin.weight, mesh, {Shard(1)});
  Tensor xg = global_randn({4, 7}, 7);
  DTensor x = distribute_tensor(xg, mesh, {Shard(1)});
  x.set_requires_grad(true);
  Tensor rx = xg.clone().set_requires_grad(true);
  DTensor y = lin.forward_dtensor(x);
  Tensor ry = ref(rx);
  expect_close(y.full_tensor(), ry, 1e-12, "y");
  backward(sum(y.full_tensor()));
  backward(sum(ry));
  expect_close(x.grad().full_tensor(), rx.grad(), 1e-12, "dx");
  expect_close(full_grad(lin.weight), ref.weight.grad(), 1e-12, "dW");
}

TEST(NnDTensor, PlainForwardRefusesShardedParameter) {
  DeviceMesh mesh = world_mesh();
  Generator gen(1);
  auto mod_ptr = std::make_shared<Linear>(4, 8, true, gen);
  Linear& lin = *mod_ptr;
  Tensor x = global_randn({2, 4}, 1, DType::Float32);
  Tensor want = lin(x);
  distribute(lin.weight, mesh, {Shard(0)});
  if (world_size() == 1) {
    // A one-rank shard is the whole weight, which the plain forward may use.
    expect_close(lin(x), want, 0, "whole DTensor weight");
  } else {
    expect_error([&] { lin(x); }, {"Linear.forward: weight is sharded", "S(0)"});
  }
}

// A plain layer (with a buffer) registered before one whose weight is distributed.
struct PlainThenDistributed : Module {
  explicit PlainThenDistributed(Generator& gen)
      : Module("PlainThenDistributed"),
        plain(std::make_shared<Linear>(4, 3, true, gen)),
        sharded(std::make_shared<Linear>(3, 4, false, gen)),
        steps(zeros({2})) {
    register_module("plain", plain);
    register_buffer("steps", &steps);
    register_module("sharded", sharded);
  }
  std::shared_ptr<Linear> plain, sharded;
  Tensor steps;
};

TEST(NnDTensor, ModuleToRefusingADistributedParameterMovesNothing) {
  tessera::testing::TestDevice device;
  Generator gen(2);
  auto net = std::make_shared<PlainThenDistributed>(gen);
  distribute(net->sharded->weight, world_mesh(), {Shard(0)});
  const Tensor weight = net->plain->weight.stored(), bias = net->plain->bias.stored();
  expect_error([&] { net->to(Device::cuda(0)); },
               {"sharded.weight", "move the module before parallelize_module"});
  // The refusal came before any move: the plain layer and the buffer are where they were.
  EXPECT_TRUE(net->plain->weight.stored().is_same(weight)) << "plain.weight moved";
  EXPECT_TRUE(net->plain->bias.stored().is_same(bias)) << "plain.bias moved";
  EXPECT_EQ(net->steps.device(), Device::cpu()) << "the buffer moved";
  EXPECT_TRUE(net->plain->weight.requires_grad());
}

// A sharded state dict keeps every tensor where it lives, as PyTorch's state_dict does: the plain
// parameters and buffers of a model on the device come as DTensors over a device mesh whose
// pieces are those tensors (sharing their storage, as on the CPU), not host copies; the dict
// loads back into a model on the device and into one on the CPU.
TEST(NnDTensor, ShardedStateDictKeepsPlainDeviceTensorsOnTheDevice) {
  tessera::testing::TestDevice device;
  Generator gen(3);
  auto net = std::make_shared<PlainThenDistributed>(gen);
  net->to(Device::cuda(0));
  const DeviceMesh mesh(DeviceType::CUDA, Shape{world_size()}, {"tp"});
  distribute(net->sharded->weight, mesh, {Shard(0)});
  const std::map<std::string, DTensor> sd = net->sharded_state_dict();
  ASSERT_EQ(sd.size(), 4u);
  for (const auto& [name, t] :
       std::map<std::string, Tensor>{{"plain.weight", net->plain->weight.stored()},
                                     {"plain.bias", net->plain->bias.stored()},
                                     {"steps", net->steps}}) {
    const DTensor& d = sd.at(name);
    EXPECT_EQ(d.to_local().device(), Device::cuda(0)) << name;
    EXPECT_EQ(d.mesh().device_type(), DeviceType::CUDA) << name;
    EXPECT_EQ(d.placements(), (Placements{Replicate()})) << name;
    EXPECT_TRUE(d.to_local().storage().is_same(t.storage())) << name << " was copied";
  }
  EXPECT_TRUE(sd.at("sharded.weight")
                  .to_local()
                  .storage()
                  .is_same(net->sharded->weight.stored().storage()));

  Generator other_gen(4);
  auto other = std::make_shared<PlainThenDistributed>(other_gen);
  other->to(Device::cuda(0));
  EXPECT_TRUE(other->load_sharded_state_dict(sd).empty());
  auto cpu = std::make_shared<PlainThenDistributed>(other_gen);
  EXPECT_TRUE(cpu->load_sharded_state_dict(sd).empty());
  const std::map<std::string, Tensor> want = net->state_dict();
  for (auto* m : {other.get(), cpu.get()})
    for (const auto& [name, t] : m->state_dict())
      expect_close(t.to(Device::cpu()), want.at(name).to(Device::cpu()), 0, name);
}

// Every call puts the plain tensors on the same world meshes: a mesh per call made new process
// groups (on NCCL a communicator each), which a run that checkpoints often piled up.
TEST(NnDTensor, ShardedStateDictReusesItsWorldMeshes) {
  tessera::testing::TestDevice device;
  Generator gen(3);
  auto on_device = std::make_shared<PlainThenDistributed>(gen);
  on_device->to(Device::cuda(0));
  auto on_host = std::make_shared<PlainThenDistributed>(gen);
  const DeviceMesh device_world = on_device->sharded_state_dict().at("plain.weight").mesh();
  const DeviceMesh host_world = on_host->sharded_state_dict().at("plain.weight").mesh();
  const int64_t splits = comm_op_counts()["split"];
  for (int again = 0; again < 3; ++again) {
    const std::map<std::string, DTensor> d = on_device->sharded_state_dict();
    const std::map<std::string, DTensor> h = on_host->sharded_state_dict();
    EXPECT_EQ(d.at("steps").mesh(), device_world);
    EXPECT_EQ(h.at("steps").mesh(), host_world);
  }
  EXPECT_EQ(comm_op_counts()["split"], splits) << "sharded_state_dict made new process groups";
}

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
      Tensor w = global_randn({2, 8, 4}, 9);
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
  Tensor wg = global_randn({13, 3}, 16);
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
  Tensor w = global_randn({3, 2, 6}, 11);
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
  Tensor w = global_randn({2, 7, 3}, 13);
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
  Tensor wg = global_randn({11, 5}, 14);
  Tensor ids = from_vector<int64_t>({10, 0, 4, 7, 7, 2, 9, 1}, {4, 2});
  DTensor w = distribute_tensor(wg, mesh, {Replicate(), Shard(0)});
  w.set_requires_grad(true);
  DTensor idd = distribute_tensor(ids, mesh, {Shard(0), Replicate()});
  DTensor y = embedding(idd, w);
  EXPECT_EQ(y.placements(), (Placements{Shard(0), Partial()}));
  Tensor rw = wg.clone().set_requires_grad(true);
  Tensor ry = embedding(ids, rw);
  expect_close(y.full_tensor(), ry, 1e-12, "y");
  Tensor wt = global_randn({4, 2, 5}, 15);
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
  const Tensor wg = global_randn({11, 4}, 17);
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
  const Tensor wg = global_randn({11, 4}, 18);
  DTensor w = distribute_tensor(wg, mesh, {Replicate(), Shard(0)});
  DTensor idd = distribute_tensor(ids, mesh, {StridedShard(0, 2), Shard(0)});
  expect_close(embedding(idd, w).full_tensor(), embedding(ids, wg), 0, "strided-sharded ids");
}

// --- norms ---

namespace {

// Runs a norm layer on x [2, T, 6] sharded over `x_placements` and its single-rank twin,
// comparing output, input gradient and parameter gradients.
template <class Norm>
void check_norm(const DeviceMesh& mesh, const Placements& x_placements, int64_t seq,
                bool through_module, uint64_t seed) {
  auto ref_ptr = std::make_shared<Norm>(6);
  auto mod_ptr = std::make_shared<Norm>(6);
  Norm& ref = *ref_ptr;
  Norm& norm = *mod_ptr;
  to_float64(ref);
  to_float64(norm);
  for (auto& [name, p] : ref.named_parameters()) {
    Tensor v = global_randn({6}, seed + 100 + name.size());
    p->copy_from_full(v);
    for (auto& [n2, q] : norm.named_parameters())
      if (n2 == name) q->copy_from_full(v);
  }
  const std::string what = norm.type_name() + " " + placements_str(x_placements) +
                           " T=" + std::to_string(seq) + (through_module ? " module" : " op");
  Tensor xg = global_randn({2, seq, 6}, seed);
  Tensor rx = xg.clone().set_requires_grad(true);
  Tensor ry = ref(rx);
  Tensor w = global_randn({2, seq, 6}, seed + 1);
  Tensor xgrad, y;
  if (through_module) {
    norm.set_dtensor_io({mesh, x_placements, x_placements, x_placements});
    Tensor x = local_leaf(xg, mesh, x_placements);
    Tensor yl = norm(x);
    y = gather(yl, mesh, x_placements, xg.shape());
    backward(sum(mul(yl, distribute_tensor(w, mesh, x_placements).to_local())));
    xgrad = gather(x.grad(), mesh, x_placements, xg.shape());
  } else {
    DTensor x = distribute_tensor(xg, mesh, x_placements);
    x.set_requires_grad(true);
    DTensor yd = norm.forward_dtensor(x);
    Placements expected;
    for (const Placement& p : x_placements)
      expected.push_back(p.is_shard(2) ? Replicate() : p);
    EXPECT_EQ(yd.placements(), expected) << what;
    y = yd.full_tensor();
    backward(sum(mul(y, w)));
    xgrad = x.grad().full_tensor();
  }
  backward(sum(mul(ry, w)));
  expect_close(y, ry, 1e-12, "y " + what);
  expect_close(xgrad, rx.grad(), 1e-12, "dx " + what);
  auto rp = ref.named_parameters(), np = norm.named_parameters();
  for (size_t i = 0; i < rp.size(); ++i)
    expect_close(full_grad(*np[i].second), rp[i].second->grad(), 1e-12,
                 "d" + np[i].first + " " + what);
}

}  // namespace

TEST(NnDTensor, SequenceParallelNormsMatchSingleRank) {
  DeviceMesh mesh = world_mesh();
  check_norm<RMSNorm>(mesh, {Shard(1)}, 8, true, 20);
  check_norm<LayerNorm>(mesh, {Shard(1)}, 8, true, 21);
  // Uneven sequence (7 over 4 ranks: 2,2,2,1) through the DTensor forward.
  check_norm<RMSNorm>(mesh, {Shard(1)}, 7, false, 22);
  check_norm<LayerNorm>(mesh, {Shard(1)}, 7, false, 23);
  // A sharded normalised dim is gathered first; the output is replicated.
  check_norm<RMSNorm>(mesh, {Shard(2)}, 3, false, 24);
  check_norm<LayerNorm>(mesh, {Shard(2)}, 3, false, 25);
}

TEST(NnDTensor, NormsWithDTensorWeightsAndPartialInput) {
  DeviceMesh mesh = world_mesh();
  Tensor xg = global_randn({3, 5}, 30), wg = global_randn({5}, 31), bg = global_randn({5}, 32);
  // A Partial input: rank 0 holds x, the others zeros (distribute_tensor's convention).
  DTensor x = distribute_tensor(xg, mesh, {Partial()});
  x.set_requires_grad(true);
  DTensor w = distribute_tensor(wg, mesh, {Replicate()});
  DTensor b = distribute_tensor(bg, mesh, {Shard(0)});  // gathered, gradient comes back sharded
  w.set_requires_grad(true);
  b.set_requires_grad(true);
  DTensor y = layer_norm(x, w, b, 1e-5);
  EXPECT_EQ(y.placements(), (Placements{Replicate()}));
  Tensor rx = xg.clone().set_requires_grad(true), rw = wg.clone().set_requires_grad(true),
         rb = bg.clone().set_requires_grad(true);
  Tensor ry = layer_norm(rx, rw, rb, 1e-5);
  expect_close(y.full_tensor(), ry, 1e-12, "y");
  Tensor wt = global_randn({3, 5}, 33);
  backward(sum(mul(y.to_local(), wt)));
  backward(sum(mul(ry, wt)));
  EXPECT_EQ(b.grad().placements(), (Placements{Shard(0)}));
  expect_close(w.grad().full_tensor(), rw.grad(), 1e-12, "dw");
  expect_close(b.grad().full_tensor(), rb.grad(), 1e-12, "db");
  expect_close(x.grad().full_tensor(), rx.grad(), 1e-12, "dx");
  expect_error([&] { rms_norm(x, distribute_tensor(global_randn({4}, 1), mesh, {Replicate()})); },
               {"rms_norm", "[4]", "[3, 5]"});
}

TEST(NnDTensor, NormsOnTwoDimMesh) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  check_norm<RMSNorm>(mesh, {Shard(0), Shard(1)}, 5, false, 40);
  check_norm<LayerNorm>(mesh, {Shard(0), Shard(1)}, 4, true, 41);
  check_norm<LayerNorm>(mesh, {Shard(1), Shard(2)}, 6, false, 42);
}

// --- optimizers ---

TEST(NnDTensor, AdamWOnDTensorParametersMatchesPlain) {
  DeviceMesh mesh = world_mesh();
  Generator g1(50), g2(50);
  auto ref_ptr = std::make_shared<Linear>(6, 10, true, g1);
  auto mod_ptr = std::make_shared<Linear>(6, 10, true, g2);
  Linear& ref = *ref_ptr;
  Linear& lin = *mod_ptr;
  to_float64(ref);
  to_float64(lin);
  distribute(lin.weight, mesh, {Shard(0)});
  distribute(lin.bias, mesh, {Shard(0)});
  lin.set_dtensor_io({mesh, {Replicate()}, {Replicate()}, {Replicate()}});
  AdamWOptions o{.lr = 0.05, .weight_decay = 0.1};
  AdamW opt(lin.parameters(), o), ref_opt(ref.parameters(), o);
  for (int step = 0; step < 3; ++step) {
    Tensor x = global_randn({4, 6}, 60 + uint64_t(step));
    Tensor t = global_randn({4, 10}, 70 + uint64_t(step));
    backward(sum(square(sub(lin(x), t))));
    backward(sum(square(sub(ref(x), t))));
    opt.step();
    ref_opt.step();
    opt.zero_grad();
    ref_opt.zero_grad();
    const std::string s = " after step " + std::to_string(step + 1);
    expect_close(lin.weight.full(), ref.weight.full(), 1e-12, "weight" + s);
    expect_close(lin.bias.full(), ref.bias.full(), 1e-12, "bias" + s);
  }
  // Sharded parameters have sharded state.
  EXPECT_EQ(opt.exp_avg()[0].shape(), lin.weight.local().shape());
  expect_close(gather(opt.exp_avg()[0], mesh, {Shard(0)}, {10, 6}), ref_opt.exp_avg()[0], 1e-12,
               "exp_avg");
}

TEST(NnDTensor, SGDMomentumOnDTensorParametersMatchesPlain) {
  DeviceMesh mesh = world_mesh();
  Generator g1(51), g2(51);
  auto ref_ptr = std::make_shared<Linear>(8, 3, true, g1);
  auto mod_ptr = std::make_shared<Linear>(8, 3, true, g2);
  Linear& ref = *ref_ptr;
  Linear& lin = *mod_ptr;
  to_float64(ref);
  to_float64(lin);
  distribute(lin.weight, mesh, {Shard(1)});
  lin.set_dtensor_io({mesh, {Replicate()}, {Shard(-1)}, {Replicate()}});
  SGDOptions o{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01};
  SGD opt(lin.parameters(), o), ref_opt(ref.parameters(), o);
  for (int step = 0; step < 3; ++step) {
    Tensor x = global_randn({5, 8}, 80 + uint64_t(step));
    backward(sum(square(lin(x))));
    backward(sum(square(ref(x))));
    opt.step();
    ref_opt.step();
    opt.zero_grad();
    ref_opt.zero_grad();
    expect_close(lin.weight.full(), ref.weight.full(), 1e-12, "weight");
    expect_close(lin.bias.full(), ref.bias.full(), 1e-12, "bias");
  }
}

// --- clip_grad_norm_ ---

namespace {

struct ClipCase {
  Shape shape;
  Placements placements;  // empty: plain parameter
};

void check_clip(const DeviceMesh* mesh, const std::vector<ClipCase>& cases, double max_norm,
                uint64_t seed, double norm_type = 2.0) {
  std::vector<Parameter> dist, plain;
  std::vector<Tensor> grads;
  for (size_t i = 0; i < cases.size(); ++i) {
    Tensor v = global_randn(cases[i].shape, seed + 2 * i);
    Tensor g = global_randn(cases[i].shape, seed + 2 * i + 1);
    grads.push_back(g);
    plain.emplace_back(v.clone());
    if (cases[i].placements.empty())
      dist.emplace_back(v);
    else
      dist.emplace_back(distribute_tensor(v, *mesh, cases[i].placements));
  }
  std::vector<Parameter*> dp, pp;
  for (size_t i = 0; i < cases.size(); ++i) {
    Tensor local = dist[i].is_dtensor()
                       ? distribute_tensor(grads[i], *mesh, cases[i].placements).to_local()
                       : grads[i].clone();
    Tensor leaf = dist[i].local();
    leaf.set_grad(local.clone());
    Tensor pleaf = plain[i].local();
    pleaf.set_grad(grads[i].clone());
    dp.push_back(&dist[i]);
    pp.push_back(&plain[i]);
  }
  const double want = clip_grad_norm_(pp, max_norm, norm_type);
  const double got = clip_grad_norm_(dp, max_norm, norm_type);
  EXPECT_NEAR(got, want, 1e-12 * want) << "norm_type " << norm_type;
  // Every rank computed the same norm, bit for bit.
  Tensor mine = from_vector<double>({got}), top = mine.clone(), bottom = mine.clone();
  world_group()->all_reduce(top, ReduceOp::Max)->wait();
  world_group()->all_reduce(bottom, ReduceOp::Min)->wait();
  EXPECT_EQ(top.item<double>(), bottom.item<double>()) << "norm_type " << norm_type;
  double direct = 0;
  for (const Tensor& g : grads)
    for (double v : g.to_vector<double>())
      direct = std::isinf(norm_type) ? std::max(direct, std::abs(v))
                                     : direct + std::pow(std::abs(v), norm_type);
  if (!std::isinf(norm_type)) direct = std::pow(direct, 1.0 / norm_type);
  EXPECT_NEAR(want, direct, 1e-12 * want) << "norm_type " << norm_type;
  for (size_t i = 0; i < cases.size(); ++i)
    expect_close(full_grad(dist[i]), plain[i].grad(), 1e-12, "clipped grad " + std::to_string(i));
}

}  // namespace

TEST(NnDTensor, ClipGradNormMixedPlacementsMatchesSingleRank) {
  DeviceMesh mesh = world_mesh();
  std::vector<ClipCase> cases = {
      {{10, 3}, {Shard(0)}},  // uneven
      {{4}, {Replicate()}},   // counted once
      {{5}, {}},              // plain
      {{3, 2}, {Shard(0)}},   // an empty shard on 4 ranks, same group as the first
      {{2, 7}, {Shard(1)}},
  };
  check_clip(&mesh, cases, 1.0, 90);  // clipped
  check_clip(&mesh, cases, 1e6, 91);  // not clipped
  // The largest magnitude is a max over the shards, not a sum; any p sums |g|^p.
  for (double p : {double(INFINITY), 1.0, 3.0}) {
    check_clip(&mesh, cases, 0.5, 92, p);
    check_clip(&mesh, cases, 1e6, 93, p);
  }
}

TEST(NnDTensor, ClipGradNormOnTwoDimMesh) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  std::vector<ClipCase> cases = {
      {{6, 5}, {Shard(0), Replicate()}}, {{6, 5}, {Replicate(), Shard(1)}},
      {{7, 3}, {Shard(0), Shard(0)}},    {{4, 4}, {Shard(1), Shard(0)}},
      {{3}, {Replicate(), Replicate()}}, {{2}, {}},
  };
  check_clip(&mesh, cases, 0.5, 100);
  check_clip(&mesh, cases, 0.5, 101, INFINITY);
  check_clip(&mesh, cases, 0.5, 102, 3.0);
}
