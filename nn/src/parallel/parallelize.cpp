// parallelize_module and the decoder's tensor-parallel plan.
#include "tessera/nn/parallel/parallelize.h"

#include "tessera/comm/agree.h"
#include "tessera/nn/layers.h"
#include "tessera/nn/module_path.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

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

// Every style's checks on every target, before any style changes anything: a refused plan
// leaves the model as it was. Also refused here: two styles of one kind on one module (the
// second would re-cut sharded weights or stack a second conversion on its input), and a
// parameter a style would distribute whose tensor another name shares (weights tied by
// assignment: the names would end up with separate tensors).
void check_plan(Module& root, const std::vector<std::pair<std::string, ModulePtr>>& modules,
                const DeviceMesh& mesh, const ParallelizePlan& plan,
                const std::vector<std::vector<ModulePtr>>& targets) {
  std::map<std::pair<const Module*, std::string>, std::string> kinds;  // (module, kind) -> pattern
  // Each tensor's Parameter slots (a module registered twice shows one slot under two names,
  // which a style changes for both; two slots are weights tied by assignment) and their names.
  std::map<const TensorImpl*, std::vector<std::pair<const Parameter*, std::string>>> slots;
  for (auto& [name, p] : root.named_parameters(true, /*remove_duplicate=*/false)) {
    if (!p->defined()) continue;
    auto& list = slots[p->stored().impl()];
    if (std::none_of(list.begin(), list.end(), [&](const auto& s) { return s.first == p; }))
      list.emplace_back(p, name);
  }
  std::map<const Module*, std::string> paths;
  for (const auto& [path, m] : modules)
    paths[m.get()] = path;
  for (size_t i = 0; i < plan.size(); ++i) {
    const auto& [pattern, style] = plan[i];
    const std::string kind = style->distributes_parameters() ? "parallel" : style->name();
    for (const ModulePtr& m : targets[i]) {
      style->check(*m, mesh, paths[m.get()]);
      auto [at, fresh] = kinds.emplace(std::pair(m.get(), kind), pattern);
      TESSERA_CHECK(fresh, "parallelize_module: '", paths[m.get()], "' is targeted by '",
                    at->second, "' and by '", pattern, "' (", style->name(),
                    "); one module takes one style of each kind");
      if (!style->distributes_parameters()) continue;
      for (const auto& set : m->parameter_stand_ins())
        for (const auto& [name, p] : set)
          TESSERA_CHECK(!p->is_dtensor(), "parallelize_module: ", style->name(), " on '",
                        paths[m.get()], "': the stand-in for its '", name,
                        "' is already a DTensor ", p->str(),
                        "; apply tensor parallelism before fully_shard and only once");
      for (auto& [name, p] : m->named_parameters(/*recurse=*/false, false)) {
        if (!p->defined()) continue;
        const auto& all = slots[p->stored().impl()];
        TESSERA_CHECK(all.size() <= 1, "parallelize_module: ", style->name(), " on '",
                      paths[m.get()], "' would distribute '", all.front().second,
                      "', whose tensor is shared with '", all.back().second,
                      "' (weights tied by assignment), leaving the two names separate tensors; "
                      "tie them after parallelizing, or leave that parameter unsharded");
      }
    }
  }
}

// What this rank's plan does to its model, one line per target (its style with the layouts it
// was given) and per parameter a style distributes: the ranks must agree on it, since
// distributing a parameter sends the mesh's first rank's values to tensors the other ranks hold,
// of their own shapes and dtypes, and ranks given different layouts would run different
// collectives in every forward.
std::vector<std::string> plan_description(
    const std::vector<std::pair<std::string, ModulePtr>>& modules, const ParallelizePlan& plan,
    const std::vector<std::vector<ModulePtr>>& targets) {
  std::map<const Module*, std::string> paths;
  for (const auto& [path, m] : modules)
    paths[m.get()] = path;
  std::vector<std::string> lines;
  for (size_t i = 0; i < plan.size(); ++i) {
    const auto& [pattern, style] = plan[i];
    for (const ModulePtr& m : targets[i]) {
      const std::string path = paths[m.get()];
      lines.push_back(detail::concat("'", pattern, "' ", style->str(), " on '", path, "' (",
                                     m->type_name(), ")"));
      if (!style->distributes_parameters()) continue;
      const std::string prefix = path.empty() ? path : path + ".";
      for (auto& [name, p] : m->named_parameters(/*recurse=*/false, false))
        if (p->defined())
          lines.push_back(detail::concat("'", prefix, name, "' ", dtype_name(p->dtype()), " ",
                                         shape_str(p->global_shape())));
      const auto& sets = m->parameter_stand_ins();
      for (size_t k = 0; k < sets.size(); ++k)
        for (const auto& [name, p] : sets[k])
          lines.push_back(detail::concat("'", prefix, name, "' stand-in ", k, " ",
                                         dtype_name(p->dtype()), " ",
                                         shape_str(p->global_shape())));
      for (const auto& [name, what] : m->tensor_parallel_inputs())
        lines.push_back(detail::concat("'", prefix, name, "' ", what));
    }
  }
  return lines;
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) {
    s += l;
    s += '\n';
  }
  return s;
}

