#include "tessera/testing/checks.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "tessera/comm/agree.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "tessera/testing/generators.h"
#include "tessera/testing/geometry.h"
#include "tolerance.h"

namespace tessera::testing {

namespace {

using detail::within;
// Where the elements of a compared piece sit in the global tensor, for the messages.
struct Located {
  const Window* window = nullptr;  // null: the piece is the global tensor
  Shape global_shape;
  bool want_is_index_tensor = false;  // values encode their global index (index_tensor)
};

bool is_index_tensor(const std::vector<double>& values) {
  for (size_t i = 0; i < values.size(); ++i)
    if (values[i] != double(i + 1)) return false;
  return !values.empty();
}

std::string where_str(int64_t flat, const Shape& shape, const Located& at) {
  const std::vector<int64_t> local = unravel_index(flat, shape);
  if (at.window == nullptr) return "global index " + index_str(local);
  return "local " + index_str(local) + " = global index " +
         index_str(at.window->global_index(local));
}

std::string value_str(double v, const Located& at) {
  std::string s = detail::number_str(v);
  if (!at.want_is_index_tensor) return s;
  auto from = index_of_value(v, at.global_shape);
  return s +
         (from ? " (the value of global index " + index_str(*from) + ")" : " (no element's value)");
}

std::string first_difference(const Tensor& got, const Tensor& want, Tolerance tol,
                             const Located& at) {
  if (!got.defined()) return "got an undefined tensor, want shape " + shape_str(want.shape());
  if (got.shape() != want.shape()) {
    std::string s = "shape " + shape_str(got.shape()) + ", want " + shape_str(want.shape());
    if (at.window) s += " (window " + at.window->str() + ")";
    return s;
  }
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  // Integers compared exactly as integers: past 2^53 two of them can be one double.
  const bool integers =
      !is_floating(got.dtype()) && !is_floating(want.dtype()) && tol.rtol == 0 && tol.atol == 0;
  std::vector<int64_t> gi, wi;
  if (integers) {
    gi = got.to(DType::Int64).to_vector<int64_t>();
    wi = want.to(DType::Int64).to_vector<int64_t>();
  }
  int64_t first = -1, count = 0;
  double worst = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (integers ? gi[i] == wi[i] : within(g[i], w[i], tol)) continue;
    if (first < 0) first = int64_t(i);
    ++count;
    // NaN is the largest difference there is; std::max would keep the previous one.
    const double d = std::abs(g[i] - w[i]);
    worst = std::isnan(d) || std::isnan(worst) ? std::numeric_limits<double>::quiet_NaN()
                                               : std::max(worst, d);
  }
  if (first < 0) return "";
  const size_t f = size_t(first);
  std::string s = std::to_string(count) + " of " + std::to_string(g.size()) +
                  " elements differ; first at " + where_str(first, want.shape(), at) + ": got " +
                  (integers ? std::to_string(gi[f]) : value_str(g[f], at)) + ", want " +
                  (integers ? std::to_string(wi[f]) : detail::number_str(w[f]));
  if (tol.rtol != 0 || tol.atol != 0)
    s += "; largest |difference| " + detail::number_str(worst) + " (allowed atol " +
         detail::number_str(tol.atol) + " + rtol " + detail::number_str(tol.rtol) + " * |want|)";
  return s;
}

std::string rank_str(const DTensor& dt) {
  return "rank " + std::to_string(world_rank()) + " (coordinate " +
         coordinate_str(dt.mesh().coordinate()) + " of " + dt.mesh().str() + ")";
}

// The shapes and dtypes of the members' pieces on one mesh dim: equal pieces can be exchanged.
constexpr int64_t kMaxDims = 8;
std::vector<std::vector<int64_t>> gather_headers(const ProcessGroupPtr& group, DType dtype,
                                                 const Shape& shape) {
  TESSERA_CHECK(int64_t(shape.size()) <= kMaxDims, "testing checks: tensors of more than ",
                kMaxDims, " dims (", shape_str(shape), ")");
  std::vector<int64_t> h(size_t(kMaxDims + 2), -1);
  h[0] = int64_t(dtype);
  h[1] = int64_t(shape.size());
  for (size_t d = 0; d < shape.size(); ++d)
    h[d + 2] = shape[d];
  Tensor mine = from_vector<int64_t>(h);
  Tensor all = empty({group->size() * (kMaxDims + 2)}, DType::Int64);
  group->all_gather_into_tensor(all, mine)->wait();
  const std::vector<int64_t> v = all.to_vector<int64_t>();
  std::vector<std::vector<int64_t>> out;
  for (int r = 0; r < group->size(); ++r)
    out.emplace_back(v.begin() + r * (kMaxDims + 2), v.begin() + (r + 1) * (kMaxDims + 2));
  return out;
}

std::vector<std::vector<int64_t>> gather_headers(const ProcessGroupPtr& group,
                                                 const Tensor& local) {
  return gather_headers(group, local.dtype(), local.shape());
}

std::string header_str(const std::vector<int64_t>& h) {
  Shape s(h.begin() + 2, h.begin() + 2 + h[1]);
  return shape_str(s) + " " + dtype_name(DType(h[0]));
}

// Before full_tensor(), which exchanges the pieces the ranks' specs give them: whether every rank
// of the mesh describes `dt` alike (global shape, dtype) and holds the piece its coordinate
// gets, agreed on by every rank (each mesh dim's group compares, then a flag is reduced over
// every dim), so that a rank that is wrong is reported instead of the ranks exchanging
// mismatched sizes. "" when all is well; else this rank's problem, or, where another rank's is
// wrong, a line that says so.
std::string piece_problem(const DTensor& dt, const char* which) {
  const DeviceMesh& mesh = dt.mesh();
  const std::string placements = placements_str(dt.placements());
  std::string problem;
  try {  // a layout the reference refuses, on this rank alone when the ranks' placements differ
    const Window w = reference_window(dt.shape(), mesh.shape(), mesh.coordinate(), dt.placements());
    if (dt.to_local().shape() != w.shape)
      problem = rank_str(dt) + " holds a piece of " + which + " of shape " +
                shape_str(dt.to_local().shape()) + " where " + placements + " of global shape " +
                shape_str(dt.shape()) + " give it " + shape_str(w.shape);
  } catch (const Error& e) {
    problem = rank_str(dt) + ": " + e.what();
  }
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    const ProcessGroupPtr& group = mesh.group(m);
    const std::string first = "rank " + std::to_string(group->world_ranks()[0]) +
                              " (first on mesh dim " + std::to_string(m) + ")";
    const auto headers = gather_headers(group, dt.dtype(), dt.shape());
    const auto& mine = headers[size_t(group->rank())];
    const std::vector<std::string> all = all_gather_strings(group, placements);
    if (!problem.empty()) continue;
    if (mine != headers[0])
      problem = rank_str(dt) + " describes " + which + " as " + header_str(mine) + ", " + first +
                " as " + header_str(headers[0]);
    else if (placements != all[0])
      problem =
          rank_str(dt) + " places " + which + " as " + placements + ", " + first + " as " + all[0];
  }
  Tensor flag = full({1}, problem.empty() ? 0 : 1, DType::Int32);
  for (int64_t m = 0; m < mesh.ndim(); ++m)
    mesh.group(m)->all_reduce(flag, ReduceOp::Max)->wait();
  if (!problem.empty() || flag.item<int32_t>() == 0) return problem;
  return std::string("not compared: another rank's piece or description of ") + which +
         " differs from what this rank's spec gives it (that rank reports which)";
}

}  // namespace

