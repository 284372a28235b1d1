#include "lm/options.h"

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <stdexcept>

namespace lm {

std::string usage() {
  return "usage: train_lm [--tp N] [--dp N] [--sequence-parallel] [--loss-parallel] [--fsdp]\n"
         "                [--steps N]\n"
         "                [--batch N] [--seq N] [--lr X] [--weight-decay X] [--clip X] [--seed N]\n"
         "                [--dim N] [--layers N] [--heads N] [--kv-heads N] [--ffn N]\n"
         "                [--corpus-chars N] [--log-every N] [--csv PATH]\n"
         "                [--checkpoint-dir DIR] [--save-every N] [--resume]\n"
         "Run under mpirun -np (tp * dp), or alone for tp = dp = 1.\n"
         "Checkpoints go to DIR/step_<N>.h5 every N steps and at the end; --resume continues\n"
         "from the newest one in DIR, on any mesh.\n";
}

Options parse_options(int argc, char** argv) {
  Options o;
  // Whole values only: "12abc" is an error, not 12.
  auto integer = [](int64_t& dst) {
    return [&dst](const std::string& v) {
      size_t used = 0;
      dst = std::stoll(v, &used);
      if (used != v.size()) throw std::invalid_argument(v);
    };
  };
  auto real = [](double& dst) {
    return [&dst](const std::string& v) {
      size_t used = 0;
      dst = std::stod(v, &used);
      if (used != v.size()) throw std::invalid_argument(v);
    };
  };
  std::map<std::string, std::function<void(const std::string&)>> with_value = {
      {"--tp", integer(o.tp)},
      {"--dp", integer(o.dp)},
      {"--steps", integer(o.steps)},
      {"--batch", integer(o.batch)},
      {"--seq", integer(o.seq)},
      {"--lr", real(o.lr)},
      {"--weight-decay", real(o.weight_decay)},
      {"--clip", real(o.clip)},
      {"--seed", [&o](const std::string& v) { o.seed = std::stoull(v); }},
      {"--dim", integer(o.dim)},
      {"--layers", integer(o.layers)},
      {"--heads", integer(o.heads)},
      {"--kv-heads", integer(o.kv_heads)},
      {"--ffn", integer(o.ffn)},
      {"--corpus-chars", integer(o.corpus_chars)},
      {"--log-every", integer(o.log_every)},
      {"--csv", [&o](const std::string& v) { o.csv = v; }},
      {"--checkpoint-dir", [&o](const std::string& v) { o.checkpoint_dir = v; }},
      {"--save-every", integer(o.save_every)},
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
    if (a == "--resume") {
      o.resume = true;
      continue;
    }
    auto it = with_value.find(a);
    if (it == with_value.end()) throw std::invalid_argument("unknown flag " + a + "\n" + usage());
    if (i + 1 >= argc) throw std::invalid_argument("flag " + a + " needs a value");
    try {
      it->second(argv[++i]);
    } catch (const std::logic_error&) {
      throw std::invalid_argument("bad value '" + std::string(argv[i]) + "' for " + a);
    }
  }
  if ((o.save_every != 0 || o.resume) && o.checkpoint_dir.empty())
    throw std::invalid_argument("--save-every and --resume need --checkpoint-dir");
  if (o.save_every < 0) throw std::invalid_argument("--save-every must not be negative");
  return o;
}

}  // namespace lm
