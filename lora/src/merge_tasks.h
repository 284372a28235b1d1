#pragma once
// PEFT's ways of merging task tensors (its merge_utils) and the truncated SVD of its "*svd"
// combinations, on whole host values in float64: add_weighted_adapter reads every adapter's
// global values, so this math never sees a shard.
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "tessera/core/random.h"

namespace tessera::lora_detail {

// task_arithmetic: sum_i w_i t_i. ties: each t_i pruned by magnitude to `density`, a majority
// sign elected per element over the pruned t_i (their sum's sign, or with `by_frequency` the
// sum of their signs; >= 0 is +), then sum_i w_i t_i over the t_i of that sign divided by how
// many there are (at least 1). magnitude_prune: each t_i pruned, then task_arithmetic. The dare
// forms prune at random instead: each value kept with probability `density` (a uniform draw
// below it) and divided by it, then task_arithmetic (dare_linear) or ties' sign election and
// average (dare_ties).
enum class TaskMerge { Arithmetic, Ties, MagnitudePrune, DareLinear, DareTies };

struct MergeOptions {
  double density = 1;  // >= 1 prunes nothing
  bool by_frequency = false;
  Generator* gen = nullptr;  // the dare forms' draws: each t_i's, in order, from here
};

// PEFT's magnitude_based_pruning: keeps the int(density * n) values of largest magnitude (the
// first by position among equal ones), zeroes the rest; density >= 1 keeps all.
std::vector<double> prune_by_magnitude(std::vector<double> t, double density);

std::vector<double> merge_tasks(TaskMerge how, const std::vector<std::vector<double>>& tasks,
                                const std::vector<double>& weights, const MergeOptions& options);

// The rank-k factors of `delta` [out, in] (row-major) PEFT's "*svd" combinations take: B = U S
// [out, k] and A = V^T [k, in] from its singular value decomposition, largest values first, so
// that B A is the best rank-k approximation. Past the matrix's rank (min(out, in)) the
// factors are zero-padded. With `clamp` (a quantile q in [0, 1]), every value of B and A is
// clamped to [-h, h], h the q-quantile (linear interpolation) of their values together.
std::pair<std::vector<double>, std::vector<double>> svd_factors(const std::vector<double>& delta,
                                                                int64_t out, int64_t in, int64_t k,
                                                                std::optional<double> clamp);

// The same factors of the product B A (b [out, r], a [r, in], row-major) without forming it:
// O((out + in) r^2) time and O((out + in) r) memory where the SVD of the product takes
// O(out in min(out, in)) and O(out in). Equal to svd_factors(B A) up to the sign of each pair
// of a column of B and a row of A (and, where singular values tie, their rotation).
std::pair<std::vector<double>, std::vector<double>> svd_factors_of_product(
    const std::vector<double>& b, const std::vector<double>& a, int64_t out, int64_t r, int64_t in,
    int64_t k, std::optional<double> clamp);

}  // namespace tessera::lora_detail
