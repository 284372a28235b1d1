// DTensor, redistribution and FSDP on cuda:0 tensors over the host-staged MPI backend, against
// the same work on CPU tensors. The device is testing::TestDevice: a real GPU where there is one,
// else the stand-in, whose memory is host pages the CPU may not touch. Kernels run on host copies
// (KernelsOn::HostCopies), so results must equal the CPU's bit for bit, and any code that reads
// device data directly, or hands a device tensor to the CPU's MPI group, fails as it would on a
// GPU. One test runs the device's own kernels instead and compares within rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint_util.h"
#include "common/affine_batch.h"
#include "common/small_decoder.h"
#include "lora_util.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/tessera.h"
#include "tessera/testing.h"
#include "tessera/testing/stand_in_device.h"

using namespace tessera;
using tessera::testing::affine_batch;
using tessera::testing::Batch;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;
using tessera::testing::small_decoder_config;
using tessera::testing::TestDevice;

namespace {

std::vector<double> values(const Tensor& t) {
  return t.to(DType::Float64).to_vector<double>();
}

// A scratch folder of this registration's own: the suite runs once per backend, and ctest runs
// the registrations of one world size side by side, which must not write the same files.
std::string device_scratch_dir() {
  const char* backend = std::getenv("TESSERA_TEST_CUDA_BACKEND");
  return tessera::testing::scratch_dir(std::string("on_device") +
                                       (backend ? std::string("_") + backend : std::string()));
}

std::vector<Placements> placements_1d() {
  return {{Shard(0)}, {Shard(1)}, {Replicate()}, {Partial()}};
}

}  // namespace

TEST(OnDevice, DistributeAndFromLocalPutPiecesOnTheMeshDevice) {
  TestDevice device;
  const int n = world_size();
  DeviceMesh mesh(DeviceType::CUDA, Shape{n}, {"x"});
  const Tensor global = random_tensor({5, 3}, 11, DType::Float32);  // uneven over 2 and 4 ranks
  DTensor d = distribute_tensor(global, mesh, {Shard(0)});
  EXPECT_EQ(d.to_local().device(), Device::cuda(0));
  EXPECT_EQ(values(d.full_tensor()), values(global));
  EXPECT_TRUE(d.full_tensor().device().is_cuda());

  // A CPU piece given to from_local moves, and its gradient comes back to the CPU leaf.
  Tensor leaf = random_tensor({2, 3}, 12, DType::Float32);
  leaf.set_requires_grad(true);
  DTensor r = DTensor::from_local(leaf, mesh, {Replicate()});
  EXPECT_EQ(r.to_local().device(), Device::cuda(0));
  backward(sum(r.to_local()));
  ASSERT_TRUE(leaf.grad().defined());
  EXPECT_TRUE(leaf.grad().device().is_cpu());
  EXPECT_EQ(values(leaf.grad()), std::vector<double>(6, 1.0));

  expect_error([&] { DTensor(d.spec_ptr(), d.to_local().to(Device::cpu())); },
               {"DTensor", "is on cpu", "cuda:0"});
}

TEST(OnDevice, EveryPairOfPlacementsRedistributesAsOnTheCpu) {
  TestDevice device;
  const int n = world_size();
  DeviceMesh cuda_mesh(DeviceType::CUDA, Shape{n}, {"x"});
  DeviceMesh cpu_mesh(Shape{n}, {"x"});
  for (const Shape& shape : {Shape{8, 4}, Shape{5, 3}, Shape{1, 2}}) {
    const Tensor global = random_tensor(shape, 21, DType::Float32);
    for (const Placements& src : placements_1d()) {
      for (const Placements& dst : placements_1d()) {
        if (dst[0].is_partial() && !src[0].is_partial()) continue;  // R->P etc.: covered below
        const std::string what =
            placements_str(src) + " -> " + placements_str(dst) + " of " + shape_str(shape);
        DTensor on_cuda = distribute_tensor(global, cuda_mesh, src).redistribute(dst);
        DTensor on_cpu = distribute_tensor(global, cpu_mesh, src).redistribute(dst);
        ASSERT_EQ(on_cuda.to_local().device(), Device::cuda(0)) << what;
        EXPECT_EQ(values(on_cuda.to_local()), values(on_cpu.to_local())) << what;
      }
    }
  }
}

