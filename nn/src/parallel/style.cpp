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

// Who an error is about: "PrepareModuleInput on 'layers.0.attention' (Attention)", or, for a
// style applied to a module directly (no path known), "PrepareModuleInput on Attention".
std::string where(const std::string& style, const Module& m, const std::string& path) {
  return path.empty() ? detail::concat(style, " on ", m.type_name())
                      : detail::concat(style, " on '", path, "' (", m.type_name(), ")");
}

// A hook's local tensor as a DTensor (uneven pieces allowed where torch.chunk makes them).
DTensor local_to_dtensor(const Tensor& x, const DeviceMesh& mesh, const Placements& placements,
                         const std::string& what) {
  return DTensor::from_local(x, mesh, placements,
                             detail::global_shape_of_pieces(x, mesh, placements, what));
}

// The layouts a hook converts between. The given one describes local pieces, which a
// StridedShard (FSDP's parameter layout) cannot; the desired one is handed to the module (or the
// next one) as a local tensor, which a StridedShard cannot describe either, and a Partial the
// activation is not already in would hand it one term of a sum as if it were the activation
// (PyTorch's redistribute refuses to make a Partial as well).
void check_hook_layouts(const Placements& have, const Placements& want, const char* have_name,
                        const char* want_name, const std::string& at, const DeviceMesh& mesh) {
  TESSERA_CHECK(int64_t(have.size()) == mesh.ndim() && have.size() == want.size(), at, ": ",
                have_name, " ", placements_str(have), " and ", want_name, " ", placements_str(want),
                " must each hold one placement per dim of ", mesh.str());
  for (const Placement& p : have)
    TESSERA_CHECK(!p.is_strided_shard(), at, ": ", have_name, " ", placements_str(have),
                  " cannot describe a local activation");
  for (size_t i = 0; i < want.size(); ++i) {
    TESSERA_CHECK(!want[i].is_strided_shard(), at, ": ", want_name, " ", placements_str(want),
                  " cannot describe a local activation");
    TESSERA_CHECK(!want[i].is_partial() || want[i] == have[i], at, ": ", want_name, " ",
                  placements_str(want), " ask for ", want[i].str(), " on mesh dim ", i, " where ",
                  have_name, " ", placements_str(have), " have ", have[i].str(),
                  "; redistributing to Partial would hand on one term of a sum as the "
                  "activation (only an activation already Partial may stay so)");
  }
}

// The desired layouts' Shard dims against the activation's global shape, which every rank of
// the mesh agreed on before, so all of them fail here together (redistribute would fail as
// well, without naming the module).
void check_desired_dims(const DTensor& x, const Placements& want, const char* want_name,
                        const std::string& at) {
  for (const Placement& p : want)
    TESSERA_CHECK(!p.is_shard() || (p.dim() >= -x.dim() && p.dim() < x.dim()), at, ": ", want_name,
                  " ", placements_str(want), " shard dim ", p.dim(),
                  ", which an activation of shape ", shape_str(x.shape()),
                  " does not have (this rank's piece ", shape_str(x.to_local().shape()), ")");
}

void check_mesh(const DeviceMesh& mesh, const std::string& at) {
  TESSERA_CHECK(mesh.ndim() == 1, at, ": tensor-parallel styles need a 1-D mesh, got ", mesh.str(),
                " (pass the tensor-parallel sub-mesh, e.g. mesh[\"tp\"])");
}

void check_layouts(const Placements& p, const char* what, const std::string& at) {
  TESSERA_CHECK(p.size() == 1, at, ": ", what, " must hold one placement for the 1-D mesh, got ",
                placements_str(p));
}

// A module is parallelized once; a second style would silently re-cut already sharded weights
// or stack a second DTensor conversion on its input.
void check_not_parallel(const Module& m, const std::string& at) {
  TESSERA_CHECK(!m.dtensor_io().has_value(), at, ": the module is already tensor-parallel (input ",
                placements_str(m.dtensor_io()->input_layouts), ", output ",
                placements_str(m.dtensor_io()->output_layouts), ")");
}

