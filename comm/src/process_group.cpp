#include "tessera/comm/process_group.h"

#include <mutex>

#include "op_counts.h"

namespace tessera {

namespace {
std::mutex& counts_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, int64_t>& counts() {
  static auto* c = new std::map<std::string, int64_t>();
  return *c;
}
}  // namespace

namespace detail {
void count_comm_op(const char* op) {
  std::lock_guard<std::mutex> g(counts_mutex());
  ++counts()[op];
}
}  // namespace detail

std::map<std::string, int64_t> comm_op_counts() {
  std::lock_guard<std::mutex> g(counts_mutex());
  return counts();
}

void reset_comm_op_counts() {
  std::lock_guard<std::mutex> g(counts_mutex());
  counts().clear();
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Product:
      return "product";
  }
  return "unknown";
}

}  // namespace tessera