TEST(OnDevice, TwoDimMeshRedistributionAsOnTheCpu) {
  const int n = world_size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world";
  TestDevice device;
  DeviceMesh cuda_mesh(DeviceType::CUDA, Shape{2, n / 2}, {"dp", "tp"});
  DeviceMesh cpu_mesh(Shape{2, n / 2}, {"dp", "tp"});
  const Tensor global = random_tensor({6, 5}, 31, DType::Float32);
  const std::vector<std::pair<Placements, Placements>> pairs = {
      {{Shard(0), Shard(1)}, {Replicate(), Replicate()}},
      {{Shard(0), Shard(0)}, {Shard(1), Replicate()}},
      {{Partial(), Shard(1)}, {Shard(0), Shard(0)}},
      {{Replicate(), Partial()}, {Shard(1), Shard(0)}}};
  for (const auto& [src, dst] : pairs) {
    const std::string what = placements_str(src) + " -> " + placements_str(dst);
    DTensor on_cuda = distribute_tensor(global, cuda_mesh, src).redistribute(dst);
    DTensor on_cpu = distribute_tensor(global, cpu_mesh, src).redistribute(dst);
    EXPECT_EQ(values(on_cuda.to_local()), values(on_cpu.to_local())) << what;
    EXPECT_EQ(values(on_cuda.full_tensor()), values(on_cpu.full_tensor())) << what;
  }
}

namespace {

struct TrainingRun {
  std::vector<float> losses;
  std::map<std::string, Tensor> final_state;
};

// The FSDP parity decoder (blocks and root sharded) on the mesh's device.
std::shared_ptr<Decoder> sharded_decoder(const DeviceMesh& mesh) {
  auto net = std::make_shared<Decoder>(small_decoder_config());
  net->to(mesh.device());
  for (auto& layer : net->layers)
    fully_shard(layer, mesh);
  fully_shard(net, mesh);
  return net;
}

// Each rank trains on its own rows of the batch.
TrainingRun train_fully_sharded(const DeviceMesh& mesh, int steps,
                                std::shared_ptr<Decoder> net = nullptr,
                                std::shared_ptr<AdamW> opt = nullptr) {
  if (!net) net = sharded_decoder(mesh);
  if (!opt) opt = std::make_shared<AdamW>(net->parameters(), AdamWOptions{.lr = 3e-3});
  TrainingRun run;
  const int64_t rows = 2;
  for (int s = 0; s < steps; ++s) {
    Batch b = affine_batch(s, rows * world_size(), 8, small_decoder_config().vocab_size);
    Tensor ids = kernels::narrow(b.ids, 0, world_rank() * rows, rows).contiguous();
    Tensor targets = kernels::narrow(b.targets, 0, world_rank() * rows, rows).contiguous();
    opt->zero_grad();
    Tensor loss = cross_entropy((*net)(ids.to(mesh.device())), targets.to(mesh.device()));
    backward(loss);
    clip_grad_norm_(net->parameters(), 1.0);
    opt->step();
    run.losses.push_back(loss.item<float>());
  }
  for (Parameter* p : net->parameters())
    EXPECT_EQ(p->stored().device(), mesh.device()) << p->str();
  for (auto& [name, t] : net->state_dict())
    run.final_state[name] = t.to(Device::cpu());
  return run;
}

}  // namespace

