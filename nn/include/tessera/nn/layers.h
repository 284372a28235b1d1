#pragma once
// Basic layers. Each draws its initial values with the shard-invariant RNG in registration
// order, so the same seed gives the same model under any parallelism.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/nn/module.h"

namespace tessera {

// y = x W^T + b, W [out, in]. Supports ColwiseParallel / RowwiseParallel (forward_dtensor).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias, Generator& gen);
  Tensor forward(const Tensor& x) override;
  DTensor forward_dtensor(const DTensor& x) override;
  // PyTorch's init: kaiming_uniform(a = sqrt(5)) for W, U(-1/sqrt(in), 1/sqrt(in)) for b.
  void reset_parameters(Generator& gen);

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  // A plain Linear taking over `base`'s weight and bias, as the constructor below does (undoing
  // a wrapper: LoRA's unload).
  static std::shared_ptr<Linear> unwrapped(const Linear& base);
  Parameter weight;
  Parameter bias;  // undefined without bias

 protected:
  // For subclasses that wrap an existing layer (LoRA): takes over its weight and bias (the same
  // tensors, distributed ones staying so), how it crosses into DTensors, its training mode, its
  // forward hooks and its activation checkpointing, drawing nothing.
  Linear(std::string type_name, const Linear& base);

 private:
  int64_t in_, out_;
};

// Token ids (int64, any shape) -> vectors [..., dim]. Supports vocabulary-parallel sharding of
// the weight (Shard(0)): each rank looks up the ids it owns and the partial results are summed.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, Generator& gen);
  Tensor forward(const Tensor& ids) override;
  DTensor forward_dtensor(const DTensor& ids) override;
  void reset_parameters(Generator& gen);  // N(0, 1) like PyTorch

  int64_t num_embeddings() const { return num_; }
  int64_t embedding_dim() const { return dim_; }
  // The table read as an output layer (a Decoder's tie_embeddings): the logits h W^T of hidden
  // states h [..., dim], W the whole table (the caller checks it is). A subclass whose lookup
  // reads other rows (LoRA's trainable tokens) projects onto those rows too, so that the tied
  // pair stays tied.
  virtual Tensor output_projection(const Tensor& h);
  // A plain Embedding taking over `base`'s weight, as the constructor below does (LoRA's unload).
  static std::shared_ptr<Embedding> unwrapped(const Embedding& base);
  Parameter weight;

 protected:
  // For subclasses that wrap an existing table (LoRA): takes over its weight (the same tensor, a
  // distributed one staying so), how it crosses into DTensors, its training mode, its forward
  // hooks and its activation checkpointing, drawing nothing.
  Embedding(std::string type_name, const Embedding& base);

 private:
  int64_t num_, dim_;
};

// Normalises the last dim. Supports SequenceParallel (input sharded on a non-normalised dim).
class RMSNorm : public Module {
 public:
  // No eps (PyTorch's eps=None) is rms_norm_default_eps of the input's dtype at each call
  // (1.19e-7 for float32, bfloat16 and float16), as nn.RMSNorm; DecoderConfig passes its norm_eps.
  explicit RMSNorm(int64_t dim, std::optional<double> eps = std::nullopt);
  Tensor forward(const Tensor& x) override;
  DTensor forward_dtensor(const DTensor& x) override;
  const std::optional<double>& eps() const { return eps_; }
  Parameter weight;  // ones

 private:
  std::optional<double> eps_;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5);
  Tensor forward(const Tensor& x) override;
  DTensor forward_dtensor(const DTensor& x) override;
  Parameter weight;  // ones
  Parameter bias;    // zeros

 private:
  double eps_;
};

}  // namespace tessera
