#pragma once
// The sum of a gradient's terms over some mesh dims, as a reduction the autograd engine may defer
// (tessera/autograd/deferred_reduction.h). The DTensor dispatcher hands out such terms for
// replicated inputs of sharded ops; the backward of an all-gather over the same mesh dim takes
// them as they are and reduce-scatters them (redistribute_function.cpp).
#include <functional>
#include <string>
#include <vector>

#include "tessera/autograd/deferred_reduction.h"
#include "tessera/dtensor/device_mesh.h"

namespace tessera::dtensor_detail {

class MeshSum final : public autograd::GradientReduction {
 public:
  MeshSum(DeviceMesh mesh, std::vector<int64_t> dims)
      : mesh_(std::move(mesh)), dims_(std::move(dims)) {}
  const DeviceMesh& mesh() const { return mesh_; }
  const std::vector<int64_t>& dims() const { return dims_; }

  bool same_as(const autograd::GradientReduction& other) const override {
    const auto* o = dynamic_cast<const MeshSum*>(&other);
    return o != nullptr && o->dims_ == dims_ && o->mesh_ == mesh_;
  }
  std::function<Tensor()> start(Tensor term) const override {
    // The term may be shared with the graph (an identity's input); reduce a copy.
    Tensor out = term.clone();
    WorkPtr first = mesh_.group(dims_[0])->all_reduce(out, ReduceOp::Sum);
    return [out, first, mesh = mesh_, dims = dims_]() mutable {
      first->wait();
      for (size_t k = 1; k < dims.size(); ++k)
        mesh.group(dims[k])->all_reduce(out, ReduceOp::Sum)->wait();
      return out;
    };
  }
  std::string str() const override {
    std::string s = "sum over mesh dims";
    for (int64_t m : dims_)
      s.append(" ").append(std::to_string(m));
    return s.append(" of ").append(mesh_.str());
  }

 private:
  DeviceMesh mesh_;
  std::vector<int64_t> dims_;
};

}  // namespace tessera::dtensor_detail
