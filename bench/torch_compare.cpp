// One training step (forward, backward, AdamW) of the decoder through Tessera against the same
// model and batch shape in PyTorch eager (bench/torch/decoder_step.py), both timed in this run on
// the same device: the figure is tessera_ms / torch_ms (median steps; PyTorch's spread too).
//
//   torch_compare [--device cpu|cuda] [--preset small|large] [--steps N] [--python PATH]
//
// small is bench/decoder_step.h's model (launch-bound on a GPU); large is a LLaMA-like 1024-wide
// model of 8 layers and a 32000-token vocabulary on 8 x 512 tokens. float32, TF32 off on both
// sides. Without PyTorch (the python cannot import torch) it prints Tessera's time and says so.
// On the CPU both run single-threaded. One rank; not a test.
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cli.h"
#include "decoder_step.h"

using namespace tessera;

namespace {

struct Preset {
  DecoderConfig cfg;
  int64_t batch = 8;
};

Preset preset(const std::string& name) {
  Preset p;
  if (name == "small") {
    p.cfg = bench::decoder_config();
    return p;
  }
  TESSERA_CHECK(name == "large", "torch_compare: --preset is small or large, not '", name, "'");
  p.cfg.vocab_size = 32000;
  p.cfg.dim = 1024;
  p.cfg.n_layers = 8;
  p.cfg.n_heads = 16;
  p.cfg.n_kv_heads = 8;
  p.cfg.ffn_dim = 2816;
  p.cfg.max_seq_len = 512;
  p.cfg.seed = 7;
  return p;
}

// Milliseconds of each timed step, sorted, after `warmup` untimed ones; every step starts and
// ends with the device idle.
std::vector<double> step_ms(const Preset& p, Device device, int warmup, int steps,
                            int64_t& parameters) {
  auto model = std::make_shared<Decoder>(p.cfg);
  model->to(device);
  parameters = 0;
  for (Parameter* param : model->parameters())
    parameters += param->local().numel();
  const bench::TokenBatch tokens =
      bench::random_tokens(p.batch, p.cfg.max_seq_len, p.cfg.vocab_size, 11);
  const Tensor inputs = tokens.inputs.to(device), targets = tokens.targets.to(device);
  AdamW opt(model->parameters(), AdamWOptions{});
  std::vector<double> ms;
  for (int s = 0; s < warmup + steps; ++s) {
    synchronize(device);
    const double t0 = bench::now_seconds();
    backward(cross_entropy((*model)(inputs), targets));
    opt.step();
    opt.zero_grad();
    synchronize(device);
    if (s >= warmup) ms.push_back((bench::now_seconds() - t0) * 1e3);
  }
  std::sort(ms.begin(), ms.end());
  return ms;
}

// PyTorch's JSON line, "" when it did not run (no torch, no such device).
std::string run_torch(const std::string& python, const Preset& p, const std::string& device,
                      int warmup, int steps) {
  const DecoderConfig& c = p.cfg;
  const std::string cmd =
      python + " " + TESSERA_SOURCE_DIR + "/bench/torch/decoder_step.py --device " + device +
      " --vocab " + std::to_string(c.vocab_size) + " --dim " + std::to_string(c.dim) +
      " --layers " + std::to_string(c.n_layers) + " --n-heads " + std::to_string(c.n_heads) +
      " --n-kv-heads " + std::to_string(c.n_kv_heads) + " --ffn-dim " + std::to_string(c.ffn_dim) +
      " --batch " + std::to_string(p.batch) + " --seq " + std::to_string(c.max_seq_len) +
      " --warmup " + std::to_string(warmup) + " --steps " + std::to_string(steps) + " 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return "";
  std::string out;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), int(buf.size()), f))
    out += buf.data();
  const int rc = pclose(f);
  if (rc != 0) {
    std::fprintf(stderr, "torch_compare: PyTorch did not run (%s):\n%s", cmd.c_str(), out.c_str());
    return "";
  }
  // The last line is the JSON.
  while (!out.empty() && out.back() == '\n')
    out.pop_back();
  const size_t nl = out.rfind('\n');
  return nl == std::string::npos ? out : out.substr(nl + 1);
}

// The number after "key": in a flat JSON line; negative when absent.
double json_number(const std::string& json, const std::string& key) {
  const size_t at = json.find("\"" + key + "\":");
  if (at == std::string::npos) return -1;
  return std::atof(json.c_str() + at + key.size() + 3);
}

}  // namespace

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  TESSERA_CHECK(world_size() == 1, "bench/torch_compare runs on one rank");
  std::string device_name = "cpu", preset_name = "small", python = "python3";
  int steps = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    TESSERA_CHECK(i + 1 < argc, "torch_compare: ", a, " needs a value");
    const std::string v = argv[++i];
    if (a == "--device") {
      device_name = v;
    } else if (a == "--preset") {
      preset_name = v;
    } else if (a == "--steps") {
      steps = int(cli::parse_int("torch_compare: --steps", v, 1, 100000));
    } else if (a == "--python") {
      python = v;
    } else {
      TESSERA_FAIL("torch_compare: unknown argument '", a,
                   "' (--device cpu|cuda, --preset small|large, --steps N, --python PATH)");
    }
  }
  TESSERA_CHECK(device_name == "cpu" || device_name == "cuda", "torch_compare: --device is cpu ",
                "or cuda, not '", device_name, "'");
  const Device device = device_name == "cpu" ? Device::cpu() : Device::cuda(0);
  if (device.is_cuda() && cuda_device_count() == 0) {
    std::printf("{\"benchmark\": \"torch_compare\", \"skipped\": \"no GPU\"}\n");
    return 0;
  }
  const Preset p = preset(preset_name);
  const int warmup = 3;
  int64_t parameters = 0;
  const std::vector<double> ours = step_ms(p, device, warmup, steps, parameters);
  const std::string theirs = run_torch(python, p, device_name, warmup, steps);
  const double ours_ms = bench::median(ours);
  const double torch_ms = theirs.empty() ? -1 : json_number(theirs, "median_ms");
  // The same model: the same parameters, tensor for tensor, so the same count.
  TESSERA_CHECK(theirs.empty() || int64_t(json_number(theirs, "parameters")) == parameters,
                "torch_compare: PyTorch's model has ", json_number(theirs, "parameters"),
                " parameters, Tessera's ", parameters, ": they are not the same model");
  std::printf(
      "{\"benchmark\": \"torch_compare\", \"device\": \"%s\", \"preset\": \"%s\", \"batch\": "
      "%lld, \"seq\": %lld, \"parameters\": %lld, \"steps\": %d, \"tessera_ms\": %.3f, "
      "\"tessera_min_ms\": %.3f, \"tessera_max_ms\": %.3f, ",
      device.str().c_str(), preset_name.c_str(), (long long)p.batch, (long long)p.cfg.max_seq_len,
      (long long)parameters, steps, ours_ms, ours.front(), ours.back());
  if (torch_ms > 0) {
    std::printf("\"pytorch\": %s, \"tessera_over_pytorch\": %.3f}\n", theirs.c_str(),
                ours_ms / torch_ms);
  } else {
    std::printf("\"pytorch\": null, \"note\": \"PyTorch did not run: no ratio\"}\n");
  }
  return 0;
}
