// Layers with DTensor parameters (set up by hand, as a parallel style would): Linear, the
// module-level checks and sharded state dicts, and norms; every result and every gradient equals
// the same computation on one rank with plain tensors. Shapes are uneven on purpose. The
// embeddings, optimizers and clip_grad_norm_ are in the files beside it, of the same binary.
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
#include "tessera/testing/stand_in_device.h"

using namespace tessera;
using tessera::testing::expect_close;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;
using namespace tessera::nn_dtensor_test;

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

    Tensor xg = random_tensor({2, 3, 6}, 1, DType::Float64);
    Tensor x = xg.clone().set_requires_grad(true), rx = xg.clone().set_requires_grad(true);
    Tensor y = lin(x), ry = ref(rx);
    Tensor w = random_tensor({2, 3, 10}, 2, DType::Float64);
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

    Tensor xg = random_tensor({3, 8}, 5, DType::Float64);
    Tensor x = local_leaf(xg, mesh, {Shard(1)}), rx = xg.clone().set_requires_grad(true);
    Tensor y = lin(x), ry = ref(rx);
    expect_close(y, ry, 1e-12, "y");
    Tensor w = random_tensor({3, 5}, 6, DType::Float64);
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
  Tensor xg = random_tensor({4, 7}, 7, DType::Float64);
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
  Tensor x = random_tensor({2, 4}, 1, DType::Float32);
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
    Tensor v = random_tensor({6}, seed + 100 + name.size(), DType::Float64);
    p->copy_from_full(v);
    for (auto& [n2, q] : norm.named_parameters())
      if (n2 == name) q->copy_from_full(v);
  }
  const std::string what = norm.type_name() + " " + placements_str(x_placements) +
                           " T=" + std::to_string(seq) + (through_module ? " module" : " op");
  Tensor xg = random_tensor({2, seq, 6}, seed, DType::Float64);
  Tensor rx = xg.clone().set_requires_grad(true);
  Tensor ry = ref(rx);
  Tensor w = random_tensor({2, seq, 6}, seed + 1, DType::Float64);
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
  Tensor xg = random_tensor({3, 5}, 30, DType::Float64),
         wg = random_tensor({5}, 31, DType::Float64), bg = random_tensor({5}, 32, DType::Float64);
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
  Tensor wt = random_tensor({3, 5}, 33, DType::Float64);
  backward(sum(mul(y.to_local(), wt)));
  backward(sum(mul(ry, wt)));
  EXPECT_EQ(b.grad().placements(), (Placements{Shard(0)}));
  expect_close(w.grad().full_tensor(), rw.grad(), 1e-12, "dw");
  expect_close(b.grad().full_tensor(), rb.grad(), 1e-12, "db");
  expect_close(x.grad().full_tensor(), rx.grad(), 1e-12, "dx");
  expect_error(
      [&] {
        rms_norm(x, distribute_tensor(random_tensor({4}, 1, DType::Float64), mesh, {Replicate()}));
      },
      {"rms_norm", "[4]", "[3, 5]"});
}

TEST(NnDTensor, NormsOnTwoDimMesh) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  check_norm<RMSNorm>(mesh, {Shard(0), Shard(1)}, 5, false, 40);
  check_norm<LayerNorm>(mesh, {Shard(0), Shard(1)}, 4, true, 41);
  check_norm<LayerNorm>(mesh, {Shard(1), Shard(2)}, 6, false, 42);
}
