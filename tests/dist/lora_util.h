#pragma once
// The LoRA tests' decoder, adapters and layouts: plain, tensor parallel (LoRA applied before or
// after parallelize_module), FSDP, FSDP x TP, HSDP.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/affine_batch.h"
#include "dist/nn_dtensor_util.h"
#include "tessera/tessera.h"
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_error.h"

namespace tessera::testing {

// A model of one Linear under the path "proj": what a layer alone does (its collectives, its
// merges), with the Linear built by the test.
class OneLayer : public Module {
 public:
  explicit OneLayer(std::shared_ptr<Linear> l) : Module("OneLayer"), proj(std::move(l)) {
    register_module("proj", proj);
  }
  Tensor forward(const Tensor& x) override { return (*proj)(x); }
  std::shared_ptr<Linear> proj;
};

// A model of one table under the path "emb".
class OneTable : public Module {
 public:
  OneTable(int64_t num, int64_t dim) : Module("OneTable") {
    Generator gen(11);
    emb = std::make_shared<Embedding>(num, dim, gen);
    register_module("emb", emb);
  }
  Tensor forward(const Tensor& ids) override { return (*emb)(ids); }
  std::shared_ptr<Embedding> emb;
};

// The paths of the layers LoRA wrapped, in the model's order.
inline std::vector<std::string> wrapped(const LoraModel& lora) {
  std::vector<std::string> out;
  for (const auto& [path, l] : lora.layers())
    out.push_back(path);
  return out;
}

inline DecoderConfig lora_decoder_config() {
  DecoderConfig cfg;
  cfg.vocab_size = 32;
  cfg.dim = 32;
  cfg.n_layers = 2;
  cfg.n_heads = 4;
  cfg.n_kv_heads = 4;  // so that tensor parallelism of 4 keeps whole heads
  cfg.ffn_dim = 64;
  cfg.max_seq_len = 8;
  cfg.seed = 7;
  return cfg;
}

inline LoraConfig lora_test_config(LoraInit init = LoraInit::Kaiming) {
  LoraConfig c;
  c.r = 4;
  c.lora_alpha = 8;
  c.target_modules = {"wq", "wk", "wv", "wo", "w1", "w2", "w3"};
  c.init_lora_weights = init;
  c.seed = 3;
  return c;
}

struct LoraRun {
  std::string name;
  std::shared_ptr<Decoder> model;
  std::shared_ptr<LoraModel> lora;
  int64_t dp_rank = 0, dp_size = 1;
  Tensor logits(const Tensor& ids) { return (*model)(ids); }
};

struct LoraLayout {
  std::string name;
  std::function<LoraRun(const DecoderConfig&, const LoraConfig&)> build;
};

inline void lora_shard(const std::shared_ptr<Decoder>& net, const DeviceMesh& mesh) {
  for (auto& layer : net->layers)
    fully_shard(layer, mesh);
  fully_shard(net, mesh);
}

// Every layout of this world size (1, 2 or 4 ranks), with adapter slots `slots`.
inline std::vector<LoraLayout> lora_layouts(const LoraSlots& slots = {}) {
  const int64_t n = world_size();
  std::vector<LoraLayout> out;
  const std::string sn = std::to_string(n);
  if (n == 1) {
    out.push_back({"plain", [slots](const DecoderConfig& c, const LoraConfig& l) {
                     auto m = std::make_shared<Decoder>(c);
                     return LoraRun{"plain", m, apply_lora(m, l, "default", slots), 0, 1};
                   }});
    return out;
  }
  out.push_back(
      {"tp" + sn + " (LoRA after TP)", [n, sn, slots](const DecoderConfig& c, const LoraConfig& l) {
         auto m = std::make_shared<Decoder>(c);
         DeviceMesh mesh(Shape{n}, {"tp"});
         parallelize_module(m, mesh, decoder_tp_plan(c, mesh));
         return LoraRun{"tp" + sn, m, apply_lora(m, l, "default", slots), 0, 1};
       }});
  out.push_back(
      {"tp" + sn + " (LoRA first)", [n, sn, slots](const DecoderConfig& c, const LoraConfig& l) {
         auto m = std::make_shared<Decoder>(c);
         auto lora = apply_lora(m, l, "default", slots);
         DeviceMesh mesh(Shape{n}, {"tp"});
         parallelize_module(m, mesh, decoder_tp_plan(c, mesh));
         return LoraRun{"tp" + sn + " first", m, lora, 0, 1};
       }});
  out.push_back({"fsdp" + sn, [n, sn, slots](const DecoderConfig& c, const LoraConfig& l) {
                   auto m = std::make_shared<Decoder>(c);
                   auto lora = apply_lora(m, l, "default", slots);
                   DeviceMesh mesh(Shape{n}, {"dp"});
                   lora_shard(m, mesh);
                   return LoraRun{"fsdp" + sn, m, lora, mesh.local_rank(0), n};
                 }});
  if (n == 4) {
    out.push_back({"fsdp_tp_2x2", [slots](const DecoderConfig& c, const LoraConfig& l) {
                     auto m = std::make_shared<Decoder>(c);
                     DeviceMesh mesh(Shape{2, 2}, {"dp", "tp"});
                     parallelize_module(m, mesh["tp"], decoder_tp_plan(c, mesh["tp"]));
                     auto lora = apply_lora(m, l, "default", slots);
                     lora_shard(m, mesh["dp"]);
                     return LoraRun{"fsdp_tp_2x2", m, lora, mesh.local_rank(0), 2};
                   }});
    out.push_back({"hsdp_2x2", [slots](const DecoderConfig& c, const LoraConfig& l) {
                     auto m = std::make_shared<Decoder>(c);
                     auto lora = apply_lora(m, l, "default", slots);
                     DeviceMesh mesh(Shape{2, 2}, {"replicate", "shard"});
                     lora_shard(m, mesh);
                     return LoraRun{"hsdp_2x2", m, lora, world_rank(), 4};
                   }});
  }
  return out;
}

// The collectives of one forward and of one backward of `m` on `x`, by kind; the input requires
// grad, as inside a network.
inline std::pair<std::map<std::string, int64_t>, std::map<std::string, int64_t>> count_collectives(
    Module& m, const Tensor& x) {
  world_group()->barrier()->wait();
  Tensor in = x.detach().clone();
  in.set_requires_grad(true);
  reset_comm_op_counts();
  Tensor y = m(in);
  const auto forward = comm_op_counts();
  reset_comm_op_counts();
  backward(sum(mul(y, y)));
  return {forward, comm_op_counts()};
}

// One table's collectives in a forward and a backward on `ids` (ids that need no gradient).
inline std::pair<std::map<std::string, int64_t>, std::map<std::string, int64_t>> table_collectives(
    Module& m, const Tensor& ids) {
  world_group()->barrier()->wait();
  reset_comm_op_counts();
  const Tensor y = m(ids);
  const auto forward = comm_op_counts();
  reset_comm_op_counts();
  backward(sum(mul(y, y)));
  return {forward, comm_op_counts()};
}

// "all_reduce 2, broadcast 1", or "none".
inline std::string counts_str(const std::map<std::string, int64_t>& counts) {
  std::string s;
  for (const auto& [kind, k] : counts)
    s += (s.empty() ? "" : ", ") + kind + " " + std::to_string(k);
  return s.empty() ? "none" : s;
}

inline int64_t counts_total(const std::map<std::string, int64_t>& counts) {
  int64_t n = 0;
  for (const auto& [kind, k] : counts)
    n += k;
  return n;
}

// A decoder with LoRA (`config`, `slots`) under fully_shard over every rank, whose groups stay
// gathered after one pass on `ids`, in each of the two ways: reshard_after_forward off and a
// forward without grad, then reshard_after_backward off and a backward. `check` gets each model
// and a description of the state ("reshard_after_forward off"): what an adapter added or
// written then must still reach the next forward.
struct GatheredLora {
  std::shared_ptr<Decoder> model;
  std::shared_ptr<LoraModel> lora;
  std::shared_ptr<FSDPState> state;
};

inline void for_each_gathered_lora(
    const LoraConfig& config, const LoraSlots& slots, const Tensor& ids,
    const std::function<void(GatheredLora&, const std::string& what)>& check) {
  for (const bool after_backward : {false, true}) {
    const std::string what =
        after_backward ? "reshard_after_backward off" : "reshard_after_forward off";
    GatheredLora g;
    g.model = std::make_shared<Decoder>(lora_decoder_config());
    g.lora = apply_lora(g.model, config, "default", slots);
    g.state = fully_shard(g.model, DeviceMesh(Shape{world_size()}, {"dp"}));
    if (after_backward) {
      g.state->set_reshard_after_backward(false);
      backward(sum((*g.model)(ids)));
    } else {
      g.state->set_reshard_after_forward(false);
      NoGradGuard no_grad;
      (void)(*g.model)(ids);
    }
    ASSERT_TRUE(g.state->is_unsharded()) << what;
    check(g, what);
  }
}

// The run's logits of `ids` are `want` (1e-5) with "default" merged (where fully_shard does not
// hold the layers: it refuses the merge) and unmerged again.
inline void expect_merge_keeps_logits(LoraRun& run, const Tensor& ids, const Tensor& want,
                                      const std::string& layout) {
  NoGradGuard no_grad;
  if (layout.rfind("fsdp", 0) != 0 && layout.rfind("hsdp", 0) != 0) {
    run.lora->merge_adapter("default");
    expect_close(run.logits(ids), want, 1e-5, "merged");
    run.lora->unmerge_adapter("default");
  }
  expect_close(run.logits(ids), want, 1e-5, "unmerged");
}

// `ids` run once per adapter of `per_sample` alone (set_adapter; "" is the base model), then as a
// mixed batch that routes sample r to per_sample[r]: each sample's logits must be what its
// adapter alone gives (1e-5). Returns the logits of each adapter alone, in per_sample's order,
// and leaves no adapter active and no mixed batch set.
inline std::vector<Tensor> expect_mixed_batch_as_alone(LoraRun& run,
                                                       const std::vector<std::string>& per_sample,
                                                       const Tensor& ids) {
  NoGradGuard no_grad;
  std::vector<Tensor> alone;
  for (const std::string& name : per_sample) {
    run.lora->set_adapter(name);
    alone.push_back(run.logits(ids));
  }
  run.lora->set_adapter("");
  std::vector<int64_t> slot;
  for (const std::string& name : per_sample)
    slot.push_back(name.empty() ? -1 : run.lora->adapter_id(name));
  run.lora->set_batch_adapters(from_vector<int64_t>(slot));
  const Tensor mixed = run.logits(ids);
  for (size_t r = 0; r < per_sample.size(); ++r)
    expect_close(kernels::narrow(mixed, 0, int64_t(r), 1),
                 kernels::narrow(alone[r], 0, int64_t(r), 1), 1e-5,
                 "sample " + std::to_string(r) + " (" + per_sample[r] + ")");
  run.lora->set_batch_adapters(Tensor());
  return alone;
}

using nn_dtensor_test::full_grad;

// The run's model and its adapter table in one checkpoint file (keys "model" and "lora").
inline void save_lora_checkpoint(LoraRun& run, const std::string& path) {
  StateDict sd;
  insert_state_dict(sd, "model", get_model_state_dict(*run.model));
  insert_state_dict(sd, "lora", run.lora->state_dict());
  save(sd, path);
}

// Loads save_lora_checkpoint's file into the run: the model's values, then its adapter table.
inline void load_lora_checkpoint(LoraRun& run, const std::string& path) {
  StateDict in;
  insert_state_dict(in, "model", get_model_state_dict(*run.model));
  insert_state_dict(in, "lora", run.lora->state_dict());
  load(in, path);
  run.lora->load_state_dict(sub_state_dict(in, "lora"));
}

// Every parameter of the base model (not the adapters'), as global tensors.
inline std::map<std::string, Tensor> base_weights(Module& m) {
  std::map<std::string, Tensor> out;
  for (auto& [name, p] : m.named_parameters())
    if (name.find("lora_") == std::string::npos) out[name] = p->full().clone();
  return out;
}

// The largest change of a base parameter since `before` (base_weights' result).
inline double largest_change(Module& m, const std::map<std::string, Tensor>& before) {
  double d = 0;
  for (const auto& [name, t] : base_weights(m))
    d = std::max(d, max_abs_diff(t, before.at(name)));
  return d;
}

// One AdamW step on this rank's rows of global batch `step` (8 rows); the loss averaged over the
// world.
inline double lora_train_step(LoraRun& run, Optimizer& opt, int step) {
  const DecoderConfig cfg = lora_decoder_config();
  Batch b = affine_batch(step, 8, cfg.max_seq_len, cfg.vocab_size);
  const int64_t rows = 8 / run.dp_size;
  Tensor ids = kernels::narrow(b.ids, 0, run.dp_rank * rows, rows).contiguous();
  Tensor targets = kernels::narrow(b.targets, 0, run.dp_rank * rows, rows).contiguous();
  opt.zero_grad();
  Tensor loss = cross_entropy((*run.model)(ids), targets);
  backward(loss);
  opt.step();
  Tensor l = from_vector<double>({double(loss.item<float>())});
  world_group()->all_reduce(l, ReduceOp::Sum)->wait();
  return l.item<double>() / double(world_size());
}

// `steps` AdamW steps (lr 1e-2, no weight decay) over lora.parameters() of a one-process `model`
// on affine batches of 4 samples.
inline void train_one_process(Module& model, LoraModel& lora, int steps) {
  AdamW opt(lora.parameters(), AdamWOptions{.lr = 1e-2, .weight_decay = 0.0});
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    const Batch b = affine_batch(step, 4, 8, lora_decoder_config().vocab_size);
    backward(cross_entropy(model(b.ids), b.targets));
    opt.step();
  }
}

