#pragma once
// Private to core: what every device kernel's host code does around a launch: reach a tensor's
// memory as a typed pointer (to hand to a functor, never to read on the host), launch only when
// there is work, make results on the inputs' device, and pick the compute type.
#include <cstdint>

#include "tessera/core/factory.h"
#include "tessera/core/host_device.h"
#include "tessera/core/tensor.h"

namespace tessera::kernels::portable {

// t's first element as T*, for a functor; the host never dereferences it.
template <class T>
T* data_of(const Tensor& t) {
  return static_cast<T*>(const_cast<void*>(t.raw_data()));
}

inline Tensor empty_on(const Shape& shape, DType dt, Device device) {
  return empty(shape, TensorOptions(dt, device));
}

// Runs f over [0, n) on `device` through the executor; nothing when n is 0.
template <class Exec, class F>
void launch(const char* op, Device device, int64_t n, const F& f) {
  if (n > 0) Exec::for_each(op, device, n, f);
}

// Runs f(row, team) for every row in [0, rows) through the executor. A row's work is shared by
// the lanes of a team (lane team.lane() of team.size(): a block of threads on a GPU), which
// stride over the row's elements and meet at team.sum(v) and team.max(v): every lane calls
// them alike, in the same order, and gets the combination of all lanes' values (lanes in order);
// team.reduce(v, op) combines with any associative op (a functor callable on host and device).
// The control flow around such a call must be the same on every lane of the row.
template <class Exec, class F>
void launch_rows(const char* op, Device device, int64_t rows, const F& f) {
  if (rows > 0) Exec::for_each_row(op, device, rows, f);
}

// The team of one: how the CPU runs a row functor row by row (its sums then add in the order of
// the row, as the CPU's own loops do).
struct SerialTeam {
  TESSERA_HOST_DEVICE int lane() const { return 0; }
  TESSERA_HOST_DEVICE int size() const { return 1; }
  template <class C>
  TESSERA_HOST_DEVICE C sum(C v) {
    return v;
  }
  template <class C>
  TESSERA_HOST_DEVICE C max(C v) {
    return v;
  }
  template <class C, class Op>
  TESSERA_HOST_DEVICE C reduce(C v, Op) {
    return v;
  }
};

// A row functor as an element functor: row i by a team of one, for rows too short to share.
template <class F>
struct OneLaneRows {
  F f;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    SerialTeam team;
    f(i, team);
  }
};

// f<float> or f<double> for a compute dtype (16-bit types compute in float32).
template <class F>
void on_compute(DType cdt, F&& f) {
  if (cdt == DType::Float64)
    f.template operator()<double>();
  else
    f.template operator()<float>();
}

// t in the compute dtype, contiguous (undefined stays undefined).
inline Tensor in_compute(const Tensor& t, DType cdt) {
  return t.defined() ? t.to(cdt).contiguous() : Tensor();
}

// Selection moves bits: f<W> with W an unsigned word of the element's size.
template <class F>
void dispatch_width(size_t bytes, F&& f) {
  switch (bytes) {
    case 1:
      return f.template operator()<uint8_t>();
    case 2:
      return f.template operator()<uint16_t>();
    case 4:
      return f.template operator()<uint32_t>();
    default:
      return f.template operator()<uint64_t>();
  }
}

}  // namespace tessera::kernels::portable
