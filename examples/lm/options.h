#pragma once
#include <cstdint>
#include <string>

namespace lm {

struct Options {
  int64_t tp = 1;  // tensor-parallel degree
  int64_t dp = 0;  // data-parallel degree (0: world size / tp)
  bool sequence_parallel = false;
  bool loss_parallel = false;
  bool fsdp = false;  // shard parameters over dp (fully_shard per block and the root)
  int64_t steps = 200;
  int64_t batch = 16;  // global batch (rows)
  // Micro-batches per step: each rank's rows run in this many forward/backward passes whose
  // gradients add up before the one optimizer step (the same gradient, less activation memory).
  int64_t grad_accum = 1;
  // Each block's forward a checkpointed region: its activations recomputed in the backward.
  bool activation_checkpointing = false;
  int64_t seq = 64;
  double lr = 3e-3;
  double weight_decay = 0.01;
  double clip = 1.0;  // max gradient norm (0: off)
  // The lr schedule: a linear warmup from lr / warmup to lr over `warmup` steps, then with
  // `cosine` a cosine decay towards min_lr, the lr after the last step; neither: a constant lr.
  int64_t warmup = 0;
  bool cosine = false;
  double min_lr = 0;
  uint64_t seed = 1234;
  int64_t dim = 128;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t ffn = 352;
  int64_t corpus_chars = 200000;
  int64_t log_every = 10;
  std::string csv = "train_lm_loss.csv";
  // Checkpoints: <checkpoint_dir>/step_<N>.h5 every save_every steps and at the end (0: only at
  // the end); resume starts from the newest one there, on whatever mesh this run has.
  std::string checkpoint_dir;
  int64_t save_every = 0;
  bool resume = false;
};

// --name value flags; an unknown flag or bad value is an error naming it. --help prints usage.
Options parse_options(int argc, char** argv);
std::string usage();

}  // namespace lm