TEST(OnDevice, FullyShardedTrainingMatchesTheCpuBitForBit) {
  const int n = world_size();
  const TrainingRun cpu = train_fully_sharded(DeviceMesh(Shape{n}, {"dp"}), 3);
  TestDevice device;
  const TrainingRun cuda = train_fully_sharded(DeviceMesh(DeviceType::CUDA, Shape{n}, {"dp"}), 3);
  EXPECT_EQ(cuda.losses, cpu.losses);
  ASSERT_EQ(cuda.final_state.size(), cpu.final_state.size());
  for (const auto& [name, t] : cpu.final_state)
    EXPECT_EQ(values(cuda.final_state.at(name)), values(t)) << name;
  EXPECT_EQ(memory_stats(Device::cuda(0)).current_bytes, 0) << "everything on the device freed";
}

TEST(OnDevice, FullyShardRefusesAModuleLeftOnTheCpu) {
  TestDevice device;
  auto net = std::make_shared<Decoder>(small_decoder_config());
  DeviceMesh mesh(DeviceType::CUDA, Shape{world_size()}, {"dp"});
  expect_error([&] { fully_shard(net, mesh); },
               {"fully_shard(Decoder)", "is on cpu", "holds its shards on cuda:0", "Module::to"});
}

// Full state dicts of device shards: cpu_offload gives rank 0 host tensors equal to the CPU
// model's, and broadcast_from_rank0 takes rank 0's device tensors through the CPU group.
TEST(OnDevice, FullStateDictsOfDeviceShardsOffloadAndBroadcast) {
  const int n = world_size();
  const StateDictOptions offload{.full_state_dict = true, .cpu_offload = true};
  const StateDict want =
      get_model_state_dict(*sharded_decoder(DeviceMesh(Shape{n}, {"dp"})), offload);
  TestDevice device;
  const DeviceMesh mesh(DeviceType::CUDA, Shape{n}, {"dp"});
  auto net = sharded_decoder(mesh);
  const StateDict got = get_model_state_dict(*net, offload);
  EXPECT_EQ(got.size(), world_rank() == 0 ? want.size() : 0u);
  for (const auto& [key, v] : got) {
    const Tensor& t = std::get<Tensor>(v);
    EXPECT_TRUE(t.device().is_cpu()) << key << " on " << t.device().str();
    tessera::testing::expect_identical(t, std::get<Tensor>(want.at(key)), key);
  }
  // Rank 0 holds device tensors (a full state dict without offload), changed so that loading
  // them shows.
  StateDict full = get_model_state_dict(*net, {.full_state_dict = true});
  if (world_rank() != 0) full.clear();
  for (auto& [key, v] : full)
    v = add(std::get<Tensor>(v), 1.0);
  auto other = sharded_decoder(mesh);
  const IncompatibleKeys k =
      set_model_state_dict(*other, full, {.full_state_dict = true, .broadcast_from_rank0 = true});
  EXPECT_TRUE(k.empty()) << k.str();
  const StateDict back = get_model_state_dict(*other, offload);
  for (const auto& [key, v] : back)
    tessera::testing::expect_identical(std::get<Tensor>(v),
                                       add(std::get<Tensor>(want.at(key)), 1.0), key);
}

