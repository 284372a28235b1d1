// Linear, Embedding, RMSNorm and LayerNorm. The plain forward runs on the parameters' tensors;
// the DTensor forward (set up by a parallel style) hands the parameters' DTensors to the DTensor
// ops, whose sharding rules decide the communication.
#include "tessera/nn/layers.h"

#include <cmath>

#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/dtensor/nn_ops.h"
#include "tessera/dtensor/ops.h"

namespace tessera {

// --- Linear ---

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, Generator& gen)
    : Module("Linear"), in_(in_features), out_(out_features) {
  TESSERA_CHECK(in_features > 0 && out_features > 0, "Linear: in_features (", in_features,
                ") and out_features (", out_features, ") must be positive");
  weight = Parameter(empty({out_, in_}));
  register_parameter("weight", &weight);
  if (bias) {
    this->bias = Parameter(empty({out_}));
    register_parameter("bias", &this->bias);
  }
  reset_parameters(gen);
}

Linear::Linear(std::string type_name, const Linear& base)
    : Module(std::move(type_name)),
      weight(base.weight),
      bias(base.bias),
      in_(base.in_),
      out_(base.out_) {
  register_parameter("weight", &weight);
  if (bias.defined()) register_parameter("bias", &bias);
  if (base.dtensor_io()) set_dtensor_io(*base.dtensor_io());
  copy_training_from(base);
  copy_hooks_from(base);
  set_activation_checkpointing(base.activation_checkpointing());
}

std::shared_ptr<Linear> Linear::unwrapped(const Linear& base) {
  return std::shared_ptr<Linear>(new Linear("Linear", base));
}

void Linear::reset_parameters(Generator& gen) {
  weight.kaiming_uniform_(gen, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(double(in_));
    bias.uniform_(-bound, bound, gen);
  }
}

Tensor Linear::forward(const Tensor& x) {
  TESSERA_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == in_, "Linear(", in_, " -> ", out_,
                "): input ", x.defined() ? x.str() : std::string("undefined"),
                " must have last dim ", in_);
  return linear(x, weight.whole_local(type_name(), "weight"),
                bias.whole_local(type_name(), "bias"));
}

DTensor Linear::forward_dtensor(const DTensor& x) {
  TESSERA_CHECK(x.dim() >= 1 && x.size(-1) == in_, "Linear(", in_, " -> ", out_, "): input ",
                x.str(), " must have last dim ", in_);
  return linear(x, weight.on_mesh(x.mesh()), bias.on_mesh(x.mesh()));
}

// --- Embedding ---

Embedding::Embedding(int64_t num_embeddings, int64_t dim, Generator& gen)
    : Module("Embedding"), num_(num_embeddings), dim_(dim) {
  TESSERA_CHECK(num_embeddings > 0 && dim > 0, "Embedding: num_embeddings (", num_embeddings,
                ") and dim (", dim, ") must be positive");
  weight = Parameter(empty({num_, dim_}));
  register_parameter("weight", &weight);
  reset_parameters(gen);
}

Embedding::Embedding(std::string type_name, const Embedding& base)
    : Module(std::move(type_name)), weight(base.weight), num_(base.num_), dim_(base.dim_) {
  register_parameter("weight", &weight);
  if (base.dtensor_io()) set_dtensor_io(*base.dtensor_io());
  copy_training_from(base);
  copy_hooks_from(base);
  set_activation_checkpointing(base.activation_checkpointing());
}

std::shared_ptr<Embedding> Embedding::unwrapped(const Embedding& base) {
  return std::shared_ptr<Embedding>(new Embedding("Embedding", base));
}

void Embedding::reset_parameters(Generator& gen) {
  weight.normal_(0.0, 1.0, gen);
}

Tensor Embedding::forward(const Tensor& ids) {
  return embedding(ids, weight.whole_local(type_name(), "weight"));
}

DTensor Embedding::forward_dtensor(const DTensor& ids) {
  return embedding(ids, weight.on_mesh(ids.mesh()));
}

Tensor Embedding::output_projection(const Tensor& h) {
  return linear(h, weight.local());
}

// --- RMSNorm / LayerNorm ---

RMSNorm::RMSNorm(int64_t dim, std::optional<double> eps) : Module("RMSNorm"), eps_(eps) {
  TESSERA_CHECK(dim > 0, "RMSNorm: dim must be positive, got ", dim);
  TESSERA_CHECK(!eps || *eps >= 0, "RMSNorm: eps must be >= 0, got ", *eps);
  weight = Parameter(empty({dim}));
  weight.fill_(1.0);
  register_parameter("weight", &weight);
}

Tensor RMSNorm::forward(const Tensor& x) {
  return rms_norm(x, weight.whole_local(type_name(), "weight"),
                  eps_.value_or(rms_norm_default_eps(x.dtype())));
}

DTensor RMSNorm::forward_dtensor(const DTensor& x) {
  return rms_norm(x, weight.on_mesh(x.mesh()), eps_.value_or(rms_norm_default_eps(x.dtype())));
}

LayerNorm::LayerNorm(int64_t dim, double eps) : Module("LayerNorm"), eps_(eps) {
  TESSERA_CHECK(dim > 0, "LayerNorm: dim must be positive, got ", dim);
  weight = Parameter(empty({dim}));
  weight.fill_(1.0);
  bias = Parameter(empty({dim}));
  bias.fill_(0.0);
  register_parameter("weight", &weight);
  register_parameter("bias", &bias);
}

Tensor LayerNorm::forward(const Tensor& x) {
  return layer_norm(x, weight.whole_local(type_name(), "weight"),
                    bias.whole_local(type_name(), "bias"), eps_);
}

DTensor LayerNorm::forward_dtensor(const DTensor& x) {
  return layer_norm(x, weight.on_mesh(x.mesh()), bias.on_mesh(x.mesh()), eps_);
}

}  // namespace tessera
