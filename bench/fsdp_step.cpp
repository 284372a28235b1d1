// Step time of the decoder under FSDP on N ranks against the same model, ranks and global batch
// with parameters replicated (HSDP with a shard group of one: gradients all-reduced), in one run;
// and how much of the all-gather time prefetch hides (FSDP with prefetch on against off), and the
// CPU time per step of the communication progress thread, with the CPUs it ran on (empty: its
// rank's own; see tessera/comm/progress.h). Run under mpirun -np N, N = 2, 4 or 8 (the global
// batch of 8 sequences is split evenly).
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "cli.h"
#include "decoder_step.h"
#include "tessera/comm/detail/progress_cpus.h"

using namespace tessera;

namespace {

struct Run {
  double step_seconds = 0;      // median
  double ag_wait_seconds = 0;   // per step: the computing thread waiting for all-gathers
  double all_gathers = 0;       // per step
  double progress_seconds = 0;  // per step: CPU time of the communication progress thread
  double progress_polls = 0;    // per step: its polls
};

Run time_fsdp(const DeviceMesh& mesh, bool prefetch, int steps, const bench::TokenBatch& tokens) {
  auto model = std::make_shared<Decoder>(bench::decoder_config());
  FSDPOptions opts;
  opts.forward_prefetch = opts.backward_prefetch = prefetch;
  std::vector<std::shared_ptr<FSDPState>> states;
  for (auto& block : model->layers)
    states.push_back(fully_shard(block, mesh, opts));
  states.push_back(fully_shard(model, mesh, opts));
  AdamW opt(model->parameters(), {});
  ProcessGroupPtr sync = world_group();
  std::vector<double> t;
  const int warmup = 2;
  ProgressStats progress_at_warmup;
  for (int s = 0; s < warmup + steps; ++s) {
    if (s == warmup) {
      for (auto& st : states)
        st->reset_comm_stats();
      progress_at_warmup = progress_stats();
    }
    sync->barrier()->wait();
    const double t0 = bench::now_seconds();
    backward(cross_entropy((*model)(tokens.inputs), tokens.targets));
    opt.step();
    opt.zero_grad();
    sync->barrier()->wait();
    if (s >= warmup) t.push_back(bench::now_seconds() - t0);
  }
  Run r;
  r.step_seconds = bench::median(t);
  r.progress_seconds = (progress_stats().cpu_seconds - progress_at_warmup.cpu_seconds) / steps;
  r.progress_polls = double(progress_stats().polls - progress_at_warmup.polls) / steps;
  for (auto& st : states) {
    r.ag_wait_seconds += st->comm_stats().all_gather_wait_seconds / steps;
    r.all_gathers += double(st->comm_stats().all_gathers) / steps;
  }
  return r;
}

using bench::median;

}  // namespace

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  const int n = world_size();
  TESSERA_CHECK(n >= 2 && 8 % n == 0, "bench/fsdp_step runs on 2, 4 or 8 ranks (mpirun -np N), ",
                "which split its global batch of 8 sequences evenly; got ", n);
  TESSERA_CHECK(argc <= 3, "usage: fsdp_step [STEPS [ROUNDS]]");
  const int steps = argc > 1 ? int(cli::parse_int("fsdp_step: STEPS", argv[1], 1, 100000)) : 10;
  const int rounds = argc > 2 ? int(cli::parse_int("fsdp_step: ROUNDS", argv[2], 1, 1000)) : 3;
  const int64_t rows = 8 / n, seq = 128;  // global batch 8 x 128
  const bench::TokenBatch tokens = bench::random_tokens(
      rows, seq, bench::decoder_config().vocab_size, 11 + uint64_t(world_rank()));
  DeviceMesh fsdp_mesh({n}, {"dp"});
  DeviceMesh replicated_mesh({n, 1}, {"replicate", "shard"});
  // Interleaved rounds, so a noisy moment of the machine hits every configuration alike.
  std::vector<double> rep, on, off, wait_on, wait_off, progress_on, progress_off, polls_on;
  double gathers = 0;
  for (int r = 0; r < rounds; ++r) {
    rep.push_back(time_fsdp(replicated_mesh, true, steps, tokens).step_seconds);
    const Run a = time_fsdp(fsdp_mesh, false, steps, tokens);
    const Run b = time_fsdp(fsdp_mesh, true, steps, tokens);
    off.push_back(a.step_seconds);
    wait_off.push_back(a.ag_wait_seconds);
    on.push_back(b.step_seconds);
    wait_on.push_back(b.ag_wait_seconds);
    progress_off.push_back(a.progress_seconds);
    progress_on.push_back(b.progress_seconds);
    polls_on.push_back(b.progress_polls);
    gathers = b.all_gathers;
  }
  const double t_rep = median(rep), t_on = median(on), t_off = median(off);
  const double w_on = median(wait_on), w_off = median(wait_off);
  if (world_rank() == 0) {
    std::printf(
        "{\"benchmark\": \"fsdp_step\", \"ranks\": %d, \"global_batch\": %lld, \"seq\": %lld, "
        "\"rounds\": %d, \"replicated_ms\": %.2f, \"fsdp_ms\": %.2f, "
        "\"fsdp_over_replicated\": %.3f, \"fsdp_no_prefetch_ms\": %.2f, "
        "\"all_gathers_per_step\": %.0f, \"all_gather_wait_ms_prefetch_off\": %.3f, "
        "\"all_gather_wait_ms_prefetch_on\": %.3f, \"all_gather_hidden_share\": %.3f, "
        "\"step_prefetch_on_over_off\": %.3f, \"progress_thread_cpu_ms_prefetch_off\": %.3f, "
        "\"progress_thread_cpu_ms_prefetch_on\": %.3f, \"progress_polls_prefetch_on\": %.0f, "
        "\"progress_cpus_rank0\": \"%s\"}\n",
        n, (long long)(n * rows), (long long)seq, rounds, t_rep * 1e3, t_on * 1e3, t_on / t_rep,
        t_off * 1e3, gathers, w_off * 1e3, w_on * 1e3, w_off > 0 ? 1.0 - w_on / w_off : 0.0,
        t_on / t_off, median(progress_off) * 1e3, median(progress_on) * 1e3, median(polls_on),
        detail::format_cpu_list(progress_stats().cpus).c_str());
  }
  return 0;
}
