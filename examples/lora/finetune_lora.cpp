// LoRA fine-tuning under FSDP x TP: trains the base decoder on the plain corpus (or resumes it
// from its checkpoint), freezes it, attaches adapters to the attention and MLP projections,
// fine-tunes them on another text (the same grammar with reversed word order), writes the PEFT
// directory, shows that the model with the adapter merged into its weights gives the same loss,
// and checkpoints the merged model with its adapter table, which a fresh model with an unmerged
// adapter loads to that loss again. Run under mpirun -np (tp * dp); 4 ranks make a (dp 2, tp 2)
// mesh.
//
//   finetune_lora [--tp N] [--dp N] [--base-steps N] [--steps N] [--r N] [--alpha X] [--lr X]
//                 [--base-checkpoint PATH] [--peft-dir DIR] [--lora-checkpoint PATH]
//                 [--log-every N] [--csv PATH]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>

#include "cli.h"
#include "lm/corpus.h"
#include "lm/loss_plot.h"

using namespace tessera;

namespace {

struct Options {
  int64_t tp = 2, dp = 0, base_steps = 300, steps = 200, r = 16, log_every = 20;
  double alpha = 32, lr = 3e-3;
  std::string base_checkpoint = "finetune_base.h5", peft_dir = "finetune_adapter",
              lora_checkpoint = "finetune_lora.h5", csv = "finetune_lora_loss.csv";
};

const char* kUsage =
    "usage: finetune_lora [--tp N] [--dp N] [--base-steps N] [--steps N] [--r N] [--alpha X]\n"
    "                     [--lr X] [--base-checkpoint PATH] [--peft-dir DIR]\n"
    "                     [--lora-checkpoint PATH] [--log-every N] [--csv PATH]\n"
    "Run under mpirun -np (tp * dp). The base model is trained --base-steps steps and saved to\n"
    "--base-checkpoint, or loaded from it when the file holds a base trained with the same\n"
    "--base-steps and --lr.\n";

constexpr int64_t kBig = int64_t(1) << 40;  // upper bound of the whole-number flags

Options parse(int argc, char** argv) {
  Options o;
  std::string flag;  // the one being read, for the error
  auto integer = [&flag](int64_t& dst, int64_t lo) {
    return [&flag, &dst, lo](const std::string& v) { dst = cli::parse_int(flag, v, lo, kBig); };
  };
  auto real = [&flag](double& dst) {
    return [&flag, &dst](const std::string& v) { dst = cli::parse_real(flag, v, 1e-30, 1e30); };
  };
  auto text = [](std::string& dst) { return [&dst](const std::string& v) { dst = v; }; };
  std::map<std::string, std::function<void(const std::string&)>> flags = {
      {"--tp", integer(o.tp, 1)},
      {"--dp", integer(o.dp, 0)},
      {"--base-steps", integer(o.base_steps, 0)},
      {"--steps", integer(o.steps, 0)},
      {"--r", integer(o.r, 1)},
      {"--alpha", real(o.alpha)},
      {"--lr", real(o.lr)},
      {"--base-checkpoint", text(o.base_checkpoint)},
      {"--peft-dir", text(o.peft_dir)},
      {"--lora-checkpoint", text(o.lora_checkpoint)},
      {"--log-every", integer(o.log_every, 1)},
      {"--csv", text(o.csv)}};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    auto it = flags.find(a);
    TESSERA_CHECK(it != flags.end(), "finetune_lora: unknown flag '", a, "'\n", kUsage);
    TESSERA_CHECK(i + 1 < argc, "finetune_lora: ", a, " needs a value");
    flag = "finetune_lora: " + a;
    it->second(argv[++i]);
  }
  TESSERA_CHECK(o.log_every > 0 && o.r > 0 && o.tp > 0,
                "finetune_lora: --log-every, --r and --tp "
                "must be positive");
  return o;
}

double now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

struct Run {
  const Options& o;
  DeviceMesh mesh;
  DecoderConfig cfg;
  int64_t rows, row0;
  static constexpr int64_t kBatch = 16, kSeq = 64;
  // The loss of one batch of `corpus`, averaged over the data-parallel ranks.
  double loss(Decoder& model, const lm::Corpus& corpus, int64_t step, uint64_t seed, bool train,
              Optimizer* opt) {
    lm::Corpus::Batch b = corpus.batch(step, kBatch, kSeq, row0, row0 + rows, seed);
    Tensor l;
    if (train) {
      l = cross_entropy(model(b.inputs), b.targets);
      backward(l);
      opt->step();
      opt->zero_grad();
    } else {
      NoGradGuard no_grad;
      l = cross_entropy(model(b.inputs), b.targets);
    }
    Tensor v = from_vector<double>({double(l.item<float>())});
    mesh.group("dp")->all_reduce(v, ReduceOp::Avg)->wait();
    return v.item<double>();
  }
  // The mean loss over a few fixed batches of `corpus` (the same on every run).
  double eval(Decoder& model, const lm::Corpus& corpus) {
    double s = 0;
    for (int64_t k = 0; k < 4; ++k)
      s += loss(model, corpus, 100000 + k, 99, false, nullptr);
    return s / 4;
  }
};

