#pragma once
// How a tensor is laid out over one mesh dim: one small value type (kind + dim + factor + op).
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/comm/process_group.h"

namespace tessera {

class Placement {
 public:
  enum class Kind : uint8_t { Replicate, Shard, StridedShard, Partial };

  Placement() = default;  // Replicate
  static Placement replicate() { return Placement(); }
  static Placement shard(int64_t dim) { return Placement(Kind::Shard, dim, 1, ReduceOp::Sum); }
  // A shard of `dim` nested inside the split that the later mesh dims sharding `dim` make
  // (their sizes multiply to split_factor): what FSDP makes of a dim TP already split.
  static Placement strided_shard(int64_t dim, int64_t split_factor) {
    return Placement(Kind::StridedShard, dim, split_factor, ReduceOp::Sum);
  }
  static Placement partial(ReduceOp op = ReduceOp::Sum) {
    return Placement(Kind::Partial, 0, 1, op);
  }

  Kind kind() const { return kind_; }
  bool is_replicate() const { return kind_ == Kind::Replicate; }
  bool is_partial() const { return kind_ == Kind::Partial; }
  // True for Shard and StridedShard (both split a tensor dim over the mesh dim).
  bool is_shard() const { return kind_ == Kind::Shard || kind_ == Kind::StridedShard; }
  bool is_shard(int64_t dim) const { return is_shard() && dim_ == dim; }
  bool is_strided_shard() const { return kind_ == Kind::StridedShard; }
  int64_t dim() const { return dim_; }
  int64_t split_factor() const { return split_factor_; }
  ReduceOp reduce_op() const { return op_; }

  // The same placement with a negative shard dim wrapped for a tensor of `ndim` dims.
  Placement normalized(int64_t ndim) const;
  std::string str() const;  // "R", "S(0)", "SS(0,2)", "P(sum)"
  bool operator==(const Placement& o) const {
    return kind_ == o.kind_ && dim_ == o.dim_ && split_factor_ == o.split_factor_ &&
           (kind_ != Kind::Partial || op_ == o.op_);
  }

 private:
  Placement(Kind k, int64_t dim, int64_t sf, ReduceOp op)
      : kind_(k), dim_(dim), split_factor_(sf), op_(op) {}
  Kind kind_ = Kind::Replicate;
  int64_t dim_ = 0;
  int64_t split_factor_ = 1;
  ReduceOp op_ = ReduceOp::Sum;
};

using Placements = std::vector<Placement>;

// PyTorch's spellings: Shard(0), Replicate(), Partial(), StridedShard(0, 2).
inline Placement Shard(int64_t dim) {
  return Placement::shard(dim);
}
inline Placement Replicate() {
  return Placement::replicate();
}
inline Placement Partial(ReduceOp op = ReduceOp::Sum) {
  return Placement::partial(op);
}
inline Placement StridedShard(int64_t dim, int64_t split_factor) {
  return Placement::strided_shard(dim, split_factor);
}

std::string placements_str(const Placements& p);  // "[S(0), R]"

// Whether the Partial placements of `p` give one value whatever order their reductions run in:
// sums and averages mix (both linear), max only with max, min only with min. A sum of maxima is
// not a maximum of sums, so [P(sum), P(max)] is no layout.
bool partials_commute(const Placements& p);

}  // namespace tessera