// A fine-tuning run's losses, adapter (read_adapter) and base weights, for parity checks.
struct LoraTrained {
  std::vector<double> losses;
  std::map<std::string, Tensor> adapter;
  std::map<std::string, Tensor> base;
};

// `steps` AdamW steps of lora_train_step on the active adapter "default".
inline LoraTrained lora_train(LoraRun& run, int steps) {
  // eps 1e-6: where a gradient is as small as Adam's eps (the first layer's key adapters see
  // gradients near 1e-8), eps 1e-8 turns its last-bit differences between layouts into 2e-6
  // differences of the update, which says nothing about the sharding.
  AdamW opt(run.lora->parameters(), AdamWOptions{.lr = 3e-3, .eps = 1e-6, .weight_decay = 0.0});
  LoraTrained t;
  for (int s = 0; s < steps; ++s)
    t.losses.push_back(lora_train_step(run, opt, s));
  t.adapter = run.lora->read_adapter("default");
  for (auto& [name, p] : run.model->named_parameters())
    if (name.find("lora_") == std::string::npos) t.base[name] = p->full();
  return t;
}

// A sharded run against the single-rank one: losses within 1e-6 relative, each adapter tensor
// within 1e-6 of the reference relative to its norm, the frozen base as it was (`initial`), and
// every replicated adapter tensor bitwise identical on the ranks that hold it.
inline void expect_lora_parity(LoraRun& run, const LoraTrained& got, const LoraTrained& ref,
                               const std::map<std::string, Tensor>& initial,
                               const std::string& name) {
  double worst_loss = 0, worst_param = 0;
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    EXPECT_NEAR(got.losses[s], ref.losses[s], 1e-6 * std::abs(ref.losses[s]))
        << name << " step " << s;
    worst_loss = std::max(worst_loss, std::abs(got.losses[s] - ref.losses[s]) / ref.losses[s]);
  }
  ASSERT_EQ(got.adapter.size(), ref.adapter.size()) << name;
  for (const auto& [key, t] : ref.adapter) {
    const auto a = got.adapter.at(key).to_vector<double>(), b = t.to_vector<double>();
    double diff = 0, norm = 0, worst_elem = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      diff += (a[i] - b[i]) * (a[i] - b[i]);
      norm += b[i] * b[i];
      worst_elem = std::max(worst_elem, std::abs(a[i] - b[i]));
    }
    const double rel = std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
    EXPECT_LE(rel, 1e-6) << name << " " << key << " (largest element difference " << worst_elem
                         << ")";
    worst_param = std::max(worst_param, rel);
  }
  for (const auto& [base, t] : got.base)
    EXPECT_EQ(max_abs_diff(t, initial.at(base)), 0.0) << name << ": frozen " << base;
  // Replicated adapter tensors (over dp without FSDP, over tp for the unsplit factor) stay
  // bitwise identical.
  for (Parameter* p : run.lora->parameters()) {
    if (!p->is_dtensor()) continue;
    SCOPED_TRACE(name + " " + p->str());
    expect_replicas_equal(p->stored_dtensor());
  }
  if (world_rank() == 0)
    std::printf(
        "[lora parity] %s: worst relative loss %.2e, worst relative adapter tensor %.2e "
        "(tolerance 1e-6)\n",
        name.c_str(), worst_loss, worst_param);
}

