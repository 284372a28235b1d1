#pragma once
// LoraLinear: a Linear with low-rank adapters, y = x W^T + b + sum over adapters of
// scale * (dropout(x) A^T) B^T. It is a Linear (the tensor-parallel styles apply to it) that
// takes over the wrapped layer's weight and bias under their own names, so the base model's
// parameter names do not change; each adapter slot adds "lora_A.<slot>.weight" [max_rank, in]
// and "lora_B.<slot>.weight" [out, max_rank], and with LoraSlots::use_dora
// "lora_magnitude_vector.<slot>.weight" [out] (DoRA's magnitude, laid out as B's rows: Shard(0)
// under a column-parallel W, replicated under a row-parallel one). The slots and their
// placements are LoraLayer's (lora_layer.h): column-parallel W Shard(0) gives A replicated and
// B Shard(0), row-parallel W Shard(1) gives A Shard(1) and B replicated.
//
// Each forward issues the collectives the layer issues without adapters, and no more (dropout's
// mask too: each slot's stream is the same on every rank by construction, so its draw skips the
// cross-rank check of DTensor's rand):
//  - column parallel: the base and adapter products are one DTensor op (linear_lowrank) whose
//    replicated inputs, x and A, have their gradients summed in the one all-reduce the layer's
//    backward makes anyway;
//  - row parallel: the partial base product and the partial adapter activations x A^T travel
//    together in the layer's one reduction, after which B applies to replicated activations (so
//    B's gradient needs no sum).
// Gradients of replicated adapter matrices come out summed over the ranks that share them by
// these DTensor rules, with nothing LoRA-specific in the backward.
//
// DoRA (a slot whose adapter has use_dora) scales the layer's product by m / ||W + scale B A||,
// the norm of each whole row: a row-parallel layer sums its rows' squares over the TP group, one
// all-reduce of [out] more per forward. With dropout in training it computes one more product
// of W, (x - dropout(x)) W^T, stacked on the batch dim with the layer's other product so that the
// two share the layer's one collective (an input without a whole batch dim, 1-D or split over
// the mesh, makes one more). See dora.cpp.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/lora/lora_layer.h"

namespace tessera {

class LoraLinear : public Linear, public LoraLayer {
 public:
  // Wraps `base` (plain or tensor-parallel) with `slots` preallocated adapter slots.
  LoraLinear(const Linear& base, const LoraSlots& slots, std::shared_ptr<LoraRouting> routing);

  Tensor forward(const Tensor& x) override;
  DTensor forward_dtensor(const DTensor& x) override;
  void after_tensor_parallel(const DeviceMesh& mesh) override { distribute_adapters(mesh); }
  std::vector<std::pair<std::string, std::string>> tensor_parallel_inputs() const override {
    return describe_adapters();
  }

  using LoraLayer::module;
  Module& module() override { return *this; }
  ModulePtr unwrapped() const override { return Linear::unwrapped(*this); }
  Parameter& base_weight() override { return weight; }
  Parameter* base_bias() override { return bias.defined() ? &bias : nullptr; }
  std::string adapter_key(bool a) const override { return a ? "lora_A.weight" : "lora_B.weight"; }

  void init_slot(int64_t i, const std::string& adapter, const LoraConfig& config,
                 const std::string& path) override;

 private:
  // --- DoRA (dora.cpp) ---
  Tensor forward_dora(const Tensor& x, const Tensor& w, const Tensor& b0, const Tensor& a,
                      const Tensor& b, int64_t slot, const Tensor& xl);
  DTensor forward_dtensor_dora(const DTensor& x, const DTensor& w, const DTensor& bd,
                               const DTensor& a, const DTensor& b, int64_t slot, const DTensor& xl);
  // The adapters' product with the layer's one collective: linear_lowrank (column parallel or
  // replicated), or the row-parallel reduction of [x W^T || x A^T] before B; routed when
  // `routing` is defined (a mixed batch).
  DTensor lowrank_dtensor(const DTensor& x, const DTensor& w, const DTensor& bd, const DTensor& a,
                          const DTensor& b, double scale, const DTensor& xl,
                          const LowRankRouting& routing) const;
};

}  // namespace tessera