// The mesh's first rank's value, sent to the others (PyTorch's src_data_rank = 0): ranks that
// initialised the model differently (another seed, a forgotten seed) still get one model, where
// cutting each rank's own copy would silently mix their windows and leave replicas unequal.
void distribute_parameter(Parameter& p, const char* name, const DeviceMesh& mesh,
                          const Placements& placements, const std::string& at) {
  if (!p.defined()) return;
  TESSERA_CHECK(!p.is_dtensor(), at, ": ", name, " is already a DTensor ", p.str(),
                "; apply tensor parallelism before fully_shard and only once");
  p = Parameter(distribute_tensor(p.full(), mesh, placements), p.requires_grad());
}

void check_plain_parameter(const Parameter& p, const char* name, const std::string& at) {
  TESSERA_CHECK(!p.defined() || !p.is_dtensor(), at, ": ", name, " is already a DTensor ", p.str(),
                "; apply tensor parallelism before fully_shard and only once");
}

// The layouts a linear style converts from and to, as PyTorch's redistribute of the module's
// input and output allows them: a StridedShard (FSDP's parameter layout) describes no local
// activation; a Partial input is reduced into the layout the layer needs, but the ids an
// Embedding looks up are not terms of a sum; and only a row-parallel output, whose ranks hold
// terms of a sum, may be handed on as Partial (sum) — making a Partial of a column-parallel
// slice would hand on one rank's piece as if it were a term.
void check_linear_layouts(const Placements& input_layouts, const Placements& output_layouts,
                          bool output_is_partial_sum, const Module& m, const std::string& at) {
  const std::string both = detail::concat(" (input_layouts ", placements_str(input_layouts),
                                          ", output_layouts ", placements_str(output_layouts), ")");
  TESSERA_CHECK(!input_layouts[0].is_strided_shard() && !output_layouts[0].is_strided_shard(), at,
                ": a StridedShard cannot describe a local activation", both);
  TESSERA_CHECK(!input_layouts[0].is_partial() || dynamic_cast<const Embedding*>(&m) == nullptr, at,
                ": input_layouts ", placements_str(input_layouts),
                " make the ids an Embedding looks up terms of a sum", both);
  const Placement& out = output_layouts[0];
  TESSERA_CHECK(!out.is_partial() || output_is_partial_sum, at, ": output_layouts ",
                placements_str(output_layouts),
                " would hand on this rank's slice of the output features as a term of a sum; "
                "the column-parallel output is a slice, not a sum (Shard(-1) keeps it, Replicate() "
                "gathers it)",
                both);
  TESSERA_CHECK(!out.is_partial() || out.reduce_op() == ReduceOp::Sum, at, ": output_layouts ",
                placements_str(output_layouts),
                " cannot describe the row-parallel output, a sum of the ranks' terms (Partial() "
                "keeps it so)",
                both);
}

// What Colwise and Rowwise both check before touching the module.
void check_linear_style(const DeviceMesh& mesh, const Placements& input_layouts,
                        const Placements& output_layouts, bool output_is_partial_sum,
                        const Module& m, const std::string& at) {
  check_mesh(mesh, at);
  check_layouts(input_layouts, "input_layouts", at);
  check_layouts(output_layouts, "output_layouts", at);
  check_linear_layouts(input_layouts, output_layouts, output_is_partial_sum, m, at);
  check_not_parallel(m, at);
}

[[noreturn]] void wrong_module(const std::string& style, const char* accepted, const Module& m,
                               const std::string& at) {
  TESSERA_FAIL(at, ": ", style, " applies to ", accepted, " modules; got a ", m.type_name());
}

// Linear and Embedding: the module's type, and its parameters still plain.
void check_linear_or_embedding(const Module& module, const std::string& style,
                               const std::string& at) {
  if (auto* linear = dynamic_cast<const Linear*>(&module)) {
    check_plain_parameter(linear->weight, "weight", at);
    check_plain_parameter(linear->bias, "bias", at);
  } else if (auto* emb = dynamic_cast<const Embedding*>(&module)) {
    check_plain_parameter(emb->weight, "weight", at);
  } else {
    wrong_module(style, "Linear or Embedding", module, at);
  }
}