std::shared_ptr<Decoder> build(const Run& run, bool with_tp) {
  auto model = std::make_shared<Decoder>(run.cfg);
  if (with_tp && run.mesh.size(1) > 1)
    parallelize_module(model, run.mesh["tp"], decoder_tp_plan(run.cfg, run.mesh["tp"]));
  return model;
}

void shard(const std::shared_ptr<Decoder>& model, const DeviceMesh& mesh) {
  if (mesh.size(0) == 1) return;
  for (auto& block : model->layers)
    fully_shard(block, mesh["dp"]);
  fully_shard(model, mesh["dp"]);
}

// The base model's parameters (no adapters) as a sharded state dict under "model/".
StateDict base_state(Decoder& model) {
  StateDict sd;
  for (const auto& [key, v] : get_model_state_dict(model))
    if (key.find("lora_") == std::string::npos) sd["model/" + key] = v;
  return sd;
}

// The base run's settings, stored in its file beside the weights.
constexpr const char* kBaseSteps = "base_run/steps";
constexpr const char* kBaseLr = "base_run/lr";

// Whether the base checkpoint exists and was trained with this run's --base-steps and --lr: a
// file from other settings (or from before they were stored) is trained again and replaced, not
// reused as if it were this run's. Collective (a load).
bool base_file_fits(const Options& o) {
  if (!std::filesystem::exists(o.base_checkpoint)) return false;
  StateDict stored{{kBaseSteps, int64_t(-1)}, {kBaseLr, -1.0}};
  LoadOptions lenient;
  lenient.strict = false;
  load(stored, o.base_checkpoint, lenient);
  const int64_t steps = std::get<int64_t>(stored[kBaseSteps]);
  const double lr = std::get<double>(stored[kBaseLr]);
  const bool fits = steps == o.base_steps && lr == o.lr;
  if (!fits && world_rank() == 0) {
    if (steps < 0)
      std::printf("base model: %s does not say how it was trained; training it again\n",
                  o.base_checkpoint.c_str());
    else
      std::printf(
          "base model: %s was trained %lld steps at lr %g, not %lld at %g; training it "
          "again\n",
          o.base_checkpoint.c_str(), (long long)steps, lr, (long long)o.base_steps, o.lr);
  }
  return fits;
}

