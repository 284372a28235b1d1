// Cross-entropy with label smoothing on class-index targets, forward and backward on the CPU,
// against the same loss without smoothing in the same run (the baseline: one fused kernel each
// way), the two interleaved: one untimed step each, then 9 rounds of one step each. Prints JSON per
// shape: best times of both, their ratio, the median and range of the per-round ratios, and the
// peak bytes each allocates above what was live before the call (logits and target excluded), also
// as a ratio to the logits' bytes: the gradient alone is 1.0.
//
//   cross_entropy [--quick]      --quick runs the small shape only

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "stats.h"
#include "tessera/tessera.h"

namespace {

using namespace tessera;

struct Case {
  int64_t rows, classes;
};

struct Run {
  double seconds = 1e30;
  int64_t peak_bytes = 0;
};

// One forward and backward of the mean loss into `run` (its best time and largest peak); the
// gradient is dropped before the next. Returns the step's seconds.
double time_step(const Tensor& logits, const Tensor& target, double label_smoothing, Run& run) {
  Tensor x = logits.detach();
  x.set_requires_grad(true);
  const int64_t before = memory_stats().current_bytes;
  reset_peak_memory();
  const auto t0 = std::chrono::steady_clock::now();
  Tensor loss = cross_entropy(x, target, -100, Reduction::Mean, label_smoothing);
  backward(loss);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  run.seconds = std::min(run.seconds, s);
  run.peak_bytes = std::max(run.peak_bytes, memory_stats().peak_bytes - before);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  std::vector<Case> cases = {{256, 4096}};
  if (!quick) cases.push_back({512, 32000});
  std::printf("[\n");
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    Generator gen(7);
    const Tensor logits = randn({c.rows, c.classes}, gen);
    std::vector<int64_t> t(size_t(c.rows));
    for (size_t i = 0; i < t.size(); ++i)
      t[i] = i % 8 == 7 ? -100 : int64_t(i * 7919) % c.classes;
    const Tensor target = from_vector<int64_t>(t, {c.rows});
    Run base, smooth, warm_up;
    time_step(logits, target, 0.0, warm_up);
    time_step(logits, target, 0.1, warm_up);
    std::vector<double> ratios;
    for (int round = 0; round < 9; ++round) {
      const double b = time_step(logits, target, 0.0, base);
      ratios.push_back(time_step(logits, target, 0.1, smooth) / b);
    }
    const bench::Spread paired = bench::spread(ratios);
    const double logits_bytes = double(logits.numel() * 4);
    std::printf(
        "  {\"rows\": %lld, \"classes\": %lld, \"plain_s\": %.6f, \"smoothed_s\": %.6f, "
        "\"time_ratio\": %.3f, \"paired_time_ratio\": {\"median\": %.3f, \"min\": %.3f, "
        "\"max\": %.3f}, \"plain_peak_bytes\": %lld, \"smoothed_peak_bytes\": %lld, "
        "\"plain_peak_per_logits\": %.3f, \"smoothed_peak_per_logits\": %.3f}%s\n",
        (long long)c.rows, (long long)c.classes, base.seconds, smooth.seconds,
        smooth.seconds / base.seconds, paired.median, paired.min, paired.max,
        (long long)base.peak_bytes, (long long)smooth.peak_bytes,
        double(base.peak_bytes) / logits_bytes, double(smooth.peak_bytes) / logits_bytes,
        k + 1 < cases.size() ? "," : "");
  }
  std::printf("]\n");
}