// A checkpoint saved from device shards holds the same bytes as one saved from CPU shards, and
// loads back into device shards (and into CPU ones) that then train on alike.
TEST(OnDevice, CheckpointsOfDeviceShardsAreTheCpuOnes) {
  const int n = world_size();
  const std::string dir = device_scratch_dir();
  const std::string cpu_path = dir + "/cpu_np" + std::to_string(n) + ".h5";
  const std::string cuda_path = dir + "/cuda_np" + std::to_string(n) + ".h5";
  const DeviceMesh cpu_mesh(Shape{n}, {"dp"});
  auto save_after_training = [&](const DeviceMesh& mesh, const std::string& path) {
    auto net = sharded_decoder(mesh);
    auto opt = std::make_shared<AdamW>(net->parameters(), AdamWOptions{.lr = 3e-3});
    train_fully_sharded(mesh, 2, net, opt);
    StateDict sd;
    insert_state_dict(sd, "model", get_model_state_dict(*net));
    insert_state_dict(sd, "optim", get_optimizer_state_dict(*net, *opt));
    save(sd, path);
  };
  // Loads `path` into a fresh model on `mesh` and trains two more steps.
  auto resume = [&](const DeviceMesh& mesh, const std::string& path) {
    auto net = sharded_decoder(mesh);
    auto opt = std::make_shared<AdamW>(net->parameters(), AdamWOptions{.lr = 3e-3});
    StateDict sd;
    insert_state_dict(sd, "model", get_model_state_dict(*net));
    insert_state_dict(sd, "optim", get_optimizer_state_dict(*net, *opt));
    EXPECT_TRUE(load(sd, path).empty());
    set_model_state_dict(*net, sub_state_dict(sd, "model"));
    set_optimizer_state_dict(*net, *opt, sub_state_dict(sd, "optim"));
    return train_fully_sharded(mesh, 2, net, opt);
  };
  save_after_training(cpu_mesh, cpu_path);
  const TrainingRun cpu = resume(cpu_mesh, cpu_path);
  TestDevice device;
  const DeviceMesh cuda_mesh(DeviceType::CUDA, Shape{n}, {"dp"});
  save_after_training(cuda_mesh, cuda_path);
  for (const std::string key :
       {"model/layers.0.attention.wq.weight", "optim/state/norm.weight/exp_avg_sq"})
    tessera::testing::expect_identical(read_checkpoint_tensor(cuda_path, key),
                                       read_checkpoint_tensor(cpu_path, key), key);
  const TrainingRun cuda = resume(cuda_mesh, cuda_path);
  EXPECT_EQ(cuda.losses, cpu.losses);
  for (const auto& [name, t] : cpu.final_state)
    EXPECT_EQ(values(cuda.final_state.at(name)), values(t)) << name;
}

// A model on the device without any sharding (one GPU, or the norms tensor parallelism leaves
// whole): its state dict holds plain device tensors, which save from and load into host copies,
// as PyTorch's checkpoints take CUDA tensors.
TEST(OnDevice, CheckpointsOfPlainDeviceTensors) {
  TestDevice device;
  const std::string path =
      device_scratch_dir() + "/plain_np" + std::to_string(world_size()) + ".h5";
  DecoderConfig cfg = small_decoder_config();
  auto net = std::make_shared<Decoder>(cfg);
  net->to(Device::cuda(0));
  StateDict sd;
  insert_state_dict(sd, "model", get_model_state_dict(*net));
  save(sd, path);
  cfg.seed += 1;
  auto other = std::make_shared<Decoder>(cfg);
  other->to(Device::cuda(0));
  StateDict back;
  insert_state_dict(back, "model", get_model_state_dict(*other));
  EXPECT_TRUE(load(back, path).empty());
  set_model_state_dict(*other, sub_state_dict(back, "model"));
  const auto want = net->state_dict();
  for (const auto& [name, t] : other->state_dict()) {
    EXPECT_EQ(t.device(), Device::cuda(0)) << name;
    tessera::testing::expect_identical(t.to(Device::cpu()), want.at(name).to(Device::cpu()), name);
  }
}

namespace {

// The decoder under the TP plan on a 1-D mesh, every rank on the whole batch.
TrainingRun train_tensor_parallel(const DeviceMesh& mesh, DecoderTPOptions opts, int steps) {
  DecoderConfig cfg = small_decoder_config();
  auto net = std::make_shared<Decoder>(cfg);
  net->to(mesh.device());
  parallelize_module(net, mesh, decoder_tp_plan(cfg, mesh, opts));
  AdamW opt(net->parameters(), AdamWOptions{.lr = 3e-3});
  TrainingRun run;
  for (int s = 0; s < steps; ++s) {
    Batch b = affine_batch(s, 2, 8, cfg.vocab_size);
    opt.zero_grad();
    Tensor logits = (*net)(b.ids);
    EXPECT_EQ(logits.device(), mesh.device());
    const Tensor targets = b.targets.to(mesh.device());
    Tensor loss =
        opts.loss_parallel
            ? vocab_parallel_cross_entropy(
                  DTensor::from_local(logits, mesh, {Shard(-1)},
                                      Shape{b.ids.size(0), b.ids.size(1), cfg.vocab_size}),
                  targets)
                  .to_local()
            : cross_entropy(logits, targets);
    backward(loss);
    clip_grad_norm_(net->parameters(), 1.0);
    opt.step();
    run.losses.push_back(loss.item<float>());
  }
  for (auto& [name, t] : net->state_dict())
    run.final_state[name] = t.to(Device::cpu());
  return run;
}

}  // namespace

