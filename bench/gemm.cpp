// GEMM: tessera::kernels::matmul against raw Eigen on the same buffers, same run, one thread.
// Prints JSON; ratio = tessera_gflops / eigen_gflops from the best times (1.0 means no
// overhead), and paired_median_ratio, the median of the same ratio over back-to-back pairs, which
// is the steadier figure when other processes share the machine.
//
//   gemm [--quick]      --quick runs the small shapes only
//
// Each shape is timed best-of-N after a warm-up, alternating the two contenders so that drift
// in machine load hits both alike. Tessera allocates its output on every call (as a user's code
// would); Eigen writes into a preallocated buffer, which is the baseline's advantage to beat.

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "stats.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/linalg.h"
#include "tessera/core/random.h"

namespace {

using tessera::Tensor;
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const RowMat>;
using OutMap = Eigen::Map<RowMat>;

struct Case {
  const char* name;
  int64_t m, n, k;
  bool trans_a, trans_b;
};

struct Timing {
  double tessera_s = 1e30, eigen_s = 1e30, max_abs_diff = 0;
  // Median over reps of eigen_time / tessera_time measured back to back: load that lasts longer
  // than one pair slows both members alike and cancels out, which best-of alone cannot do.
  double paired_ratio = 0;
  int reps = 0;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The Eigen expression a user would write for op(A) op(B) on row-major buffers.
void eigen_product(const Case& c, const float* a, const float* b, float* out) {
  ConstMap A(a, c.trans_a ? c.k : c.m, c.trans_a ? c.m : c.k);
  ConstMap B(b, c.trans_b ? c.n : c.k, c.trans_b ? c.k : c.n);
  OutMap C(out, c.m, c.n);
  if (c.trans_a && c.trans_b)
    C.noalias() = A.transpose() * B.transpose();
  else if (c.trans_a)
    C.noalias() = A.transpose() * B;
  else if (c.trans_b)
    C.noalias() = A * B.transpose();
  else
    C.noalias() = A * B;
}

Timing run_case(const Case& c, double budget_s) {
  tessera::Generator gen(42);
  Tensor a = tessera::randn(c.trans_a ? tessera::Shape{c.k, c.m} : tessera::Shape{c.m, c.k}, gen);
  Tensor b = tessera::randn(c.trans_b ? tessera::Shape{c.n, c.k} : tessera::Shape{c.k, c.n}, gen);
  // Eigen's output comes from the same allocator (64-byte aligned) as Tessera's: where a 24 MB
  // buffer lands relative to the operands moves GEMM time by ~5% on this machine, and the
  // comparison must not hinge on that.
  Tensor eigen_out_t = tessera::empty({c.m, c.n});
  float* eigen_out = eigen_out_t.data<float>();

  // Warm-up both (page faults, Eigen's cache-size query), and estimate the repetition count.
  auto t0 = std::chrono::steady_clock::now();
  Tensor out = tessera::kernels::matmul(a, b, c.trans_a, c.trans_b);
  double one = seconds_since(t0);
  eigen_product(c, a.data<float>(), b.data<float>(), eigen_out);

  Timing t;
  const float* po = out.data<float>();
  for (int64_t i = 0; i < c.m * c.n; ++i)
    t.max_abs_diff = std::max(t.max_abs_diff, double(std::abs(po[i] - eigen_out[i])));
  out = Tensor();

  t.reps = int(std::clamp(budget_s / (2 * std::max(one, 1e-6)), 5.0, 200.0));
  std::vector<double> pair_ratios;
  for (int r = 0; r < t.reps; ++r) {
    double ts = 0, es = 0;
    // Alternate which contender goes first, so neither always inherits the other's cache state.
    for (int turn = 0; turn < 2; ++turn) {
      if ((turn == 0) == (r % 2 == 0)) {
        t0 = std::chrono::steady_clock::now();
        Tensor o = tessera::kernels::matmul(a, b, c.trans_a, c.trans_b);
        ts = seconds_since(t0);
        o = Tensor();  // freed outside the timed region, as Eigen's buffer is kept
      } else {
        t0 = std::chrono::steady_clock::now();
        eigen_product(c, a.data<float>(), b.data<float>(), eigen_out);
        es = seconds_since(t0);
      }
    }
    t.tessera_s = std::min(t.tessera_s, ts);
    t.eigen_s = std::min(t.eigen_s, es);
    pair_ratios.push_back(es / ts);
  }
  t.paired_ratio = tessera::bench::median(pair_ratios);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  std::vector<Case> cases = {
      {"square_256", 256, 256, 256, false, false},
      {"square_512", 512, 512, 512, false, false},
      {"square_1024", 1024, 1024, 1024, false, false},
      {"square_2048", 2048, 2048, 2048, false, false},
      // Transformer MLP at 4096 tokens, d_model 512, hidden 1536: up and down projections.
      {"x_w_up", 4096, 1536, 512, false, false},
      {"x_w_down", 4096, 512, 1536, false, false},
      // nn.Linear's forward, y = x W^T with W stored [out, in].
      {"x_wT_linear", 4096, 1536, 512, false, true},
      // Its weight gradient, dW = g^T x.
      {"gT_x_weight_grad", 1536, 512, 4096, true, false},
  };
  if (quick) cases.resize(2);
  const double budget_s = quick ? 0.5 : 6.0;

  std::printf("{\n  \"benchmark\": \"gemm\",\n  \"dtype\": \"float32\",\n  \"threads\": 1,\n");
  std::printf("  \"baseline\": \"raw Eigen %d.%d.%d, Map over the same buffers, noalias\",\n",
              EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION);
  std::printf("  \"results\": [\n");
  double min_ratio = 1e30, min_paired = 1e30;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    Timing t = run_case(c, budget_s);
    double flop = 2.0 * double(c.m) * double(c.n) * double(c.k);
    double tg = flop / t.tessera_s * 1e-9, eg = flop / t.eigen_s * 1e-9;
    double ratio = tg / eg;
    min_ratio = std::min(min_ratio, ratio);
    min_paired = std::min(min_paired, t.paired_ratio);
    std::printf(
        "    {\"name\": \"%s\", \"m\": %lld, \"n\": %lld, \"k\": %lld, \"trans_a\": %s, "
        "\"trans_b\": %s, \"reps\": %d, \"tessera_ms\": %.4f, \"eigen_ms\": %.4f, "
        "\"tessera_gflops\": %.2f, \"eigen_gflops\": %.2f, \"ratio\": %.4f, "
        "\"paired_median_ratio\": %.4f, \"max_abs_diff\": %.3g}%s\n",
        c.name, (long long)c.m, (long long)c.n, (long long)c.k, c.trans_a ? "true" : "false",
        c.trans_b ? "true" : "false", t.reps, t.tessera_s * 1e3, t.eigen_s * 1e3, tg, eg, ratio,
        t.paired_ratio, t.max_abs_diff, i + 1 < cases.size() ? "," : "");
    std::fflush(stdout);
  }
  std::printf("  ],\n  \"min_ratio\": %.4f,\n  \"min_paired_median_ratio\": %.4f\n}\n", min_ratio,
              min_paired);
  return 0;
}
