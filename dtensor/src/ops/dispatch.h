#pragma once
// The shared machinery of DTensor ops: redistribute inputs to what the rule asks, make the
// backward sum replicated inputs' partial gradients, run the local op, wrap the output.
#include <functional>
#include <string>
#include <vector>

#include "tessera/dtensor/dtensor.h"

namespace tessera::dtensor_ops {

struct ShardingDecision {
  std::vector<Placements> inputs;  // placements each input must have
  Placements output;
};

using LocalFn = std::function<Tensor(const std::vector<Tensor>&)>;

// Redistributes inputs to decision.inputs, runs `local` on the pieces and returns the output
// with decision.output placements and `out_shape` as global shape.
DTensor run(const char* op, const std::vector<DTensor>& inputs, const ShardingDecision& decision,
            const Shape& out_shape, const LocalFn& local);

// `local` itself, with a backward that sums its gradient over `mesh_dims` (deferred, so that the
// terms several uses of one input contribute are summed once).
Tensor sum_grad_over(const Tensor& local, const DeviceMesh& mesh, std::vector<int64_t> mesh_dims);

// A Partial whose pending reduction is a sum: the one that linear ops may pass through.
inline bool sum_partial(const Placement& p) {
  return p.is_partial() && p.reduce_op() == ReduceOp::Sum;
}

// Checks that all inputs live on one mesh; the error names the op and both meshes.
void check_same_mesh(const char* op, const std::vector<DTensor>& inputs);

// "op: no sharding rule for a [S(0), R] [4, 8], b [...]" followed by `why`.
[[noreturn]] void no_rule(const char* op, const std::vector<DTensor>& inputs,
                          const std::string& why);

}  // namespace tessera::dtensor_ops
