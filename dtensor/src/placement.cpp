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

}  // namespace tessera