TEST(OnDevice, TensorParallelTrainingMatchesTheCpuBitForBit) {
  // Two kv heads: TP over pairs of ranks (or the one rank), the other factor running copies.
  const int n = world_size();
  const int tp = n % 2 == 0 ? 2 : 1;
  for (const DecoderTPOptions opts :
       {DecoderTPOptions{false, false}, DecoderTPOptions{true, true}}) {
    const std::string what = std::string("sequence_parallel ") +
                             (opts.sequence_parallel ? "on" : "off") + ", loss_parallel " +
                             (opts.loss_parallel ? "on" : "off");
    const TrainingRun cpu =
        train_tensor_parallel(DeviceMesh(Shape{n / tp, tp}, {"dp", "tp"})["tp"], opts, 3);
    TestDevice device;
    const TrainingRun cuda = train_tensor_parallel(
        DeviceMesh(DeviceType::CUDA, Shape{n / tp, tp}, {"dp", "tp"})["tp"], opts, 3);
    EXPECT_EQ(cuda.losses, cpu.losses) << what;
    for (const auto& [name, t] : cpu.final_state)
      EXPECT_EQ(values(cuda.final_state.at(name)), values(t)) << what << ": " << name;
  }
}

namespace {

void expect_close_run(const TrainingRun& device, const TrainingRun& cpu, const std::string& what) {
  ASSERT_EQ(device.losses.size(), cpu.losses.size()) << what;
  for (size_t s = 0; s < cpu.losses.size(); ++s)
    EXPECT_NEAR(device.losses[s], cpu.losses[s], 1e-4 * std::abs(cpu.losses[s]))
        << what << ": step " << s;
  for (const auto& [name, t] : cpu.final_state)
    tessera::testing::expect_close(device.final_state.at(name), t, 1e-4, what + ": " + name);
}

}  // namespace

// With the device's own kernels (on the stand-in, emulated), FSDP and TP training follow the CPU
// within 1e-4, and no kernel of theirs runs on host copies.
TEST(OnDevice, WithDeviceKernelsFsdpAndTensorParallelTrainingFollowTheCpu) {
  const int n = world_size();
  const int tp = n % 2 == 0 ? 2 : 1;
  const DecoderTPOptions opts{true, true};
  const TrainingRun fsdp_cpu = train_fully_sharded(DeviceMesh(Shape{n}, {"dp"}), 3);
  const TrainingRun tp_cpu =
      train_tensor_parallel(DeviceMesh(Shape{n / tp, tp}, {"dp", "tp"})["tp"], opts, 3);
  TestDevice device(tessera::testing::KernelsOn::Device);
  const int64_t fallbacks = kernels::host_fallback_calls();
  expect_close_run(train_fully_sharded(DeviceMesh(DeviceType::CUDA, Shape{n}, {"dp"}), 3), fsdp_cpu,
                   "FSDP on " + device.str());
  expect_close_run(
      train_tensor_parallel(DeviceMesh(DeviceType::CUDA, Shape{n / tp, tp}, {"dp", "tp"})["tp"],
                            opts, 3),
      tp_cpu, "TP (sequence and loss parallel) on " + device.str());
  EXPECT_EQ(kernels::host_fallback_calls(), fallbacks);
}

