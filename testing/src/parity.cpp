#include "tessera/testing/parity.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "tessera/comm/runtime.h"
#include "tessera/core/error.h"
#include "tessera/core/factory.h"
#include "tolerance.h"

namespace tessera::testing {

namespace {

double share(double got, double want, Tolerance tol) {
  return detail::tolerance_share(got, want, tol);
}

bool compares_parameters(int step, const ParityOptions& opts) {
  return (step + 1) % std::max(opts.compare_every, 1) == 0 || step + 1 == opts.steps;
}

std::optional<Divergence> compare_loss(int step, double got, double want, const ParityOptions& o,
                                       ParityResult& r) {
  const double s = share(got, want, o.loss);
  r.worst_loss_share = std::max(r.worst_loss_share, s);
  if (s <= 1) return std::nullopt;
  return Divergence{step, "loss",
                    "got " + detail::number_str(got) + ", want " + detail::number_str(want) +
                        " (allowed atol " + detail::number_str(o.loss.atol) + " + rtol " +
                        detail::number_str(o.loss.rtol) + " * |want|)"};
}

std::optional<Divergence> compare_parameters(int step, const std::map<std::string, Tensor>& got,
                                             const std::map<std::string, Tensor>& want,
                                             const ParityOptions& o, ParityResult& r) {
  for (const auto& [name, t] : got)
    if (!want.count(name)) return Divergence{step, name, "not a parameter of the reference"};
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    if (it == got.end()) return Divergence{step, name, "missing (the reference has it)"};
    const std::string problem = tensor_mismatch(it->second, w, o.parameters);
    if (it->second.shape() == w.shape()) {
      const std::vector<double> g = it->second.to_vector<double>(), v = w.to_vector<double>();
      for (size_t i = 0; i < g.size(); ++i)
        r.worst_parameter_share =
            std::max(r.worst_parameter_share, share(g[i], v[i], o.parameters));
    }
    if (!problem.empty()) return Divergence{step, name, problem};
  }
  return std::nullopt;
}

std::map<std::string, Tensor> snapshot(const TrainingRun& run) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : run.parameters())
    out[name] = t.detach().clone();
  return out;
}

// Every rank's value of `v`, in world-rank order.
std::vector<double> world_values(double v) {
  Tensor mine = from_vector<double>({v});
  Tensor all = empty({world_size()}, DType::Float64);
  world_group()->all_gather_into_tensor(all, mine)->wait();
  return all.to_vector<double>();
}

void check_run(const TrainingRun& run, const char* who) {
  TESSERA_CHECK(run.step && run.parameters, "parity: the run built for ", who,
                " lacks its step or parameters function");
}

}  // namespace

std::string ParityResult::str() const {
  if (divergence)
    return mesh + ": diverges after step " + std::to_string(divergence->step) + " in " +
           divergence->what + ": " + divergence->detail;
  char buf[160];
  std::snprintf(buf, sizeof buf,
                ": matches; largest difference %.3g of the tolerance in the losses, %.3g in the "
                "parameters",
                worst_loss_share, worst_parameter_share);
  return mesh + buf;
}

Trajectory record_trajectory(const MakeRun& make, const DeviceMesh* mesh,
                             const ParityOptions& opts) {
  TrainingRun run = make(mesh);
  check_run(run, mesh ? mesh->str().c_str() : "the reference");
  Trajectory t;
  for (int s = 0; s < opts.steps; ++s) {
    t.losses.push_back(run.step(s));
    if (compares_parameters(s, opts)) t.parameters[s] = snapshot(run);
  }
  return t;
}

ParityResult compare_trajectories(const Trajectory& got, const Trajectory& want,
                                  const ParityOptions& opts) {
  ParityResult r;
  const size_t steps = std::min(got.losses.size(), want.losses.size());
  for (size_t s = 0; s < steps && !r.divergence; ++s) {
    r.divergence = compare_loss(int(s), got.losses[s], want.losses[s], opts, r);
    auto g = got.parameters.find(int(s)), w = want.parameters.find(int(s));
    if (!r.divergence && g != got.parameters.end() && w != want.parameters.end())
      r.divergence = compare_parameters(int(s), g->second, w->second, opts, r);
  }
  if (!r.divergence && got.losses.size() != want.losses.size())
    r.divergence = Divergence{int(steps), "loss",
                              std::to_string(got.losses.size()) + " steps, the reference has " +
                                  std::to_string(want.losses.size())};
  return r;
}

