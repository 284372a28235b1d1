#pragma once
// Single-rank parity: a sharded training run must give the losses and parameters of the same
// training on one rank. The runner drives the user's run through two functions, records the
// reference once, replays each mesh in step with it, and stops at the first step where a loss or
// a parameter leaves the tolerance, naming both.
#include <functional>
#include <map>
#include <optional>
#include <source_location>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/dtensor/device_mesh.h"
#include "tessera/testing/checks.h"

namespace tessera::testing {

// One training run: the user's model, data and optimizer behind two functions.
struct TrainingRun {
  // Runs training step `step` (0, 1, ...) and returns its loss, the same value on every rank (for
  // data parallelism the mean over the data-parallel ranks: world_mean).
  std::function<double(int step)> step;
  // The parameters' global values by name: full_tensor() of DTensors, Module::state_dict().
  // Collective on a mesh.
  std::function<std::map<std::string, Tensor>()> parameters;
};

// Builds a fresh run on `mesh`, or the single-rank reference when `mesh` is null: plain tensors,
// the whole global batch, no communication (every rank computes it alike).
using MakeRun = std::function<TrainingRun(const DeviceMesh* mesh)>;

struct ParityOptions {
  int steps = 10;
  Tolerance loss{1e-5, 0};
  Tolerance parameters{1e-5, 1e-6};
  // Parameters are compared after every `compare_every` steps and after the last one.
  int compare_every = 1;
};

// Losses of every step and parameters after the compared steps.
struct Trajectory {
  std::vector<double> losses;
  std::map<int, std::map<std::string, Tensor>> parameters;  // by the step they were taken after
};

struct Divergence {
  int step = 0;      // the step after which it showed
  std::string what;  // "loss", or the parameter's name
  std::string detail;
};

struct ParityResult {
  std::string mesh;  // DeviceMesh::str(), "reference" for the reference
  std::optional<Divergence> divergence;
  // The largest difference seen, as a share of what the tolerance allowed there (above 1 is a
  // divergence): how much margin the tolerance has.
  double worst_loss_share = 0;
  double worst_parameter_share = 0;
  std::string str() const;  // one line: the divergence, or the margins
};

// Runs make(mesh) for opts.steps steps (mesh null: the reference). Collective on a mesh.
Trajectory record_trajectory(const MakeRun& make, const DeviceMesh* mesh,
                             const ParityOptions& opts);

// Compares two recorded trajectories step by step; no communication.
ParityResult compare_trajectories(const Trajectory& got, const Trajectory& want,
                                  const ParityOptions& opts);

// Runs make(&mesh) in step with `reference`, comparing after each step; every rank stops at the
// first step where any rank sees a divergence, so that no rank is left in a collective. Also
// reports ranks that disagree on a step's loss. Collective.
ParityResult run_parity(const MakeRun& make, const DeviceMesh& mesh, const Trajectory& reference,
                        const ParityOptions& opts);

// The reference once, then every mesh: a GoogleTest failure for each mesh that diverges, naming
// the mesh, the step and the parameter. Returns the results (rank 0 may print their margins).
std::vector<ParityResult> expect_parity(
    const MakeRun& make, const std::vector<DeviceMesh>& meshes, const ParityOptions& opts = {},
    std::source_location where = std::source_location::current());

// The mean of `value` over all ranks: the global loss of data-parallel ranks that each computed
// the mean loss of an equal share of the batch.
double world_mean(double value);

}  // namespace tessera::testing
