// parallelize_module and the decoder's tensor-parallel plan.
#include "tessera/nn/parallel/parallelize.h"

#include "tessera/nn/module_path.h"

#include <algorithm>
#include <set>

namespace tessera {

namespace {

ParallelStylePtr prepare_module_output(Placements have, Placements want) {
  PrepareModuleOutput s;
  s.output_layouts = std::move(have);
  s.desired_output_layouts = std::move(want);
  return std::make_shared<const PrepareModuleOutput>(std::move(s));
}

template <class Style>
ParallelStylePtr make(Style s) {
  return std::make_shared<const Style>(std::move(s));
}

}  // namespace

ModulePtr parallelize_module(const ModulePtr& module, const DeviceMesh& mesh,
                             const ParallelizePlan& plan) {
  TESSERA_CHECK(module != nullptr, "parallelize_module: null module");
  TESSERA_CHECK(mesh.ndim() == 1, "parallelize_module(", module->type_name(),
                "): tensor parallelism needs a 1-D mesh, got ", mesh.str(),
                " (pass the tensor-parallel sub-mesh, e.g. mesh[\"tp\"])");
  const auto modules = module->named_modules();
  // Every pattern is resolved before any style runs, so a typo leaves the model untouched.
  std::vector<std::vector<ModulePtr>> targets;
  for (const auto& [pattern, style] : plan) {
    TESSERA_CHECK(style != nullptr, "parallelize_module: null style for '", pattern, "'");
    std::vector<ModulePtr> hits;
    for (const auto& [path, m] : modules)
      if (module_path_matches(pattern, path)) hits.push_back(m);
    TESSERA_CHECK(!hits.empty(), "parallelize_module: pattern '", pattern, "' (", style->name(),
                  ") matches no module of ", module->type_name(), "; ",
                  module_path_candidates(pattern, modules));
    targets.push_back(std::move(hits));
  }
  for (size_t i = 0; i < plan.size(); ++i)
    for (const ModulePtr& m : targets[i])
      plan[i].second->apply(*m, mesh);
  return module;
}

ParallelizePlan decoder_tp_plan(const DecoderConfig& cfg, const DeviceMesh& tp_mesh,
                                const DecoderTPOptions& opts) {
  cfg.validate();
  TESSERA_CHECK(tp_mesh.ndim() == 1, "decoder_tp_plan: the tensor-parallel mesh must be 1-D, got ",
                tp_mesh.str());
  const int64_t tp = tp_mesh.size();
  // Attention finds its local head counts from the local q/k/v widths, which only works when
  // every rank holds whole heads, and the same share of query heads per kv head.
  TESSERA_CHECK(cfg.n_heads % tp == 0 && cfg.n_kv_heads % tp == 0,
                "decoder_tp_plan: heads not divisible by the tensor-parallel degree: n_heads = ",
                cfg.n_heads, ", n_kv_heads = ", cfg.n_kv_heads, ", tensor-parallel degree = ", tp);
  const bool sp = opts.sequence_parallel;
  // Between blocks the residual stream is replicated, or sharded on the sequence dim with
  // sequence parallelism; row-parallel layers leave it in that layout (all-reduce or
  // reduce-scatter of their partial sums).
  const Placement residual = sp ? Shard(1) : Replicate();
  // Loss parallel keeps the logits sharded on the vocabulary; the caller hands
  // DTensor::from_local(logits, tp_mesh, {Shard(-1)}, {B, T, vocab}) to
  // vocab_parallel_cross_entropy (the global shape matters when the vocabulary splits unevenly).
  const Placement logits = opts.loss_parallel ? Shard(-1) : Replicate();

  ParallelizePlan plan;
  if (!cfg.tie_embeddings) {
    RowwiseParallel emb;  // vocabulary parallel: partial lookups summed into the residual layout
    emb.input_layouts = {Replicate()};
    emb.output_layouts = {residual};
    plan.emplace_back("tok_embeddings", make(emb));
  } else if (sp) {
    // Tied embeddings: the weight shared by the lookup and the output projection stays a plain
    // replicated tensor (sharding it one way would be wrong for the other use), so each rank
    // computes the full lookup and keeps its sequence chunk.
    plan.emplace_back("tok_embeddings", prepare_module_output({Replicate()}, {Shard(1)}));
  }

  ColwiseParallel col;
  RowwiseParallel row;
  row.output_layouts = {residual};
  if (sp) {
    // The norms run on sequence chunks; attention and the MLP get the whole sequence once
    // (one all-gather per block input) rather than one gather per projection.
    SequenceParallel norm;
    PrepareModuleInput gather;
    gather.input_layouts = {Shard(1)};
    gather.desired_input_layouts = {Replicate()};
    plan.emplace_back("layers.*.attention_norm", make(norm));
    plan.emplace_back("layers.*.attention", make(gather));
    plan.emplace_back("layers.*.ffn_norm", make(norm));
    plan.emplace_back("layers.*.feed_forward", make(gather));
  }
  for (const char* p : {"wq", "wk", "wv"})
    plan.emplace_back(std::string("layers.*.attention.") + p, make(col));
  plan.emplace_back("layers.*.attention.wo", make(row));
  plan.emplace_back("layers.*.feed_forward.w1", make(col));
  plan.emplace_back("layers.*.feed_forward.w3", make(col));
  plan.emplace_back("layers.*.feed_forward.w2", make(row));
  if (sp) plan.emplace_back("norm", make(SequenceParallel{}));

  if (!cfg.tie_embeddings) {
    ColwiseParallel out;
    out.input_layouts = {residual};
    out.output_layouts = {logits};
    plan.emplace_back("output", make(out));
  } else {
    // The tied projection runs inside Decoder::forward on the full hidden states with the
    // replicated weight, so the final norm's output is gathered back to the whole sequence and,
    // with loss parallelism, each rank keeps its vocabulary slice of the (replicated) logits.
    if (sp) plan.emplace_back("norm", prepare_module_output({Shard(1)}, {Replicate()}));
    if (opts.loss_parallel)
      plan.emplace_back("", prepare_module_output({Replicate()}, {Shard(-1)}));
  }
  return plan;
}

}  // namespace tessera
