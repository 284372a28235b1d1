// Trains the LLaMA-style decoder on a generated character corpus, on a (dp, tp) mesh: tensor
// parallelism inside each data-parallel replica, gradients averaged across replicas. Prints a
// progress line per step (rank 0), a summary, and writes the loss curve to a CSV.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "lm/corpus.h"
#include "lm/loss_plot.h"
#include "lm/options.h"

using namespace tessera;

namespace {

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// Averages the local gradients of every parameter over the data-parallel group (plain data
// parallelism: every replica holds the whole model, or the same TP shards of it).
void average_gradients(const std::vector<Parameter*>& params, const ProcessGroupPtr& dp) {
  if (dp->size() == 1) return;
  for (Parameter* p : params) {
    Tensor g = p->grad();
    if (g.defined()) dp->all_reduce(g, ReduceOp::Avg)->wait();
  }
}

// What a checkpoint must agree on with the model this run builds.
std::string config_text(const DecoderConfig& c) {
  return "vocab_size=" + std::to_string(c.vocab_size) + " dim=" + std::to_string(c.dim) +
         " n_layers=" + std::to_string(c.n_layers) + " n_heads=" + std::to_string(c.n_heads) +
         " n_kv_heads=" + std::to_string(c.n_kv_heads) + " ffn_dim=" + std::to_string(c.ffn_dim) +
         " max_seq_len=" + std::to_string(c.max_seq_len);
}

// The lr schedule of the flags (options.h), or none for a constant lr.
std::shared_ptr<LRScheduler> make_schedule(const lm::Options& o, Optimizer& opt) {
  std::shared_ptr<LRScheduler> warm, decay;
  if (o.warmup > 0) warm = std::make_shared<LinearLR>(opt, 1.0 / double(o.warmup), 1.0, o.warmup);
  if (o.cosine) decay = std::make_shared<CosineAnnealingLR>(opt, o.steps - o.warmup, o.min_lr);
  if (warm && decay)
    return std::make_shared<SequentialLR>(opt,
                                          std::vector<std::shared_ptr<LRScheduler>>{warm, decay},
                                          std::vector<int64_t>{o.warmup});
  return warm ? warm : decay;
}

// What a resumed run must repeat to continue the same schedule ("none" for a constant lr): the
// cosine's length depends on --steps.
std::string schedule_text(const lm::Options& o) {
  if (o.warmup == 0 && !o.cosine) return "none";
  char buf[160];
  std::snprintf(buf, sizeof buf, "warmup=%lld cosine=%d min_lr=%.17g steps=%lld",
                (long long)o.warmup, int(o.cosine), o.min_lr, (long long)(o.cosine ? o.steps : 0));
  return buf;
}

// Model (the stored shards, in place), optimizer state, the steps done, the configuration and,
// with a schedule, its text and progress.
StateDict train_state(Decoder& model, AdamW& opt, const LRScheduler* schedule, const lm::Options& o,
                      int64_t steps_done) {
  StateDict sd;
  insert_state_dict(sd, "model", get_model_state_dict(model));
  insert_state_dict(sd, "optim", get_optimizer_state_dict(model, opt));
  sd["extras/step"] = steps_done;
  sd["extras/model_config"] = config_text(model.config());
  if (schedule) {
    sd["extras/lr_schedule"] = schedule_text(o);
    for (const auto& [key, v] : schedule->state_dict())
      sd["extras/lr_scheduler/" + key] = v;
  }
  return sd;
}

std::string checkpoint_path(const std::string& dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld.h5", (long long)step);
  return dir + "/" + name;
}

// The newest step_<N>.h5 in `dir` (files of saves that never committed are not named so).
std::optional<std::string> newest_checkpoint(const std::string& dir) {
  std::optional<std::string> best;
  if (!std::filesystem::is_directory(dir)) return best;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    const std::string name = f.path().filename().string();
    if (name.rfind("step_", 0) != 0 || f.path().extension() != ".h5") continue;
    if (!best || f.path().string() > *best) best = f.path().string();
  }
  return best;
}

