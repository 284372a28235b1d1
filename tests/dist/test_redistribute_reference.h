#pragma once
// Independent reference for DTensor layouts, written from the placement semantics (torch.chunk
// per level, shards of one tensor dim nested left to right, a StridedShard nested inside the later
// shards of its dim) without calling the layout code under test.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/expect_contains.h"
#include "common/expect_error.h"
#include "tessera/tessera.h"

namespace tessera::test_ref {

struct Range {
  int64_t start;
  int64_t length;
};

// torch.chunk: pieces of ceil(n / parts); the last ones short or empty (5 over 4: 2, 2, 1, 0).
inline Range torch_chunk(int64_t n, int64_t parts, int64_t index) {
  const int64_t piece = (n + parts - 1) / parts;
  int64_t start = piece * index;
  if (start > n) start = n;
  int64_t length = n - start;
  if (length > piece) length = piece;
  return {start, length};
}

// Row-major coordinate of position `index` in a mesh of `shape`.
inline std::vector<int64_t> unravel(int64_t index, const Shape& shape) {
  std::vector<int64_t> c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    c[d] = index % shape[d];
    index /= shape[d];
  }
  return c;
}

struct Window {
  Shape offset;
  Shape shape;
};

// The block of a `global`-shaped tensor that mesh coordinate `coord` holds. Per tensor dim: the
// plain shards left to right, then each StridedShard, whose split factor must be the product of
// the later plain shards of its dim (the split it is nested in).
inline Window window(const Shape& global, const Shape& mesh, const std::vector<int64_t>& coord,
                     const Placements& placements) {
  Window w{Shape(global.size(), 0), global};
  const int64_t nd = int64_t(global.size());
  for (int64_t d = 0; d < nd; ++d) {
    std::vector<size_t> order;
    for (size_t m = 0; m < placements.size(); ++m)
      if (placements[m].kind() == Placement::Kind::Shard && placements[m].dim() == d)
        order.push_back(m);
    for (size_t m = 0; m < placements.size(); ++m) {
      if (placements[m].kind() != Placement::Kind::StridedShard || placements[m].dim() != d)
        continue;
      int64_t later = 1;
      for (size_t k = m + 1; k < placements.size(); ++k)
        if (placements[k].kind() == Placement::Kind::Shard && placements[k].dim() == d)
          later *= mesh[k];
      EXPECT_EQ(later, placements[m].split_factor()) << "reference: unsupported nesting";
      order.push_back(m);
    }
    for (size_t m : order) {
      Range r = torch_chunk(w.shape[size_t(d)], mesh[m], coord[m]);
      w.offset[size_t(d)] += r.start;
      w.shape[size_t(d)] = r.length;
    }
  }
  return w;
}

// Partial placements become Replicate: the placements of a gradient.
inline Placements grad_placements(Placements p) {
  for (auto& q : p)
    if (q.is_partial()) q = Replicate();
  return p;
}

// A fresh float64 tensor with the elements of `global` (float64) inside `w`, by index arithmetic.
inline Tensor cut(const Tensor& global, const Window& w) {
  const Shape& gs = global.shape();
  const std::vector<double> g = global.to_vector<double>();
  const int64_t n = shape_numel(w.shape);
  std::vector<double> out;
  out.reserve(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int64_t> idx = unravel(i, w.shape);
    int64_t flat = 0;
    for (size_t d = 0; d < gs.size(); ++d)
      flat = flat * gs[d] + w.offset[d] + idx[d];
    out.push_back(g[size_t(flat)]);
  }
  return from_vector<double>(out, w.shape);
}

// Small multiples of 1/4: sums of a few of them are exact in float64, so every comparison below
// can be exact whatever order a collective adds in.
inline Tensor dyadic(const Shape& shape, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dist(-64, 64);
  std::vector<double> v(size_t(shape_numel(shape)));
  for (auto& x : v)
    x = dist(rng) / 4.0;
  return from_vector<double>(v, shape);
}

// "" when equal in shape and every element, else what differs first.
inline std::string diff(const Tensor& got, const Tensor& want) {
  if (!got.defined()) return "got an undefined tensor, want " + shape_str(want.shape());
  if (got.shape() != want.shape())
    return "shape " + shape_str(got.shape()) + ", want " + shape_str(want.shape());
  const std::vector<double> a = got.to_vector<double>(), b = want.to_vector<double>();
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i])
      return "element " + std::to_string(i) + " is " + std::to_string(a[i]) + ", want " +
             std::to_string(b[i]) + " (shape " + shape_str(want.shape()) + ")";
  return "";
}

inline std::string coord_str(const std::vector<int64_t>& c) {
  std::string s = "(";
  for (size_t i = 0; i < c.size(); ++i)
    s += (i ? ", " : "") + std::to_string(c[i]);
  return s + ")";
}

// Failures of one test on this rank: the first few are reported in full, the rest counted, so a
// systematic bug does not bury the output.
class Failures {
 public:
  void check(const std::string& what, const std::string& context, const std::string& problem) {
    ++checks_;
    if (problem.empty()) return;
    if (++count_ <= kReported) ADD_FAILURE() << context << ": " << what << ": " << problem;
  }
  void summarize() const {
    EXPECT_EQ(count_, 0) << count_ << " of " << checks_ << " checks failed on world rank "
                         << world_rank() << " (first " << kReported << " reported above)";
    EXPECT_GT(checks_, 0);
  }

 private:
  static constexpr int kReported = 8;
  int count_ = 0;
  int checks_ = 0;
};

// The meshes of the suite for this world size: 1-D always; (2, 2) on 4 ranks; (2, 4), (4, 2)
// and (2, 2, 2) on 8. Creating a mesh is collective, so tests make them once.
inline std::vector<DeviceMesh> suite_meshes() {
  const int n = world_size();
  std::vector<DeviceMesh> out;
  out.emplace_back(Shape{n}, std::vector<std::string>{"x"});
  if (n == 4) out.emplace_back(Shape{2, 2}, std::vector<std::string>{"dp", "tp"});
  if (n == 8) {
    out.emplace_back(Shape{2, 4}, std::vector<std::string>{"dp", "tp"});
    out.emplace_back(Shape{4, 2}, std::vector<std::string>{"dp", "tp"});
    out.emplace_back(Shape{2, 2, 2}, std::vector<std::string>{"pp", "dp", "tp"});
  }
  return out;
}

// The tests built on this reference check messages with these (TESSERA_EXPECT_CONTAINS comes
// with common/expect_contains.h).
using ::tessera::testing::error_of;

}  // namespace tessera::test_ref
