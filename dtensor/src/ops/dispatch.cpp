#include "dispatch.h"

#include "tessera/autograd/function.h"
#include "tessera/core/kernels/elementwise.h"

namespace tessera::dtensor_ops {

namespace {

// Identity forward; backward sums the gradient over the given mesh dims. Placed on a replicated
// input whose consumer's output is sharded or partial on those dims.
class SumGradOver final : public autograd::Function {
 public:
  SumGradOver(DeviceMesh mesh, std::vector<int64_t> mesh_dims)
      : mesh_(std::move(mesh)), dims_(std::move(mesh_dims)) {}
  std::vector<Tensor> forward(const std::vector<Tensor>& in) override { return {in[0]}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) override {
    Tensor out = g[0].clone();
    for (int64_t m : dims_)
      mesh_.group(m)->all_reduce(out, ReduceOp::Sum)->wait();
    return {out};
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
    if (!sum_dims.empty() && l.requires_grad() && grad_enabled())
      l = autograd::Function::apply<SumGradOver>({l}, mesh, sum_dims)[0];
    locals.push_back(l);
  }
  Tensor out = local(locals);
  auto spec = std::make_shared<const DTensorSpec>(mesh, decision.output, out_shape, out.dtype());
  Shape expect = spec->local_layout().local_shape;
  TESSERA_CHECK(out.shape() == expect, op, ": local result ", out.str(), " does not match ",
                shape_str(expect), " expected for ", spec->str(),
                " (internal sharding rule error)");
  return DTensor(std::move(spec), out);
}

}  // namespace tessera::dtensor_ops