// Loads the newest checkpoint of `dir` into the model, optimizer and schedule, whatever mesh
// saved it; returns the number of steps it had done.
int64_t resume(Decoder& model, AdamW& opt, LRScheduler* schedule, const lm::Options& o) {
  const std::string& dir = o.checkpoint_dir;
  const std::optional<std::string> path = newest_checkpoint(dir);
  TESSERA_CHECK(path.has_value(), "train_lm --resume: no checkpoint step_<N>.h5 in '", dir, "'");
  // The configuration first (every rank reads it): a model of another size would otherwise
  // fail on every tensor.
  const StateDict extras = read_checkpoint_info(*path).scalars;
  auto it = extras.find("extras/model_config");
  TESSERA_CHECK(it != extras.end() && std::holds_alternative<std::string>(it->second),
                "train_lm --resume: ", *path, " has no extras/model_config");
  const std::string saved = std::get<std::string>(it->second);
  TESSERA_CHECK(saved == config_text(model.config()), "train_lm --resume: ", *path,
                " holds a model with ", saved, "; this run builds ", config_text(model.config()),
                " (pass the same --dim, --layers, ... as the run that saved it)");
  // Checkpoints from before schedules existed have no text: a constant lr.
  auto sched = extras.find("extras/lr_schedule");
  TESSERA_CHECK(sched == extras.end() || std::holds_alternative<std::string>(sched->second),
                "train_lm --resume: ", *path, " has extras/lr_schedule of the wrong type (",
                state_value_str(sched->second), ")");
  const std::string saved_schedule =
      sched == extras.end() ? "none" : std::get<std::string>(sched->second);
  TESSERA_CHECK(saved_schedule == schedule_text(o), "train_lm --resume: ", *path,
                " was trained with the lr schedule ", saved_schedule, "; this run asks for ",
                schedule_text(o), " (pass the same --warmup, --cosine, --min-lr and --steps)");
  StateDict sd = train_state(model, opt, schedule, o, 0);
  load(sd, *path);
  set_optimizer_state_dict(model, opt, sub_state_dict(sd, "optim"));
  if (schedule) {
    std::map<std::string, double> progress;
    for (const auto& [key, v] : sub_state_dict(sd, "extras/lr_scheduler"))
      progress[key] = std::get<double>(v);
    schedule->load_state_dict(progress);
  }
  return std::get<int64_t>(sd.at("extras/step"));
}

DecoderConfig decoder_config(const lm::Options& o, int64_t vocab_size) {
  DecoderConfig cfg;
  cfg.vocab_size = vocab_size;
  cfg.dim = o.dim;
  cfg.n_layers = o.layers;
  cfg.n_heads = o.heads;
  cfg.n_kv_heads = o.kv_heads;
  cfg.ffn_dim = o.ffn;
  cfg.max_seq_len = o.seq;
  cfg.seed = o.seed;
  cfg.validate();
  return cfg;
}

struct Model {
  std::shared_ptr<Decoder> decoder;
  std::shared_ptr<FSDPState> fsdp;  // the root's, with --fsdp
};

// The decoder (each block checkpointed with --activation-checkpointing), tensor parallel over
// tp, then with --fsdp sharded over dp (FSDP x TP on the 2-D mesh): one group per block, then
// the root; FSDP then reduce-scatters and averages the gradients itself.
Model build_model(const lm::Options& o, const DecoderConfig& cfg, const DeviceMesh& mesh) {
  Model m{std::make_shared<Decoder>(cfg), nullptr};
  if (o.activation_checkpointing)
    for (auto& block : m.decoder->layers)
      checkpoint(block);
  if (o.tp > 1)
    parallelize_module(m.decoder, mesh["tp"],
                       decoder_tp_plan(cfg, mesh["tp"], {o.sequence_parallel, o.loss_parallel}));
  if (o.fsdp && o.dp > 1) {
    for (auto& block : m.decoder->layers)
      fully_shard(block, mesh["dp"]);
    m.fsdp = fully_shard(m.decoder, mesh["dp"]);
  }
  return m;
}

// This rank's mean loss over its rows; with loss parallelism the logits stay split over the
// vocabulary.
Tensor forward_loss(Decoder& model, const lm::Corpus::Batch& b, const DeviceMesh& tp_mesh,
                    bool loss_parallel) {
  Tensor logits = model(b.inputs);
  if (!loss_parallel) return cross_entropy(logits, b.targets);
  // The global shape: the vocabulary need not split evenly over the tp ranks.
  const Shape global{logits.size(0), logits.size(1), model.config().vocab_size};
  return vocab_parallel_cross_entropy(DTensor::from_local(logits, tp_mesh, {Shard(-1)}, global),
                                      b.targets)
      .to_local();
}