namespace {

// Whether two ranks returned the same loss: NaN on both is the same (a loss that diverged
// everywhere, which the comparison with the reference reports), not ranks that disagree.
bool same_loss(double a, double b) {
  return a == b || (std::isnan(a) && std::isnan(b));
}

}  // namespace

ParityResult run_parity(const MakeRun& make, const DeviceMesh& mesh, const Trajectory& reference,
                        const ParityOptions& opts) {
  TESSERA_CHECK(int(reference.losses.size()) >= opts.steps, "run_parity: the reference has ",
                reference.losses.size(), " steps, ", opts.steps, " asked for");
  ParityResult r;
  r.mesh = mesh.str();
  TrainingRun run = make(&mesh);
  check_run(run, r.mesh.c_str());
  for (int s = 0; s < opts.steps && !r.divergence; ++s) {
    const double loss = run.step(s);
    const std::vector<double> losses = world_values(loss);
    for (size_t k = 0; k < losses.size() && !r.divergence; ++k)
      if (!same_loss(losses[k], losses[0]))
        r.divergence =
            Divergence{s, "loss",
                       "ranks disagree: rank 0 returned " + detail::number_str(losses[0]) +
                           ", rank " + std::to_string(k) + " " + detail::number_str(losses[k]) +
                           " (return the global loss, the same on every rank)"};
    if (!r.divergence) r.divergence = compare_loss(s, loss, reference.losses[size_t(s)], opts, r);
    auto want = reference.parameters.find(s);
    if (compares_parameters(s, opts)) {
      TESSERA_CHECK(want != reference.parameters.end(), "run_parity: the reference has no ",
                    "parameters after step ", s, " (record it with the same options)");
      // Taken on every rank, diverged or not: `parameters` may be collective (a state_dict
      // gathers DTensors), and a rank whose loss alone diverged (from a reference that depends
      // on the rank) would leave the others in it.
      const std::map<std::string, Tensor> got = snapshot(run);
      if (!r.divergence) r.divergence = compare_parameters(s, got, want->second, opts, r);
    }
    // Stop together: a rank that goes on alone would wait in the run's next collective.
    const std::vector<double> diverged = world_values(r.divergence ? 1.0 : 0.0);
    std::string ranks;
    for (size_t k = 0; k < diverged.size(); ++k)
      if (diverged[k] != 0) ranks.append(ranks.empty() ? "" : ", ").append(std::to_string(k));
    if (!ranks.empty() && !r.divergence)
      r.divergence = Divergence{s, "(on other ranks)", "rank(s) " + ranks + " diverged here"};
  }
  return r;
}

std::vector<ParityResult> expect_parity(const MakeRun& make, const std::vector<DeviceMesh>& meshes,
                                        const ParityOptions& opts, std::source_location where) {
  const Trajectory reference = record_trajectory(make, nullptr, opts);
  // Every rank computed the reference alone: its losses must agree bit for bit.
  for (size_t s = 0; s < reference.losses.size(); ++s) {
    const std::vector<double> all = world_values(reference.losses[s]);
    size_t k = 0;
    while (k < all.size() && same_loss(all[k], all[0]))
      ++k;
    if (k == all.size()) continue;
    ADD_FAILURE_AT(where.file_name(), int(where.line()))
        << "expect_parity: the reference run differs across ranks (loss of step " << s << ": "
        << detail::number_str(all[0]) << " on rank 0, " << detail::number_str(all[k]) << " on rank "
        << k << "): it must not depend on the rank, as a single-rank run cannot";
    break;
  }
  std::vector<ParityResult> out;
  for (const DeviceMesh& mesh : meshes) {
    out.push_back(run_parity(make, mesh, reference, opts));
    if (out.back().divergence)
      ADD_FAILURE_AT(where.file_name(), int(where.line()))
          << "expect_parity on rank " << world_rank() << ": " << out.back().str();
  }
  return out;
}

double world_mean(double value) {
  Tensor t = from_vector<double>({value});
  world_group()->all_reduce(t, ReduceOp::Sum)->wait();
  return t.item<double>() / double(world_size());
}

}  // namespace tessera::testing