std::string tensor_mismatch(const Tensor& got, const Tensor& want, Tolerance tol) {
  return first_difference(got, want, tol, Located{nullptr, want.shape(), false});
}

std::string local_mismatch(const DTensor& dt, const Tensor& global, Tolerance tol) {
  TESSERA_CHECK(dt.defined() && global.defined(), "local_mismatch: an undefined tensor");
  const std::string who = rank_str(dt) + ", placements " + placements_str(dt.placements());
  const Window w =
      reference_window(dt.shape(), dt.mesh().shape(), dt.mesh().coordinate(), dt.placements());
  Tensor local = dt.to_local().detach();
  // A wrong global tensor on some ranks still takes them through the exchanges below, which the
  // other ranks make: a rank that returned early would leave them waiting.
  std::string problem;
  if (global.shape() != dt.shape())
    problem = "the DTensor's global shape is " + shape_str(dt.shape()) + ", the global tensor's " +
              shape_str(global.shape());
  const Placements& p = dt.placements();
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_partial()) continue;
    const ProcessGroupPtr& group = dt.mesh().group(int64_t(m));
    const auto headers = gather_headers(group, local);
    bool same = true;
    for (const auto& h : headers)
      same = same && h == headers[0];
    if (!same) {
      if (problem.empty())
        problem = "the ranks of Partial mesh dim " + std::to_string(m) +
                  " hold pieces of different shapes or dtypes: this one " +
                  header_str(headers[size_t(group->rank())]);
      continue;
    }
    local = local.to(DType::Float64).clone();
    if (local.numel() > 0) group->all_reduce(local, p[m].reduce_op())->wait();
  }
  if (!problem.empty()) return who + ": " + problem;
  const Tensor want = cut_window(global, w);
  Located at{&w, global.shape(), false};
  problem = first_difference(local, want, tol, at);
  if (problem.empty()) return "";
  // Only a failure's message says whose value an element holds.
  at.want_is_index_tensor = is_index_tensor(global.to_vector<double>());
  if (at.want_is_index_tensor) problem = first_difference(local, want, tol, at);
  bool partial = false;
  for (const Placement& q : p)
    partial = partial || q.is_partial();
  return who + (partial ? ", reduced over its Partial mesh dims" : "") + ", window " + w.str() +
         " of global shape " + shape_str(global.shape()) + ": " + problem;
}

