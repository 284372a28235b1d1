#pragma once
// Checks of sharded values that say what differs, on which rank, at which global index. Each
// comes twice: a function that returns the problem as text ("" when there is none), for use
// anywhere, and an expect_ form that reports it as a non-fatal GoogleTest failure at the caller's
// line. The DTensor checks are collective: every rank of the DTensor's mesh calls them, in the
// same order, and they agree on what to exchange before exchanging it, so a wrong shape on one
// rank is reported rather than left waiting in a collective.
#include <source_location>
#include <string>

#include "tessera/core/tensor.h"
#include "tessera/dtensor/dtensor.h"

namespace tessera::testing {

// Elements match when |got - want| <= atol + rtol * |want| (torch.testing.assert_close's rule);
// NaN matches nothing. The default is exact equality.
struct Tolerance {
  double rtol = 0;
  double atol = 0;
};

// Two local tensors: shape, then every element.
std::string tensor_mismatch(const Tensor& got, const Tensor& want, Tolerance tol = {});

// This rank's piece of `dt` against the window of `global` that its mesh coordinate must hold
// by the reference geometry (geometry.h). Over Partial mesh dims the pieces are first reduced
// with the placement's op, since any split of the value is allowed. Collective over dt's mesh.
std::string local_mismatch(const DTensor& dt, const Tensor& global, Tolerance tol = {});

// Every rank that should hold the same piece as another (they differ only in coordinates of
// Replicate mesh dims) holds it bit for bit: same shape, dtype and bytes. A rank reports how its
// piece differs from the one at coordinate 0 of that mesh dim. Collective over dt's mesh.
std::string replica_mismatch(const DTensor& dt);

// The global values of `a` and `b` (full_tensor of a DTensor: collective over its mesh).
std::string global_mismatch(const DTensor& a, const DTensor& b, Tolerance tol);
std::string global_mismatch(const DTensor& a, const Tensor& b, Tolerance tol);

void expect_local_matches(const DTensor& dt, const Tensor& global, Tolerance tol = {},
                          std::source_location where = std::source_location::current());
void expect_replicas_equal(const DTensor& dt,
                           std::source_location where = std::source_location::current());
void expect_close_global(const DTensor& a, const DTensor& b, double rtol, double atol = 0,
                         std::source_location where = std::source_location::current());
void expect_close_global(const DTensor& a, const Tensor& b, double rtol, double atol = 0,
                         std::source_location where = std::source_location::current());
// Plain tensors; `what` names them in the failure. A single `tol` is both: |got - want| <=
// tol * (1 + |want|), relative for large values and absolute near zero.
void expect_close(const Tensor& got, const Tensor& want, Tolerance tol, const std::string& what,
                  std::source_location where = std::source_location::current());
void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what,
                  std::source_location where = std::source_location::current());

// The largest |a - b| over the elements of two tensors of one shape (to print a margin); equal
// elements (infinities included) differ by 0, and a NaN in either, which matches nothing, makes it
// NaN, so that neither EXPECT_LE(max_abs_diff(a, b), tol) nor EXPECT_GT passes on it.
double max_abs_diff(const Tensor& a, const Tensor& b);

}  // namespace tessera::testing
