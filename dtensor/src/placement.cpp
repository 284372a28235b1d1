#include "tessera/dtensor/placement.h"

#include "tessera/core/shape.h"

namespace tessera {

Placement Placement::normalized(int64_t ndim) const {
  if (!is_shard()) return *this;
  Placement p = *this;
  p.dim_ = wrap_dim(dim_, ndim, is_strided_shard() ? "StridedShard" : "Shard");
  return p;
}

std::string Placement::str() const {
  switch (kind_) {
    case Kind::Replicate:
      return "R";
    case Kind::Shard:
      return "S(" + std::to_string(dim_) + ")";
    case Kind::StridedShard:
      return "SS(" + std::to_string(dim_) + "," + std::to_string(split_factor_) + ")";
    case Kind::Partial:
      return std::string("P(") + reduce_op_name(op_) + ")";
  }
  return "?";
}

std::string placements_str(const Placements& p) {
  std::string s = "[";
  for (size_t i = 0; i < p.size(); ++i)
    s += (i ? ", " : "") + p[i].str();
  return s + "]";
}

bool partials_commute(const Placements& p) {
  const auto family = [](ReduceOp op) { return op == ReduceOp::Avg ? ReduceOp::Sum : op; };
  const Placement* first = nullptr;
  for (const Placement& q : p) {
    if (!q.is_partial()) continue;
    if (!first) first = &q;
    if (family(q.reduce_op()) != family(first->reduce_op())) return false;
  }
  return true;
}

}  // namespace tessera