std::string replica_mismatch(const DTensor& dt) {
  TESSERA_CHECK(dt.defined(), "replica_mismatch: an undefined DTensor");
  const Tensor local = dt.to_local().detach().contiguous();
  const Placements& p = dt.placements();
  const Window w =
      reference_window(dt.shape(), dt.mesh().shape(), dt.mesh().coordinate(), dt.placements());
  std::string problem;
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_replicate()) continue;
    const ProcessGroupPtr& group = dt.mesh().group(int64_t(m));
    const auto headers = gather_headers(group, local);
    std::vector<int64_t> coord0 = dt.mesh().coordinate();
    coord0[m] = 0;
    const std::string other = "rank " + std::to_string(group->world_ranks()[0]) + " (coordinate " +
                              coordinate_str(coord0) + ")";
    const std::string why = " should hold the same piece (mesh dim " + std::to_string(m) + " '" +
                            dt.mesh().dim_names()[m] + "' is Replicate)";
    bool same = true;
    for (const auto& h : headers)
      same = same && h == headers[0];
    if (!same) {
      if (problem.empty() && headers[size_t(group->rank())] != headers[0])
        problem = rank_str(dt) + " and " + other + why + " but hold " +
                  header_str(headers[size_t(group->rank())]) + " and " + header_str(headers[0]);
      continue;
    }
    const int64_t n = local.numel();
    if (n == 0) continue;
    Tensor flat = kernels::reshape(local, {n});
    Tensor all = empty({group->size() * n}, local.dtype());
    group->all_gather_into_tensor(all, flat)->wait();
    if (group->rank() == 0 || !problem.empty()) continue;
    const size_t es = local.element_size();
    const auto* mine = static_cast<const unsigned char*>(flat.raw_data());
    const auto* first = static_cast<const unsigned char*>(all.raw_data());
    int64_t differ = 0, at = -1;
    for (int64_t i = 0; i < n; ++i)
      if (std::memcmp(mine + i * es, first + i * es, es) != 0) {
        ++differ;
        if (at < 0) at = i;
      }
    if (differ == 0) continue;
    const std::vector<int64_t> li = unravel_index(at, local.shape());
    const double here = flat.to(DType::Float64).to_vector<double>()[size_t(at)];
    const double there = all.to(DType::Float64).to_vector<double>()[size_t(at)];
    problem = rank_str(dt) + " and " + other + why + " but differ in " + std::to_string(differ) +
              " of " + std::to_string(n) + " elements; first at local " + index_str(li) +
              " = global index " + index_str(w.global_index(li)) + ": " + detail::number_str(here) +
              " here, " + detail::number_str(there) + " there";
  }
  return problem;
}