// The norms SequenceParallel takes (RMSNorm, LayerNorm) normalise over the input's last dim.
bool is_norm(const Module& m) {
  return dynamic_cast<const RMSNorm*>(&m) != nullptr ||
         dynamic_cast<const LayerNorm*>(&m) != nullptr;
}

// A norm with its normalised dim sharded would compute on the gathered activation, once per
// forward, while seeming sequence-parallel: refused where the input's shape shows it.
void check_sequence_dim_of_input(const DTensor& x, int64_t sequence_dim, const std::string& at) {
  const int64_t d = sequence_dim < 0 ? sequence_dim + x.dim() : sequence_dim;
  TESSERA_CHECK(d != x.dim() - 1, at, ": sequence_dim ", sequence_dim,
                " is the last dim of the input of shape ", shape_str(x.shape()),
                ", the one the norm normalises over; pass the sequence dim (1 for [batch, "
                "sequence, features])");
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

void ColwiseParallel::check(const Module& module, const DeviceMesh& mesh,
                            const std::string& path) const {
  const std::string at = where(name(), module, path);
  check_linear_style(mesh, input_layouts, output_layouts, false, module, at);
  check_linear_or_embedding(module, name(), at);
}

void ColwiseParallel::apply(Module& module, const DeviceMesh& mesh, const std::string& path) const {
  const std::string at = where(name(), module, path);
  check(module, mesh, path);
  if (auto* linear = dynamic_cast<Linear*>(&module)) {
    // Output features split: each rank's slice of y needs its rows of W and of b.
    distribute_parameter(linear->weight, "weight", mesh, {Shard(0)}, at);
    distribute_parameter(linear->bias, "bias", mesh, {Shard(0)}, at);
    linear->after_tensor_parallel(mesh);
  } else if (auto* emb = dynamic_cast<Embedding*>(&module)) {
    distribute_parameter(emb->weight, "weight", mesh, {Shard(1)}, at);
    emb->after_tensor_parallel(mesh);
  } else {
    wrong_module(name(), "Linear or Embedding", module, at);
  }
  // Every rank needs the whole input; a sharded input is gathered here, and a replicated one
  // has its gradient summed over the ranks by the linear's backward.
  module.set_dtensor_io(DTensorIO{mesh, input_layouts, {Replicate()}, output_layouts, at});
}

void RowwiseParallel::check(const Module& module, const DeviceMesh& mesh,
                            const std::string& path) const {
  const std::string at = where(name(), module, path);
  check_linear_style(mesh, input_layouts, output_layouts, true, module, at);
  check_linear_or_embedding(module, name(), at);
}

void RowwiseParallel::apply(Module& module, const DeviceMesh& mesh, const std::string& path) const {
  const std::string at = where(name(), module, path);
  check(module, mesh, path);
  if (auto* linear = dynamic_cast<Linear*>(&module)) {
    // Input features split: each rank's product is a partial sum; the bias must be added once,
    // which the DTensor linear does for a Replicate bias against a Partial product.
    distribute_parameter(linear->weight, "weight", mesh, {Shard(1)}, at);
    distribute_parameter(linear->bias, "bias", mesh, {Replicate()}, at);
    linear->after_tensor_parallel(mesh);
    module.set_dtensor_io(DTensorIO{mesh, input_layouts, {Shard(-1)}, output_layouts, at});
  } else if (auto* emb = dynamic_cast<Embedding*>(&module)) {
    // Vocabulary parallel: each rank looks up the ids it owns (zeros elsewhere), so every rank
    // needs all ids.
    distribute_parameter(emb->weight, "weight", mesh, {Shard(0)}, at);
    emb->after_tensor_parallel(mesh);
    module.set_dtensor_io(DTensorIO{mesh, input_layouts, {Replicate()}, output_layouts, at});
  } else {
    wrong_module(name(), "Linear or Embedding", module, at);
  }
}

void SequenceParallel::check(const Module& module, const DeviceMesh& mesh,
                             const std::string& path) const {
  const std::string at = where(name(), module, path);
  check_mesh(mesh, at);
  check_not_parallel(module, at);
  if (auto* rms = dynamic_cast<const RMSNorm*>(&module)) {
    check_plain_parameter(rms->weight, "weight", at);
  } else if (auto* ln = dynamic_cast<const LayerNorm*>(&module)) {
    check_plain_parameter(ln->weight, "weight", at);
    check_plain_parameter(ln->bias, "bias", at);
  } else if (dynamic_cast<const Dropout*>(&module) == nullptr) {
    wrong_module(name(), "RMSNorm, LayerNorm or Dropout", module, at);
  }
  // Without the input's rank only -1 is known to be the last dim; other dims are checked
  // against the input at the forward.
  TESSERA_CHECK(!is_norm(module) || sequence_dim != -1, at, ": sequence_dim -1 is the dim ",
                module.type_name(),
                " normalises over (its weight holds one value per feature); "
                "pass the sequence dim (1 for [batch, sequence, features])");
}

void SequenceParallel::apply(Module& module, const DeviceMesh& mesh,
                             const std::string& path) const {
  const std::string at = where(name(), module, path);
  check(module, mesh, path);
  if (auto* rms = dynamic_cast<RMSNorm*>(&module)) {
    distribute_parameter(rms->weight, "weight", mesh, {Replicate()}, at);
  } else if (auto* ln = dynamic_cast<LayerNorm*>(&module)) {
    distribute_parameter(ln->weight, "weight", mesh, {Replicate()}, at);
    distribute_parameter(ln->bias, "bias", mesh, {Replicate()}, at);
  } else if (dynamic_cast<Dropout*>(&module) == nullptr) {
    wrong_module(name(), "RMSNorm, LayerNorm or Dropout", module, at);
  }
  // Replicate weights (rather than plain tensors) against a sequence-sharded input are what make
  // the norm's backward sum their gradients over the ranks, each of which saw only its tokens.
  const Placements seq = {Shard(sequence_dim)};
  DTensorIO io{mesh, seq, seq, seq, at};
  if (is_norm(module))
    io.check_input = [at, dim = sequence_dim](const DTensor& x) {
      check_sequence_dim_of_input(x, dim, at);
    };
  module.set_dtensor_io(std::move(io));
}

void PrepareModuleInput::check(const Module& module, const DeviceMesh& mesh,
                               const std::string& path) const {
  check_hook_layouts(input_layouts, desired_input_layouts, "input_layouts", "desired_input_layouts",
                     where(name(), module, path), mesh);
}

void PrepareModuleInput::apply(Module& module, const DeviceMesh& mesh,
                               const std::string& path) const {
  check(module, mesh, path);
  // A pre-hook, not DTensorIO: the module itself keeps running on local tensors (a block whose
  // children are the tensor-parallel ones), it only receives its input in another layout. The
  // module's type is read at each call: a wrapper that took the hook over (LoRA) is named.
  module.register_forward_pre_hook([mesh, have = input_layouts, want = desired_input_layouts,
                                    style = name(), path](Module& m, const Tensor& x) {
    const std::string at = where(style, m, path);
    const DTensor xd = local_to_dtensor(x, mesh, have, at);
    check_desired_dims(xd, want, "desired_input_layouts", at);
    return xd.redistribute(want).to_local();
  });
}

void PrepareModuleOutput::check(const Module& module, const DeviceMesh& mesh,
                                const std::string& path) const {
  check_hook_layouts(output_layouts, desired_output_layouts, "output_layouts",
                     "desired_output_layouts", where(name(), module, path), mesh);
}

void PrepareModuleOutput::apply(Module& module, const DeviceMesh& mesh,
                                const std::string& path) const {
  check(module, mesh, path);
  module.register_forward_hook([mesh, have = output_layouts, want = desired_output_layouts,
                                style = name(), path](Module& m, const Tensor&, const Tensor& y) {
    const std::string at = where(style, m, path);
    const DTensor yd = local_to_dtensor(y, mesh, have, at);
    check_desired_dims(yd, want, "desired_output_layouts", at);
    return yd.redistribute(want).to_local();
  });
}

}  // namespace tessera
