#include "mpi_types.h"

#include <type_traits>

#include "mpi_state.h"
#include "tessera/core/error.h"
#include "tessera/core/half.h"

namespace tessera::mpi {

namespace {

struct HalfTypes {
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;
  MPI_Datatype f16 = MPI_DATATYPE_NULL;
  MPI_Op sum = MPI_OP_NULL;
  MPI_Op product = MPI_OP_NULL;
  MPI_Op max = MPI_OP_NULL;
  MPI_Op min = MPI_OP_NULL;
};
HalfTypes g_half;

struct Add {
  float operator()(float a, float b) const { return a + b; }
};
struct Mul {
  float operator()(float a, float b) const { return a * b; }
};
struct Max {
  float operator()(float a, float b) const { return a > b ? a : b; }
};
struct Min {
  float operator()(float a, float b) const { return a < b ? a : b; }
};

// MPI's contract for user ops: inout[i] = in[i] op inout[i]. Each step rounds to 16 bits, as
// each hop of a ring or tree must send 16-bit values to save the bandwidth.
template <class H, class F>
void combine(const void* in, void* inout, int n) {
  const H* a = static_cast<const H*>(in);
  H* b = static_cast<H*>(inout);
  F f;
  for (int i = 0; i < n; ++i)
    b[i] = H(f(float(a[i]), float(b[i])));
}

template <class F>
void half_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  if (*type == g_half.bf16) {
    combine<BFloat16, F>(in, inout, *len);
  } else {
    combine<Float16, F>(in, inout, *len);
  }
}

}  // namespace

void create_types() {
  auto guard = lock();
  check(MPI_Type_contiguous(2, MPI_BYTE, &g_half.bf16), "MPI_Type_contiguous", "bfloat16 type");
  check(MPI_Type_commit(&g_half.bf16), "MPI_Type_commit", "bfloat16 type");
  check(MPI_Type_contiguous(2, MPI_BYTE, &g_half.f16), "MPI_Type_contiguous", "float16 type");
  check(MPI_Type_commit(&g_half.f16), "MPI_Type_commit", "float16 type");
  check(MPI_Op_create(&half_op<Add>, 1, &g_half.sum), "MPI_Op_create", "16-bit sum");
  check(MPI_Op_create(&half_op<Mul>, 1, &g_half.product), "MPI_Op_create", "16-bit product");
  check(MPI_Op_create(&half_op<Max>, 1, &g_half.max), "MPI_Op_create", "16-bit max");
  check(MPI_Op_create(&half_op<Min>, 1, &g_half.min), "MPI_Op_create", "16-bit min");
}

void free_types() {
  auto guard = lock();
  for (MPI_Op* op : {&g_half.sum, &g_half.product, &g_half.max, &g_half.min}) {
    if (*op != MPI_OP_NULL) MPI_Op_free(op);
  }
  for (MPI_Datatype* t : {&g_half.bf16, &g_half.f16}) {
    if (*t != MPI_DATATYPE_NULL) MPI_Type_free(t);
  }
}

MPI_Datatype datatype(DType dt) {
  switch (dt) {
    case DType::Float32:
      return MPI_FLOAT;
    case DType::Float64:
      return MPI_DOUBLE;
    case DType::BFloat16:
      return g_half.bf16;
    case DType::Float16:
      return g_half.f16;
    case DType::Int64:
      return MPI_INT64_T;
    case DType::Int32:
      return MPI_INT32_T;
    case DType::Bool:
      static_assert(sizeof(bool) == 1, "bool travels as one byte");
      return MPI_UINT8_T;
  }
  TESSERA_FAIL("no MPI datatype for dtype ", int(dt));
}

MPI_Op reduce_op(ReduceOp op, DType dt) {
  if (is_half(dt)) {
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        return g_half.sum;
      case ReduceOp::Product:
        return g_half.product;
      case ReduceOp::Max:
        return g_half.max;
      case ReduceOp::Min:
        return g_half.min;
    }
  }
  if (dt == DType::Bool) {
    TESSERA_CHECK(op != ReduceOp::Avg, "reduce op avg is undefined for bool tensors");
    return op == ReduceOp::Sum || op == ReduceOp::Max ? MPI_LOR : MPI_LAND;
  }
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return MPI_SUM;
    case ReduceOp::Product:
      return MPI_PROD;
    case ReduceOp::Max:
      return MPI_MAX;
    case ReduceOp::Min:
      return MPI_MIN;
  }
  TESSERA_FAIL("unknown reduce op ", int(op));
}

void divide(void* data, int64_t n, DType dt, int64_t divisor) {
  if (divisor == 1 || n == 0) return;
  TESSERA_CHECK(dt != DType::Bool, "avg of bool tensors is undefined");
  dispatch_dtype(dt, [&]<class T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      using C = compute_t<T>;
      T* p = static_cast<T*>(data);
      const C d = C(divisor);
      for (int64_t i = 0; i < n; ++i)
        p[i] = T(C(p[i]) / d);
    }
  });
}

}  // namespace tessera::mpi
