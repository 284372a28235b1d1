#include "dispatch.h"

#include "../mesh_sum.h"

#include <algorithm>
#include "tessera/autograd/deferred_reduction.h"
#include "tessera/autograd/function.h"

#include "tessera/core/factory.h"
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/views.h"

namespace tessera::dtensor_ops {

namespace {

using dtensor_detail::MeshSum;

// Identity forward; backward sums the gradients over the given mesh dims. Placed on the
// replicated inputs of an op whose output is sharded or partial on those dims. A single input's
// gradient is handed back unreduced for the engine to sum once with the other terms of the same
// activation (q, k and v read one input); several inputs of one op travel in one flat all-reduce
// per mesh dim (x and a replicated weight of the same op cost one collective, not two).
class SumGradsOver final : public autograd::Function {
 public:
  SumGradsOver(DeviceMesh mesh, std::vector<int64_t> mesh_dims)
      : mesh_(std::move(mesh)), dims_(std::move(mesh_dims)) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override { return in; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    if (g.size() == 1)
      return {autograd::reduce_later(*this, g[0], std::make_shared<MeshSum>(mesh_, dims_))};
    // One flat buffer per dtype (in practice one).
    std::vector<Tensor> out(g.size());
    std::vector<bool> done(g.size(), false);
    for (size_t i = 0; i < g.size(); ++i) {
      if (done[i]) continue;
      std::vector<size_t> same;
      int64_t n = 0;
      for (size_t j = i; j < g.size(); ++j)
        if (!done[j] && g[j].dtype() == g[i].dtype()) {
          same.push_back(j);
          n += g[j].numel();
        }
      Tensor flat = empty({n}, TensorOptions(g[i].dtype(), g[i].device()));
      int64_t at = 0;
      for (size_t j : same) {
        kernels::narrow(flat, 0, at, g[j].numel()).copy_(kernels::reshape(g[j], {g[j].numel()}));
        at += g[j].numel();
      }
      for (int64_t m : dims_)
        mesh_.group(m)->all_reduce(flat, ReduceOp::Sum)->wait();
      at = 0;
      for (size_t j : same) {
        out[j] = kernels::reshape(kernels::narrow(flat, 0, at, g[j].numel()), g[j].shape());
        at += g[j].numel();
        done[j] = true;
      }
    }
    return out;
  }

 private:
  DeviceMesh mesh_;
  std::vector<int64_t> dims_;
};

}  // namespace

void check_same_mesh(const char* op, const std::vector<DTensor>& inputs) {
  for (size_t i = 1; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    TESSERA_CHECK(inputs[i].mesh() == inputs[0].mesh(), op, ": inputs live on different meshes (",
                  inputs[0].mesh().str(), " and ", inputs[i].mesh().str(), ")");
  }
}

void no_rule(const char* op, const std::vector<DTensor>& inputs, const std::string& why) {
  std::string s;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    s += (s.empty() ? "" : ", ") + std::string("input ") + std::to_string(i) + " " +
         shape_str(inputs[i].shape()) + " " + placements_str(inputs[i].placements());
  }
  TESSERA_FAIL(op, ": no sharding rule for ", s, " on ",
               inputs.empty() ? std::string("?") : inputs[0].mesh().str(), ": ", why);
}

DTensor run(const char* op, const std::vector<DTensor>& inputs, const ShardingDecision& decision,
            const Shape& out_shape, const LocalFn& local) {
  check_same_mesh(op, inputs);
  const DeviceMesh& mesh = inputs[0].mesh();
  std::vector<Tensor> locals;
  // Replicated inputs whose gradients must be summed, grouped by the mesh dims to sum over.
  std::vector<std::pair<std::vector<int64_t>, std::vector<size_t>>> sums;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) {
      locals.emplace_back();
      continue;
    }
    DTensor x = inputs[i].redistribute(decision.inputs[i]);
    Tensor l = x.to_local();
    std::vector<int64_t> sum_dims;
    for (int64_t m = 0; m < mesh.ndim(); ++m)
      if (decision.inputs[i][size_t(m)].is_replicate() &&
          !decision.output[size_t(m)].is_replicate() && mesh.size(m) > 1)
        sum_dims.push_back(m);
    if (!sum_dims.empty() && l.requires_grad() && grad_enabled()) {
      auto it = std::find_if(sums.begin(), sums.end(),
                             [&](const auto& s) { return s.first == sum_dims; });
      if (it == sums.end())
        sums.push_back({sum_dims, {i}});
      else
        it->second.push_back(i);
    }
    locals.push_back(l);
  }
  for (const auto& [dims, which] : sums) {
    std::vector<Tensor> in;
    for (size_t i : which)
      in.push_back(locals[i]);
    std::vector<Tensor> out = autograd::Function::apply<SumGradsOver>(in, mesh, dims);
    for (size_t k = 0; k < which.size(); ++k)
      locals[which[k]] = out[k];
  }
  Tensor out = local(locals);
  auto spec = std::make_shared<const DTensorSpec>(mesh, decision.output, out_shape, out.dtype());
  Shape expect = spec->local_layout().local_shape;
  TESSERA_CHECK(out.shape() == expect, op, ": local result ", out.str(), " does not match ",
                shape_str(expect), " expected for ", spec->str(),
                " (internal sharding rule error)");
  return DTensor(std::move(spec), out);
}

Tensor sum_grad_over(const Tensor& local, const DeviceMesh& mesh, std::vector<int64_t> mesh_dims) {
  return autograd::Function::apply<SumGradsOver>({local}, mesh, std::move(mesh_dims))[0];
}

}  // namespace tessera::dtensor_ops