namespace {

// LoRA (with adapter dropout and trainable tokens) on the decoder: tensor parallel over the
// world, and at 4 ranks FSDP x TP on a 2 x 2 mesh; trains (the second step on a mixed batch of
// two adapters and the base model, routed on the device), merges and exports the adapter.
TrainingRun train_lora(DeviceType type, const std::string& dir) {
  using namespace tessera::testing;
  const int n = world_size();
  const DecoderConfig cfg = lora_decoder_config();
  LoraConfig lc = lora_test_config();
  lc.lora_dropout = 0.1;
  lc.trainable_token_indices = {{"", {3, 7, 11}}};
  auto net = std::make_shared<Decoder>(cfg);
  net->to(current_device(type));
  std::shared_ptr<LoraModel> lora;
  int64_t dp_rank = 0, dp_size = 1;
  if (n == 4) {
    DeviceMesh mesh(type, Shape{2, 2}, {"dp", "tp"});
    parallelize_module(net, mesh["tp"], decoder_tp_plan(cfg, mesh["tp"]));
    lora = apply_lora(net, lc, "default", {.max_adapters = 2});
    lora_shard(net, mesh["dp"]);
    dp_rank = mesh.local_rank(0);
    dp_size = 2;
  } else {
    DeviceMesh mesh(type, Shape{n}, {"tp"});
    parallelize_module(net, mesh, decoder_tp_plan(cfg, mesh));
    lora = apply_lora(net, lc, "default", {.max_adapters = 2});
  }
  LoraConfig second = lc;
  second.seed = 12;
  lora->add_adapter("second", second);
  lora->set_adapter("default");
  AdamW opt(net->parameters(), AdamWOptions{.lr = 1e-2});
  TrainingRun out;
  for (int s = 0; s < 3; ++s) {
    Batch b = affine_batch(s, 8, cfg.max_seq_len, cfg.vocab_size);
    const int64_t rows = 8 / dp_size;
    Tensor ids = kernels::narrow(b.ids, 0, dp_rank * rows, rows).contiguous();
    Tensor targets = kernels::narrow(b.targets, 0, dp_rank * rows, rows).contiguous();
    opt.zero_grad();
    if (s == 1) {
      std::vector<std::string> names;
      for (int64_t r = 0; r < rows; ++r)
        names.push_back(r % 3 == 0 ? "default" : r % 3 == 1 ? "second" : "__base__");
      lora->set_batch_adapters(names);
    }
    Tensor loss = cross_entropy((*net)(ids), targets.to(current_device(type)));
    backward(loss);
    opt.step();
    lora->set_batch_adapters(Tensor());
    out.losses.push_back(loss.item<float>());
  }
  lora->save_adapter(dir, "default");
  lora->merge_adapter("default");
  for (auto& [name, t] : net->state_dict())
    out.final_state[name] = t.to(Device::cpu());
  return out;
}

}  // namespace

TEST(OnDevice, LoraTrainsMergesAndExportsAsOnTheCpu) {
  const std::string dir = tessera::testing::scratch_dir("on_device_lora");
  const std::string sn = std::to_string(world_size());
  const TrainingRun cpu = train_lora(DeviceType::CPU, dir + "/cpu" + sn);
  TestDevice device;
  const TrainingRun cuda = train_lora(DeviceType::CUDA, dir + "/cuda" + sn);
  EXPECT_EQ(cuda.losses, cpu.losses);
  for (const auto& [name, t] : cpu.final_state)
    EXPECT_EQ(values(cuda.final_state.at(name)), values(t)) << name;
  const auto a = load_safetensors(dir + "/cuda" + sn + "/adapter_model.safetensors").tensors;
  const auto b = load_safetensors(dir + "/cpu" + sn + "/adapter_model.safetensors").tensors;
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [key, t] : b)
    EXPECT_EQ(values(a.at(key)), values(t)) << key;
}