// Collective over the mesh: every rank throws, naming the ranks and what they found, when any
// rank's checks failed or its plan does not do to its model what the mesh's first rank's does to
// its own (a model or plan built differently on one rank); otherwise the styles are applied on
// every rank. Without this, a rank refusing the plan would leave the others waiting in the first
// distribution, and parameters differing in shape would fail there after earlier targets had
// changed.
void agree_on_plan(const Module& root, const DeviceMesh& mesh, const std::string& error,
                   const std::vector<std::string>& lines) {
  const ProcessGroupPtr& group = mesh.host_group(0);
  // A rank whose checks failed has no description to compare; its error says enough.
  const std::string text =
      error.empty() ? detail::concat("checked\n", join_lines(lines)) : std::string("failed\n");
  const std::vector<std::string> all = all_gather_strings(group, text);
  std::string mine = error;
  const std::string& first = all.front();
  if (mine.empty() && first.rfind("checked\n", 0) == 0 && text != first) {
    std::vector<std::string> theirs;
    for (size_t pos = first.find('\n') + 1, end; (end = first.find('\n', pos)) != std::string::npos;
         pos = end + 1)
      theirs.push_back(first.substr(pos, end - pos));
    size_t k = 0;
    while (k < lines.size() && k < theirs.size() && lines[k] == theirs[k])
      ++k;
    const int me = group->world_ranks()[size_t(group->rank())];
    const int them = group->world_ranks().front();
    mine = detail::concat("[rank ", me, "] its plan differs from rank ", them, "'s: rank ", them,
                          " has ", k < theirs.size() ? theirs[k] : "nothing more", ", rank ", me,
                          " has ", k < lines.size() ? lines[k] : "nothing more");
  }
  agree(group, detail::concat("parallelize_module(", root.type_name(), ") on ", mesh.str()), mine);
}

// A module's stand-in parameters take its own parameters' place in its forward, so they are laid
// out as the style laid those out, from their own values (every rank holds them whole: they were
// plain, as check_plan made sure).
void lay_out_stand_ins(Module& m) {
  const auto own = m.named_parameters(/*recurse=*/false, false);
  for (const auto& set : m.parameter_stand_ins())
    for (const auto& [name, p] : set)
      for (const auto& [own_name, o] : own)
        if (own_name == name && o->is_dtensor())
          *p = Parameter(
              distribute_tensor(p->full(), o->dtensor().mesh(), o->dtensor().placements()),
              p->requires_grad());
}

}  // namespace

ModulePtr parallelize_module(const ModulePtr& module, const DeviceMesh& mesh,
                             const ParallelizePlan& plan) {
  TESSERA_CHECK(module != nullptr, "parallelize_module: null module");
  TESSERA_CHECK(mesh.ndim() == 1, "parallelize_module(", module->type_name(),
                "): tensor parallelism needs a 1-D mesh, got ", mesh.str(),
                " (pass the tensor-parallel sub-mesh, e.g. mesh[\"tp\"])");
  const auto modules = module->named_modules();
  // Every pattern is resolved and every target checked before any style runs, on every rank,
  // so a typo or a refused target leaves the model untouched on all of them.
  std::vector<std::vector<ModulePtr>> targets;
  std::string error;
  try {
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
    check_plan(*module, modules, mesh, plan, targets);
  } catch (...) {
    error = current_error_text();
  }
  agree_on_plan(
      *module, mesh, error,
      error.empty() ? plan_description(modules, plan, targets) : std::vector<std::string>{});
  std::map<const Module*, std::string> paths;
  for (const auto& [path, m] : modules)
    paths.emplace(m.get(), path);
  for (size_t i = 0; i < plan.size(); ++i)
    for (const ModulePtr& m : targets[i]) {
      plan[i].second->apply(*m, mesh, paths[m.get()]);
      if (plan[i].second->distributes_parameters()) lay_out_stand_ins(*m);
    }
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
