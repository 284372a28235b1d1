#include "lm/options.h"

#include "cli.h"

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <stdexcept>

namespace lm {

namespace {
constexpr int64_t kBig = int64_t(1) << 40;  // upper bound of the flags without a natural one
}  // namespace

std::string usage() {
  return "usage: train_lm [--tp N] [--dp N] [--sequence-parallel] [--loss-parallel] [--fsdp]\n"
         "                [--steps N] [--grad-accum N] [--activation-checkpointing]\n"
         "                [--batch N] [--seq N] [--lr X] [--weight-decay X] [--clip X] [--seed N]\n"
         "                [--warmup N] [--cosine] [--min-lr X]\n"
         "                [--dim N] [--layers N] [--heads N] [--kv-heads N] [--ffn N]\n"
         "                [--corpus-chars N] [--log-every N] [--csv PATH]\n"
         "                [--checkpoint-dir DIR] [--save-every N] [--resume]\n"
         "Run under mpirun -np (tp * dp), or alone for tp = dp = 1. Without --dp, dp is the\n"
         "number of ranks / tp.\n"
         "Checkpoints go to DIR/step_<N>.h5 every N steps and at the end; --resume continues\n"
         "from the newest one in DIR, on any mesh.\n"
         "--warmup N raises the lr linearly from lr / N to lr over N steps; --cosine then lowers\n"
         "it along a cosine towards --min-lr (default 0), the lr after the last step. Without\n"
         "them the lr is constant.\n"
         "--activation-checkpointing recomputes each block's activations in the backward\n"
         "instead of keeping them (less memory, one more forward of the blocks).\n";
}

Options parse_options(int argc, char** argv) {
  Options o;
  // Each flag's value is checked whole and against its range where it is read.
  std::string flag;
  auto integer = [&flag](int64_t& dst, int64_t lo, int64_t hi = kBig) {
    return [&flag, &dst, lo, hi](const std::string& v) {
      dst = tessera::cli::parse_int(flag, v, lo, hi);
    };
  };
  auto real = [&flag](double& dst, double lo, double hi) {
    return [&flag, &dst, lo, hi](const std::string& v) {
      dst = tessera::cli::parse_real(flag, v, lo, hi);
    };
  };
  std::map<std::string, std::function<void(const std::string&)>> with_value = {
      {"--tp", integer(o.tp, 1)},
      {"--dp", integer(o.dp, 0)},
      {"--steps", integer(o.steps, 0)},
      {"--batch", integer(o.batch, 1)},
      {"--grad-accum", integer(o.grad_accum, 1)},
      {"--seq", integer(o.seq, 1)},
      {"--lr", real(o.lr, 0, 1e3)},
      {"--weight-decay", real(o.weight_decay, 0, 1e3)},
      {"--clip", real(o.clip, 0, 1e30)},
      {"--warmup", integer(o.warmup, 0)},
      {"--min-lr", real(o.min_lr, 0, 1e3)},
      {"--seed",
       [&](const std::string& v) { o.seed = uint64_t(tessera::cli::parse_int(flag, v, 0, kBig)); }},
      {"--dim", integer(o.dim, 1)},
      {"--layers", integer(o.layers, 1)},
      {"--heads", integer(o.heads, 1)},
      {"--kv-heads", integer(o.kv_heads, 1)},
      {"--ffn", integer(o.ffn, 1)},
      {"--corpus-chars", integer(o.corpus_chars, 1)},
      {"--log-every", integer(o.log_every, 1)},
      {"--csv", [&o](const std::string& v) { o.csv = v; }},
      {"--checkpoint-dir", [&o](const std::string& v) { o.checkpoint_dir = v; }},
      {"--save-every", integer(o.save_every, 0)},
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage().c_str(), stdout);
      std::exit(0);
    }
    if (a == "--sequence-parallel") {
      o.sequence_parallel = true;
      continue;
    }
    if (a == "--loss-parallel") {
      o.loss_parallel = true;
      continue;
    }
    if (a == "--fsdp") {
      o.fsdp = true;
      continue;
    }
    if (a == "--activation-checkpointing") {
      o.activation_checkpointing = true;
      continue;
    }
    if (a == "--cosine") {
      o.cosine = true;
      continue;
    }
    if (a == "--resume") {
      o.resume = true;
      continue;
    }
    auto it = with_value.find(a);
    if (it == with_value.end()) throw std::invalid_argument("unknown flag " + a + "\n" + usage());
    if (i + 1 >= argc) throw std::invalid_argument("flag " + a + " needs a value");
    flag = "train_lm: " + a;
    it->second(argv[++i]);
  }
  if ((o.save_every != 0 || o.resume) && o.checkpoint_dir.empty())
    throw std::invalid_argument("--save-every and --resume need --checkpoint-dir");
  if (o.cosine && o.warmup >= o.steps)
    throw std::invalid_argument("--cosine needs more --steps than --warmup steps, to decay over");
  if (o.min_lr > 0 && !o.cosine) throw std::invalid_argument("--min-lr needs --cosine");
  if (o.min_lr > o.lr) throw std::invalid_argument("--min-lr must not exceed --lr");
  return o;
}

}  // namespace lm