int run_main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const int64_t world = world_size();
  TESSERA_CHECK(o.dp != 0 || world % o.tp == 0, "finetune_lora: --tp ", o.tp,
                " does not divide the number of ranks (", world, ")");
  const int64_t dp = o.dp == 0 ? world / o.tp : o.dp;
  TESSERA_CHECK(o.tp * dp == world, "finetune_lora: --tp ", o.tp, " x --dp ", dp,
                " must equal the number of ranks (", world, ")");
  const bool lead = world_rank() == 0;
  lm::Corpus plain(200000, 1234), reversed(200000, 4321, lm::Corpus::Style::Reversed);
  Run run{o, DeviceMesh({dp, o.tp}, {"dp", "tp"}), {}, Run::kBatch / dp, 0};
  TESSERA_CHECK(Run::kBatch % dp == 0, "finetune_lora: the batch of ", Run::kBatch,
                " rows must divide over --dp ", dp);
  run.row0 = run.mesh.coordinate()[0] * run.rows;
  run.cfg.vocab_size = plain.vocab_size();
  run.cfg.dim = 128;
  run.cfg.n_layers = 2;
  run.cfg.n_heads = 4;
  run.cfg.n_kv_heads = 2;
  run.cfg.ffn_dim = 352;
  run.cfg.max_seq_len = Run::kSeq;
  run.cfg.seed = 1234;
  TESSERA_CHECK(reversed.vocab_size() == plain.vocab_size(), "finetune_lora: corpora differ");

  // 1. The base model: trained on the plain text under FSDP x TP, or resumed from its file.
  if (!base_file_fits(o)) {
    const auto dir = std::filesystem::path(o.base_checkpoint).parent_path();
    std::error_code ignored;  // save names the directory if it is still missing
    if (!dir.empty()) std::filesystem::create_directories(dir, ignored);
    auto base = build(run, true);
    shard(base, run.mesh);
    AdamW opt(base->parameters(), {o.lr, 0.9, 0.95, 1e-8, 0.01});
    if (lead)
      std::printf("base model: training %lld steps on the plain text (dp %lld x tp %lld)\n",
                  (long long)o.base_steps, (long long)dp, (long long)o.tp);
    for (int64_t s = 0; s < o.base_steps; ++s) {
      const double l = run.loss(*base, plain, s, 1234, true, &opt);
      if (lead && (s % (o.log_every * 5) == 0 || s + 1 == o.base_steps))
        std::printf("  base step %4lld  loss %.4f\n", (long long)s, l);
    }
    StateDict sd = base_state(*base);
    sd[kBaseSteps] = o.base_steps;
    sd[kBaseLr] = o.lr;
    save(sd, o.base_checkpoint);
    if (lead) std::printf("base model saved to %s\n", o.base_checkpoint.c_str());
  } else if (lead) {
    std::printf("base model: resuming from %s\n", o.base_checkpoint.c_str());
  }

  // 2. Adapters on the frozen base: LoRA before fully_shard, base weights from the checkpoint.
  auto model = build(run, true);
  LoraConfig lc;
  lc.r = o.r;
  lc.lora_alpha = o.alpha;
  lc.target_modules = {"wq", "wk", "wv", "wo", "w1", "w2", "w3"};
  lc.seed = 7;
  auto lora = apply_lora(model, lc);
  shard(model, run.mesh);
  StateDict sd = base_state(*model);
  load(sd, o.base_checkpoint);
  const double base_plain = run.eval(*model, plain), base_reversed = run.eval(*model, reversed);
  if (lead) {
    std::printf("LoRA r %lld alpha %g on 7 projections x %lld blocks: ", (long long)o.r, o.alpha,
                (long long)run.cfg.n_layers);
    lora->print_trainable_parameters();
    std::printf("before fine-tuning: loss %.4f on the plain text, %.4f on the reversed text\n",
                base_plain, base_reversed);
  }

  // 3. Fine-tuning on the reversed text.
  AdamW opt(lora->parameters(), {o.lr, 0.9, 0.95, 1e-8, 0.0});
  std::vector<double> losses;
  const double t0 = now();
  for (int64_t s = 0; s < o.steps; ++s) {
    losses.push_back(run.loss(*model, reversed, s, 4321, true, &opt));
    if (lead && (s % o.log_every == 0 || s + 1 == o.steps)) {
      std::printf("step %4lld  loss %.4f  %6.1f ms/step\n", (long long)s, losses.back(),
                  (now() - t0) / double(s + 1) * 1e3);
      std::fflush(stdout);
    }
  }
  const double tuned = run.eval(*model, reversed);

  // 4. The PEFT directory, then the adapter merged into the weights: the same loss.
  lora->save_adapter(o.peft_dir, "default");
  lora->merge_adapter("default", /*safe_merge=*/true);
  const double merged = run.eval(*model, reversed);

  // 5. The merged model checkpointed with its adapter table, loaded into a fresh model whose
  // adapter is not merged: the table marks it merged, so it applies once (in the weights).
  {
    StateDict out;
    insert_state_dict(out, "model", get_model_state_dict(*model));
    insert_state_dict(out, "lora", lora->state_dict());
    save(out, o.lora_checkpoint);
  }
  auto fresh = build(run, true);
  auto fresh_lora = apply_lora(fresh, lc);
  shard(fresh, run.mesh);
  StateDict in;
  insert_state_dict(in, "model", get_model_state_dict(*fresh));
  insert_state_dict(in, "lora", fresh_lora->state_dict());
  load(in, o.lora_checkpoint);
  fresh_lora->load_state_dict(sub_state_dict(in, "lora"));
  const double reloaded = run.eval(*fresh, reversed);
  bool wrote = true;
  if (lead) {
    {
      std::ofstream csv(o.csv);
      csv << "step,loss\n";
      for (size_t i = 0; i < losses.size(); ++i)
        csv << i << "," << losses[i] << "\n";
      csv.close();
      wrote = bool(csv);
    }
    if (!wrote)
      std::fprintf(stderr, "finetune_lora: could not write the loss curve to %s\n", o.csv.c_str());
    std::string why;
    const std::string png = lm::plot_loss_curve(o.csv, "finetune_lora: LoRA fine-tuning loss", why);
    std::printf("fine-tuning loss curve in %s%s%s\n", o.csv.c_str(),
                png.empty() ? " (no picture: " : " and ",
                png.empty() ? (why + ")").c_str() : png.c_str());
    std::printf("after fine-tuning: loss %.4f on the reversed text (from %.4f)\n", tuned,
                base_reversed);
    std::printf("adapter written to %s/ (adapter_model.safetensors, adapter_config.json)\n",
                o.peft_dir.c_str());
    std::printf("merged into the weights: loss %.4f (|difference| %.2e)\n", merged,
                std::abs(merged - tuned));
    std::printf("merged checkpoint %s reloaded with its adapter table: loss %.4f\n",
                o.lora_checkpoint.c_str(), reloaded);
  }
  // Non-zero when the example did not show what it is for (the test runs it short).
  const bool learned = tuned < base_reversed, same = std::abs(merged - tuned) <= 1e-4 * tuned;
  const bool reloads = reloaded == merged;  // the same values, the same computation
  if (lead && !learned) std::fprintf(stderr, "finetune_lora: fine-tuning did not lower the loss\n");
  if (lead && !same) std::fprintf(stderr, "finetune_lora: the merged model gives another loss\n");
  if (lead && !reloads)
    std::fprintf(stderr, "finetune_lora: the reloaded merged checkpoint gives another loss\n");
  return learned && same && reloads && wrote ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  return run_main(argc, argv);
}
