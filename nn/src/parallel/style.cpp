// Tensor-parallel styles. A style never computes anything itself: it turns the module's
// parameters into DTensors and tells Module::operator() (through DTensorIO or a pre-hook) how the
// module's local input and output cross into and out of DTensors; the DTensor ops of the layer's
// forward_dtensor then insert the collectives (and their backwards) from the placements alone.
#include "tessera/nn/parallel/style.h"

#include "local_pieces.h"
#include "tessera/core/factory.h"
#include "tessera/nn/dropout.h"
#include "tessera/nn/layers.h"

namespace tessera {

namespace {

// A hook's local tensor as a DTensor (uneven pieces allowed where torch.chunk makes them).
DTensor local_to_dtensor(const Tensor& x, const DeviceMesh& mesh, const Placements& placements,
                         const std::string& what) {
  return DTensor::from_local(x, mesh, placements,
                             detail::global_shape_of_pieces(x, mesh, placements, what));
}

void check_hook_layouts(const Placements& have, const Placements& want, const char* have_name,
                        const char* want_name, const std::string& style, const Module& m,
                        const DeviceMesh& mesh) {
  TESSERA_CHECK(int64_t(have.size()) == mesh.ndim() && have.size() == want.size(), style, " on ",
                m.type_name(), ": ", have_name, " ", placements_str(have), " and ", want_name, " ",
                placements_str(want), " must each hold one placement per dim of ", mesh.str());
  for (const Placement& p : have)
    TESSERA_CHECK(!p.is_strided_shard(), style, " on ", m.type_name(), ": ", have_name, " ",
                  placements_str(have), " cannot describe a local activation");
}

void check_mesh(const DeviceMesh& mesh, const std::string& style, const Module& m) {
  TESSERA_CHECK(mesh.ndim() == 1, style, " on ", m.type_name(), ": tensor-parallel styles need a ",
                "1-D mesh, got ", mesh.str(),
                " (pass the tensor-parallel sub-mesh, e.g. mesh[\"tp\"])");
}

void check_layouts(const Placements& p, const char* what, const std::string& style,
                   const Module& m) {
  TESSERA_CHECK(p.size() == 1, style, " on ", m.type_name(), ": ", what,
                " must hold one placement for the 1-D mesh, got ", placements_str(p));
}

// A module is parallelized once; a second style would silently re-cut already sharded weights
// or stack a second DTensor conversion on its input.
void check_not_parallel(const Module& m, const std::string& style) {
  TESSERA_CHECK(!m.dtensor_io().has_value(), style, " on ", m.type_name(),
                ": the module is already tensor-parallel (input ",
                placements_str(m.dtensor_io()->input_layouts), ", output ",
                placements_str(m.dtensor_io()->output_layouts), ")");
}

// The mesh's first rank's value, sent to the others (PyTorch's src_data_rank = 0): ranks that
// initialised the model differently (another seed, a forgotten seed) still get one model, where
// cutting each rank's own copy would silently mix their windows and leave replicas unequal.
void distribute_parameter(Parameter& p, const char* name, const DeviceMesh& mesh,
                          const Placements& placements, const std::string& style, const Module& m) {
  if (!p.defined()) return;
  TESSERA_CHECK(!p.is_dtensor(), style, " on ", m.type_name(), ": ", name, " is already a DTensor ",
                p.str(), "; apply tensor parallelism before fully_shard and only once");
  p = Parameter(distribute_tensor(p.full(), mesh, placements), p.requires_grad());
}

void check_plain_parameter(const Parameter& p, const char* name, const std::string& style,
                           const Module& m) {
  TESSERA_CHECK(!p.defined() || !p.is_dtensor(), style, " on ", m.type_name(), ": ", name,
                " is already a DTensor ", p.str(),
                "; apply tensor parallelism before fully_shard and only once");
}

// What Colwise and Rowwise both check before touching the module.
void check_linear_style(const DeviceMesh& mesh, const Placements& input_layouts,
                        const Placements& output_layouts, const std::string& style,
                        const Module& m) {
  check_mesh(mesh, style, m);
  check_layouts(input_layouts, "input_layouts", style, m);
  check_layouts(output_layouts, "output_layouts", style, m);
  check_not_parallel(m, style);
}

[[noreturn]] void wrong_module(const std::string& style, const char* accepted, const Module& m) {
  TESSERA_FAIL(style, " applies to ", accepted, " modules; got a ", m.type_name());
}

// Linear and Embedding: the module's type, and its parameters still plain.
void check_linear_or_embedding(const Module& module, const std::string& style) {
  if (auto* linear = dynamic_cast<const Linear*>(&module)) {
    check_plain_parameter(linear->weight, "weight", style, module);
    check_plain_parameter(linear->bias, "bias", style, module);
  } else if (auto* emb = dynamic_cast<const Embedding*>(&module)) {
    check_plain_parameter(emb->weight, "weight", style, module);
  } else {
    wrong_module(style, "Linear or Embedding", module);
  }
}

}  // namespace

std::string ColwiseParallel::str() const {
  return detail::concat(name(), "(input ", placements_str(input_layouts), ", output ",
                        placements_str(output_layouts), ")");
}

std::string RowwiseParallel::str() const {
  return detail::concat(name(), "(input ", placements_str(input_layouts), ", output ",
                        placements_str(output_layouts), ")");
}

std::string SequenceParallel::str() const {
  return detail::concat(name(), "(sequence_dim ", sequence_dim, ")");
}

std::string PrepareModuleInput::str() const {
  return detail::concat(name(), "(input ", placements_str(input_layouts), ", desired ",
                        placements_str(desired_input_layouts), ")");
}

std::string PrepareModuleOutput::str() const {
  return detail::concat(name(), "(output ", placements_str(output_layouts), ", desired ",
                        placements_str(desired_output_layouts), ")");
}

void ColwiseParallel::check(const Module& module, const DeviceMesh& mesh) const {
  check_linear_style(mesh, input_layouts, output_layouts, name(), module);
  check_linear_or_embedding(module, name());
}

void ColwiseParallel::apply(Module& module, const DeviceMesh& mesh) const {
  const std::string style = name();
  check(module, mesh);
  if (auto* linear = dynamic_cast<Linear*>(&module)) {
    // Output features split: each rank's slice of y needs its rows of W and of b.
    distribute_parameter(linear->weight, "weight", mesh, {Shard(0)}, style, module);
    distribute_parameter(linear->bias, "bias", mesh, {Shard(0)}, style, module);
    linear->after_tensor_parallel(mesh);
  } else if (auto* emb = dynamic_cast<Embedding*>(&module)) {
    distribute_parameter(emb->weight, "weight", mesh, {Shard(1)}, style, module);
  } else {
    wrong_module(style, "Linear or Embedding", module);
  }
  // Every rank needs the whole input; a sharded input is gathered here, and a replicated one
  // has its gradient summed over the ranks by the linear's backward.
  module.set_dtensor_io(DTensorIO{mesh, input_layouts, {Replicate()}, output_layouts});
}

void RowwiseParallel::check(const Module& module, const DeviceMesh& mesh) const {
  check_linear_style(mesh, input_layouts, output_layouts, name(), module);
  check_linear_or_embedding(module, name());
}

void RowwiseParallel::apply(Module& module, const DeviceMesh& mesh) const {
  const std::string style = name();
  check(module, mesh);
  if (auto* linear = dynamic_cast<Linear*>(&module)) {
    // Input features split: each rank's product is a partial sum; the bias must be added once,
    // which the DTensor linear does for a Replicate bias against a Partial product.
    distribute_parameter(linear->weight, "weight", mesh, {Shard(1)}, style, module);
    distribute_parameter(linear->bias, "bias", mesh, {Replicate()}, style, module);
    linear->after_tensor_parallel(mesh);
    module.set_dtensor_io(DTensorIO{mesh, input_layouts, {Shard(-1)}, output_layouts});
  } else if (auto* emb = dynamic_cast<Embedding*>(&module)) {
    // Vocabulary parallel: each rank looks up the ids it owns (zeros elsewhere), so every rank
    // needs all ids.
    distribute_parameter(emb->weight, "weight", mesh, {Shard(0)}, style, module);
    module.set_dtensor_io(DTensorIO{mesh, input_layouts, {Replicate()}, output_layouts});
  } else {
    wrong_module(style, "Linear or Embedding", module);
  }
}

void SequenceParallel::check(const Module& module, const DeviceMesh& mesh) const {
  const std::string style = name();
  check_mesh(mesh, style, module);
  check_not_parallel(module, style);
  if (auto* rms = dynamic_cast<const RMSNorm*>(&module)) {
    check_plain_parameter(rms->weight, "weight", style, module);
  } else if (auto* ln = dynamic_cast<const LayerNorm*>(&module)) {
    check_plain_parameter(ln->weight, "weight", style, module);
    check_plain_parameter(ln->bias, "bias", style, module);
  } else if (dynamic_cast<const Dropout*>(&module) == nullptr) {
    wrong_module(style, "RMSNorm, LayerNorm or Dropout", module);
  }
}

void SequenceParallel::apply(Module& module, const DeviceMesh& mesh) const {
  const std::string style = name();
  check(module, mesh);
  if (auto* rms = dynamic_cast<RMSNorm*>(&module)) {
    distribute_parameter(rms->weight, "weight", mesh, {Replicate()}, style, module);
  } else if (auto* ln = dynamic_cast<LayerNorm*>(&module)) {
    distribute_parameter(ln->weight, "weight", mesh, {Replicate()}, style, module);
    distribute_parameter(ln->bias, "bias", mesh, {Replicate()}, style, module);
  } else if (dynamic_cast<Dropout*>(&module) == nullptr) {
    wrong_module(style, "RMSNorm, LayerNorm or Dropout", module);
  }
  // Replicate weights (rather than plain tensors) against a sequence-sharded input are what make
  // the norm's backward sum their gradients over the ranks, each of which saw only its tokens.
  const Placements seq = {Shard(sequence_dim)};
  module.set_dtensor_io(DTensorIO{mesh, seq, seq, seq});
}

void PrepareModuleInput::check(const Module& module, const DeviceMesh& mesh) const {
  check_hook_layouts(input_layouts, desired_input_layouts, "input_layouts", "desired_input_layouts",
                     name(), module, mesh);
}

void PrepareModuleInput::apply(Module& module, const DeviceMesh& mesh) const {
  check(module, mesh);
  // A pre-hook, not DTensorIO: the module itself keeps running on local tensors (a block whose
  // children are the tensor-parallel ones), it only receives its input in another layout.
  module.register_forward_pre_hook(
      [mesh, have = input_layouts, want = desired_input_layouts](Module& m, const Tensor& x) {
        return local_to_dtensor(x, mesh, have, "PrepareModuleInput on " + m.type_name())
            .redistribute(want)
            .to_local();
      });
}

void PrepareModuleOutput::check(const Module& module, const DeviceMesh& mesh) const {
  check_hook_layouts(output_layouts, desired_output_layouts, "output_layouts",
                     "desired_output_layouts", name(), module, mesh);
}

void PrepareModuleOutput::apply(Module& module, const DeviceMesh& mesh) const {
  check(module, mesh);
  module.register_forward_hook([mesh, have = output_layouts, want = desired_output_layouts](
                                   Module& m, const Tensor&, const Tensor& y) {
    return local_to_dtensor(y, mesh, have, "PrepareModuleOutput on " + m.type_name())
        .redistribute(want)
        .to_local();
  });
}

}  // namespace tessera