namespace {

// global_mismatch once the ranks agreed that `a`'s pieces can be gathered (piece_problem).
std::string gathered_mismatch(const DTensor& a, const Tensor& b, Tolerance tol) {
  const Tensor full = a.full_tensor().detach();
  Located at{nullptr, b.shape(), false};
  std::string problem = first_difference(full, b, tol, at);
  if (problem.empty()) return "";
  at.want_is_index_tensor = is_index_tensor(b.to_vector<double>());
  if (at.want_is_index_tensor) problem = first_difference(full, b, tol, at);
  return "global values of " + placements_str(a.placements()) + " on " + a.mesh().str() +
         " (seen on rank " + std::to_string(world_rank()) + "): " + problem;
}

}  // namespace

std::string global_mismatch(const DTensor& a, const Tensor& b, Tolerance tol) {
  TESSERA_CHECK(a.defined() && b.defined(), "global_mismatch: an undefined tensor");
  const std::string piece = piece_problem(a, "the DTensor");
  if (!piece.empty()) return piece;
  return gathered_mismatch(a, b, tol);
}

std::string global_mismatch(const DTensor& a, const DTensor& b, Tolerance tol) {
  TESSERA_CHECK(a.defined() && b.defined(), "global_mismatch: an undefined DTensor");
  // Both agreed on before either is gathered: every rank then takes the same path.
  std::string piece = piece_problem(a, "the first DTensor");
  const std::string other = piece_problem(b, "the second DTensor");
  if (piece.empty()) piece = other;
  if (!piece.empty()) return piece;
  const Tensor want = b.full_tensor().detach();
  std::string problem = gathered_mismatch(a, want, tol);
  if (problem.empty()) return "";
  return problem + " (want: " + placements_str(b.placements()) + " on " + b.mesh().str() + ")";
}

namespace {

void report(const std::string& check, const std::string& problem, std::source_location where) {
  if (problem.empty()) return;
  ADD_FAILURE_AT(where.file_name(), int(where.line())) << check << ": " << problem;
}

}  // namespace

void expect_local_matches(const DTensor& dt, const Tensor& global, Tolerance tol,
                          std::source_location where) {
  report("expect_local_matches", local_mismatch(dt, global, tol), where);
}

void expect_replicas_equal(const DTensor& dt, std::source_location where) {
  report("expect_replicas_equal", replica_mismatch(dt), where);
}

void expect_close_global(const DTensor& a, const DTensor& b, double rtol, double atol,
                         std::source_location where) {
  report("expect_close_global", global_mismatch(a, b, {rtol, atol}), where);
}

void expect_close_global(const DTensor& a, const Tensor& b, double rtol, double atol,
                         std::source_location where) {
  report("expect_close_global", global_mismatch(a, b, {rtol, atol}), where);
}

void expect_close(const Tensor& got, const Tensor& want, Tolerance tol, const std::string& what,
                  std::source_location where) {
  const std::string problem = tensor_mismatch(got, want, tol);
  if (!problem.empty()) report("expect_close", what + ": " + problem, where);
}

void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what,
                  std::source_location where) {
  expect_close(got, want, Tolerance{tol, tol}, what, where);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  TESSERA_CHECK(a.shape() == b.shape(), "max_abs_diff: shapes ", shape_str(a.shape()), " and ",
                shape_str(b.shape()));
  const std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] == y[i]) continue;  // equal infinities too
    const double d = std::abs(x[i] - y[i]);
    // NaN matches nothing, as in the checks: std::max would drop it and report a margin of 0.
    if (std::isnan(d)) return std::numeric_limits<double>::quiet_NaN();
    m = std::max(m, d);
  }
  return m;
}

}  // namespace tessera::testing
