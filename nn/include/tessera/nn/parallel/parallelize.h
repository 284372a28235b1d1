#pragma once
#include <string>
#include <utility>
#include <vector>

#include "tessera/nn/parallel/style.h"
#include "tessera/nn/transformer.h"

namespace tessera {

// Ordered (path pattern, style) pairs; '*' matches one path component ("layers.*.attention.wq").
using ParallelizePlan = std::vector<std::pair<std::string, ParallelStylePtr>>;

// Applies each style to every module its pattern matches, on a 1-D mesh. A pattern that matches
// nothing is an error naming it. Collective over the mesh: every target is checked, and the ranks
// agree on the outcome and on the parameters to distribute, before any rank changes anything, so
// a refusal on any rank is an error on every rank and leaves every model as it was. Returns
// `module`.
ModulePtr parallelize_module(const ModulePtr& module, const DeviceMesh& mesh,
                             const ParallelizePlan& plan);

struct DecoderTPOptions {
  bool sequence_parallel = false;  // norms and residuals sharded on the sequence dim
  bool loss_parallel = false;      // logits stay sharded on the vocabulary dim
};

// The plan for Decoder: attention wq/wk/wv column-parallel and wo row-parallel, MLP w1/w3
// column-parallel and w2 row-parallel, vocabulary-parallel embedding, column-parallel output.
// Heads (and kv heads) not divisible by the mesh size are an error that says so.
ParallelizePlan decoder_tp_plan(const DecoderConfig& cfg, const DeviceMesh& tp_mesh,
                                const DecoderTPOptions& opts = {});

}  // namespace tessera
