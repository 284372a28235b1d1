#pragma once
// What a rank asked a group to do, in the one format every comm message uses
// ("all_reduce(sum) float32 [4, 4]"), so that timeouts and debug checks read alike.
#include <cstdint>
#include <optional>
#include <string>

#include "tessera/comm/process_group.h"

namespace tessera::detail {

// Stable numbers: the debug check sends them between ranks.
enum class OpKind : uint8_t {
  AllReduce = 1,
  AllGatherIntoTensor,
  AllGather,
  ReduceScatterTensor,
  ReduceScatter,
  AllToAll,
  Broadcast,
  Scatter,
  Send,
  Recv,
  Barrier,
  Split,
  AllGatherRuns,
};
const char* op_kind_name(OpKind op);
// Operations whose tensors must have the same shape on every rank.
bool is_even(OpKind op);

struct CallInfo {
  OpKind op = OpKind::Barrier;
  std::optional<ReduceOp> reduce;
  std::optional<DType> dtype;  // absent for barrier and split
  std::optional<Shape> shape;  // the rank's input; its output for scatter and recv
  std::optional<Shape> out_shape;
  int64_t pieces = -1;  // number of tensors in an output or input list
  int root = -1;        // broadcast, scatter
  int peer = -1;        // send: dst, recv: src
  int tag = -1;
  // Position among the collectives started on the group (0 for its first); -1 for send/recv,
  // which are not collective. Matching collectives have the same position on every rank.
  int64_t seq = -1;
};

// A call on one tensor of `shape`; callers set the other fields that apply.
CallInfo tensor_call(OpKind op, DType dtype, const Shape& shape);

// "all_reduce(sum) float32 [4, 4]", "scatter(root 0) int64 [3]", "send(dst 1, tag 0) ...".
std::string to_string(const CallInfo& call);

}  // namespace tessera::detail