// A copy of the PEFT adapter saved in `dir`/adapter, in `dir`/`name`, whose adapter_config.json
// has the first `from` replaced by `to` (rank 0 writes it; every rank returns once it is there).
inline std::string peft_config_variant(const std::string& dir, const std::string& name,
                                       const std::string& from, const std::string& to) {
  if (world_rank() == 0) {
    std::filesystem::create_directories(dir + "/" + name);
    std::filesystem::copy_file(dir + "/adapter/adapter_model.safetensors",
                               dir + "/" + name + "/adapter_model.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    std::ifstream in(dir + "/adapter/adapter_config.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from << " in " << text;
    if (at != std::string::npos) text.replace(at, from.size(), to);
    std::ofstream(dir + "/" + name + "/adapter_config.json") << text;
  }
  world_group()->barrier()->wait();
  return dir + "/" + name;
}

// A PEFT config edited one way (its first `from` replaced by `to`) and what loading it must
// name.
struct PeftConfigEdit {
  const char* name;
  const char* from;
  const char* to;
  std::vector<std::string> error;
};

// Each edit of the adapter saved in `dir`/adapter (peft_config_variant), loaded into `lora` as
// an adapter of the edit's name: refused, naming its errors.
inline void expect_edits_refused(LoraModel& lora, const std::string& dir,
                                 const std::vector<PeftConfigEdit>& edits) {
  for (const PeftConfigEdit& e : edits) {
    const std::string path = peft_config_variant(dir, e.name, e.from, e.to);
    expect_error([&] { lora.load_adapter(path, e.name); }, e.error);
  }
}

}  // namespace tessera::testing