// One step's gradients from this rank's rows [row0, row0 + rows) of the global batch, in
// --grad-accum micro-batches whose losses are each divided by their number (the gradients add
// up to the whole batch's mean). Under FSDP the micro-batches but the last neither reduce-scatter
// (set_requires_gradient_sync) nor free the gathered weights after backward
// (set_reshard_after_backward: the next one's forward gathers nothing), as with PyTorch's FSDP2.
// Returns this rank's loss.
Tensor accumulate_gradients(const lm::Options& o, const Model& m, const lm::Corpus& corpus,
                            int64_t step, int64_t row0, int64_t rows, const DeviceMesh& tp_mesh,
                            bool loss_parallel) {
  const int64_t micro = rows / o.grad_accum;
  Tensor total;
  for (int64_t k = 0; k < o.grad_accum; ++k) {
    const bool last = k + 1 == o.grad_accum;
    if (m.fsdp) {
      m.fsdp->set_requires_gradient_sync(last);
      m.fsdp->set_reshard_after_backward(last);
    }
    const int64_t first = row0 + k * micro;
    lm::Corpus::Batch b = corpus.batch(step, o.batch, o.seq, first, first + micro, o.seed);
    Tensor loss = forward_loss(*m.decoder, b, tp_mesh, loss_parallel);
    if (o.grad_accum > 1) loss = mul(loss, 1.0 / double(o.grad_accum));
    backward(loss);
    total = total.defined() ? add(total, loss.detach()) : loss.detach();
  }
  return total;
}

// The loss curve's CSV (and picture) and the summary line (rank 0).
// False (said on stderr) when the CSV could not be written.
bool write_summary(const lm::Options& o, int64_t first_step, const std::vector<double>& losses,
                   const std::vector<double>& times, double total) {
  {
    std::ofstream csv(o.csv);
    csv << "step,loss,ms\n";
    for (size_t i = 0; i < losses.size(); ++i)
      csv << first_step + int64_t(i) << "," << std::fixed << std::setprecision(9) << losses[i]
          << "," << std::defaultfloat << std::setprecision(6) << times[i] * 1e3 << "\n";
    csv.close();
    if (!csv) {
      std::fprintf(stderr, "train_lm: could not write the loss curve to %s\n", o.csv.c_str());
      return false;
    }
  }
  std::string why;
  const std::string png = lm::plot_loss_curve(o.csv, "train_lm: training loss", why);
  std::printf(
      "summary: loss %.4f -> %.4f in %lld steps, %.1f s, %.0f tokens/s, peak %.1f MiB; "
      "loss curve in %s%s%s\n",
      losses.front(), losses.back(), (long long)losses.size(), total,
      double(o.batch * o.seq) * double(losses.size()) / total,
      double(memory_stats().peak_bytes) / (1 << 20), o.csv.c_str(),
      png.empty() ? " (no picture: " : " and ", png.empty() ? (why + ")").c_str() : png.c_str());
  return true;
}

