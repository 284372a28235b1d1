#include "call_info.h"

#include <vector>

namespace tessera::detail {

const char* op_kind_name(OpKind op) {
  switch (op) {
    case OpKind::AllReduce:
      return "all_reduce";
    case OpKind::AllGatherIntoTensor:
      return "all_gather_into_tensor";
    case OpKind::AllGather:
      return "all_gather";
    case OpKind::ReduceScatterTensor:
      return "reduce_scatter_tensor";
    case OpKind::ReduceScatter:
      return "reduce_scatter";
    case OpKind::AllToAll:
      return "all_to_all";
    case OpKind::Broadcast:
      return "broadcast";
    case OpKind::Scatter:
      return "scatter";
    case OpKind::Send:
      return "send";
    case OpKind::Recv:
      return "recv";
    case OpKind::Barrier:
      return "barrier";
    case OpKind::Split:
      return "split";
    case OpKind::AllGatherRuns:
      return "all_gather_runs";
  }
  return "unknown op";
}

bool is_even(OpKind op) {
  return op == OpKind::AllReduce || op == OpKind::AllGatherIntoTensor ||
         op == OpKind::ReduceScatterTensor || op == OpKind::Broadcast;
}

CallInfo tensor_call(OpKind op, DType dtype, const Shape& shape) {
  CallInfo c;
  c.op = op;
  c.dtype = dtype;
  c.shape = shape;
  return c;
}

std::string to_string(const CallInfo& call) {
  std::vector<std::string> args;
  if (call.reduce) args.emplace_back(reduce_op_name(*call.reduce));
  if (call.root >= 0) args.push_back("root " + std::to_string(call.root));
  if (call.peer >= 0) {
    args.push_back(std::string(call.op == OpKind::Send ? "dst " : "src ") +
                   std::to_string(call.peer));
  }
  if (call.tag >= 0) args.push_back("tag " + std::to_string(call.tag));
  std::string s = op_kind_name(call.op);
  if (!args.empty()) {
    s += "(";
    for (size_t i = 0; i < args.size(); ++i) {
      if (i) s += ", ";
      s += args[i];
    }
    s += ")";
  }
  // Appended piecewise: `" " + std::string` trips a false -Wrestrict in GCC 12.
  if (call.dtype) s.append(" ").append(dtype_name(*call.dtype));
  if (call.shape) s.append(" ").append(shape_str(*call.shape));
  if (call.out_shape) s.append(" -> ").append(shape_str(*call.out_shape));
  if (call.pieces >= 0) {
    s.append(" (").append(std::to_string(call.pieces)).append(" tensors in the list)");
  }
  return s;
}

}  // namespace tessera::detail
