#include "mpi_types.h"

#include <type_traits>
#include <utility>
#include <vector>

#include "buffers.h"
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

MPI_Datatype placed_type(const Tensor& t) {
  constexpr const char* kWhat = "tensor datatype";
  // (size, stride) from outer to inner. Dims of one element say nothing and a dim whose stride
  // spans the whole next dim continues its run: merging them lets a contiguous tensor be one
  // block and a column slice of a matrix a vector of row pieces, which MPI copies fastest.
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t size = t.size(d), stride = t.stride(d);
    TESSERA_CHECK(stride >= 0 || size <= 1, "placed_type: negative stride in ", t.str());
    if (size == 1) continue;
    if (!dims.empty() && dims.back().second == size * stride) {
      dims.back() = {dims.back().first * size, stride};
    } else {
      dims.emplace_back(size, stride);
    }
  }
  const MPI_Datatype element = datatype(t.dtype());
  const MPI_Aint element_bytes = MPI_Aint(t.element_size());
  MPI_Datatype layout = element;
  for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
    const int count = to_count(it->first, kWhat);
    MPI_Datatype outer = MPI_DATATYPE_NULL;
    if (layout == element && it->second == 1) {
      check(MPI_Type_contiguous(count, element, &outer), "MPI_Type_contiguous", kWhat);
    } else {
      check(MPI_Type_create_hvector(count, 1, it->second * element_bytes, layout, &outer),
            "MPI_Type_create_hvector", kWhat);
    }
    if (layout != element) MPI_Type_free(&layout);
    layout = outer;
  }
  MPI_Aint address = 0;
  check(MPI_Get_address(t.raw_data(), &address), "MPI_Get_address", kWhat);
  int one = 1;
  MPI_Datatype placed = MPI_DATATYPE_NULL;
  const int rc = MPI_Type_create_struct(1, &one, &address, &layout, &placed);
  if (layout != element) MPI_Type_free(&layout);
  check(rc, "MPI_Type_create_struct", kWhat);
  check(MPI_Type_commit(&placed), "MPI_Type_commit", kWhat);
  return placed;
}

PlacedTypes::~PlacedTypes() {
  if (types_.empty() || !active()) return;
  auto guard = lock();
  for (MPI_Datatype& t : types_)
    MPI_Type_free(&t);
}

MPI_Datatype PlacedTypes::add(const Tensor& t) {
  types_.reserve(types_.size() + 1);  // so that a type made is never lost to a failed push_back
  types_.push_back(placed_type(t));
  return types_.back();
}

MPI_Datatype PlacedTypes::adopt(MPI_Datatype t) {
  types_.reserve(types_.size() + 1);
  types_.push_back(t);
  return t;
}

}  // namespace tessera::mpi