int run(int argc, char** argv) {
  lm::Options o = lm::parse_options(argc, argv);
  const int64_t world = world_size();
  // Without --dp the data-parallel ranks are what tensor parallelism leaves.
  TESSERA_CHECK(o.dp != 0 || world % o.tp == 0, "train_lm: --tp ", o.tp,
                " does not divide the number of ranks (", world, ")");
  if (o.dp == 0) o.dp = world / o.tp;
  TESSERA_CHECK(o.tp * o.dp == world, "train_lm: --tp ", o.tp, " x --dp ", o.dp,
                " must equal the number of ranks (", world, ")");
  TESSERA_CHECK(o.batch % (o.dp * o.grad_accum) == 0, "train_lm: --batch ", o.batch,
                " must divide evenly over --dp ", o.dp, " x --grad-accum ", o.grad_accum);
  DeviceMesh mesh({o.dp, o.tp}, {"dp", "tp"});
  const bool lead = world_rank() == 0;

  lm::Corpus corpus(o.corpus_chars, o.seed);
  const DecoderConfig cfg = decoder_config(o, corpus.vocab_size());
  DeviceMesh tp_mesh = mesh["tp"];
  const bool loss_parallel = o.loss_parallel && o.tp > 1;
  const bool fsdp = o.fsdp && o.dp > 1;
  const Model built = build_model(o, cfg, mesh);
  const std::shared_ptr<Decoder>& model = built.decoder;
  int64_t n_params = 0;
  for (auto& [name, p] : model->named_parameters())
    n_params += shape_numel(p->global_shape());

  AdamW opt(model->parameters(), {o.lr, 0.9, 0.95, 1e-8, o.weight_decay});
  std::shared_ptr<LRScheduler> schedule = make_schedule(o, opt);
  int64_t first_step = 0;
  if (o.resume) first_step = resume(*model, opt, schedule.get(), o);
  if (!o.checkpoint_dir.empty() && lead) std::filesystem::create_directories(o.checkpoint_dir);
  const int64_t rows = o.batch / o.dp;
  const int64_t row0 = mesh.coordinate()[0] * rows;
  if (lead) {
    std::printf(
        "train_lm: %lld ranks (dp %lld x tp %lld%s%s%s%s%s), %lld parameters, vocab %lld, "
        "corpus %lld chars\n",
        (long long)world, (long long)o.dp, (long long)o.tp,
        o.sequence_parallel && o.tp > 1 ? ", sequence parallel" : "",
        loss_parallel ? ", loss parallel" : "", fsdp ? ", FSDP" : "",
        o.grad_accum > 1 ? (", " + std::to_string(o.grad_accum) + " micro-batches").c_str() : "",
        o.activation_checkpointing ? ", activation checkpointing" : "", (long long)n_params,
        (long long)cfg.vocab_size, (long long)corpus.size());
    // Flags that only act on a mesh dim larger than one.
    if (o.fsdp && !fsdp) std::printf("note: --fsdp does nothing with --dp 1\n");
    if (o.tp == 1 && (o.sequence_parallel || o.loss_parallel))
      std::printf("note: --sequence-parallel and --loss-parallel do nothing with --tp 1\n");
    if (first_step > 0)
      std::printf("resumed from step %lld of %s\n", (long long)first_step,
                  newest_checkpoint(o.checkpoint_dir)->c_str());
  }
  TESSERA_CHECK(first_step < o.steps || o.steps == 0, "train_lm: the checkpoint has done ",
                first_step, " steps already; --steps ", o.steps, " asks for no more");

  std::vector<double> losses, times;
  reset_peak_memory();
  const double t_start = now_seconds();
  // The previous save is written in the background while training goes on.
  AsyncSave pending;
  for (int64_t step = first_step; step < o.steps; ++step) {
    const double t0 = now_seconds();
    Tensor loss = accumulate_gradients(o, built, corpus, step, row0, rows, tp_mesh, loss_parallel);
    if (!fsdp) average_gradients(model->parameters(), mesh.group("dp"));
    if (o.clip > 0) clip_grad_norm_(model->parameters(), o.clip);
    const double lr = opt.lr();  // this step's
    opt.step();
    opt.zero_grad();
    if (schedule) schedule->step();
    Tensor l = loss.detach().clone();
    mesh.group("dp")->all_reduce(l, ReduceOp::Avg)->wait();
    const double dt = now_seconds() - t0;
    losses.push_back(l.item<double>());
    times.push_back(dt);
    if (lead && (step % o.log_every == 0 || step + 1 == o.steps)) {
      char lr_text[32] = "";
      if (schedule) std::snprintf(lr_text, sizeof lr_text, "  lr %.3e", lr);
      std::printf("step %5lld  loss %.4f  %8.0f tokens/s  %7.1f ms/step  peak %.1f MiB%s\n",
                  (long long)step, losses.back(), double(o.batch * o.seq) / dt, dt * 1e3,
                  double(memory_stats().peak_bytes) / (1 << 20), lr_text);
      std::fflush(stdout);
    }
    const bool last = step + 1 == o.steps;
    if (!o.checkpoint_dir.empty() &&
        (last || (o.save_every > 0 && (step + 1) % o.save_every == 0))) {
      const std::string path = checkpoint_path(o.checkpoint_dir, step + 1);
      pending = async_save(train_state(*model, opt, schedule.get(), o, step + 1), path);
      if (last) pending.wait();
      if (lead)
        std::printf("checkpoint: %s%s\n", path.c_str(), last ? "" : " (writing in the background)");
    }
  }
  if (!losses.empty() && lead &&
      !write_summary(o, first_step, losses, times, now_seconds() - t_start))
    return 1;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  return run(argc, argv);
}
