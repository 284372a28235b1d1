#pragma once
// Tessera dtypes and reduce ops as MPI sees them. MPI has no 16-bit float types: bfloat16 and
// float16 travel as distinct 2-byte contiguous types, reduced by user ops that compute each
// combining step in float32 and round back to nearest even.
#include <mpi.h>

#include <cstdint>
#include <vector>

#include "tessera/comm/process_group.h"
#include "tessera/core/tensor.h"

namespace tessera::mpi {

// Creates and frees the 16-bit types and their ops; between init and finalize.
void create_types();
void free_types();

MPI_Datatype datatype(DType dt);
// The op MPI reduces with. Avg reduces with Sum and the caller divides afterwards. Bool is
// logical: Sum and Max are "or", Product and Min are "and" (as torch does for bool).
MPI_Op reduce_op(ReduceOp op, DType dt);
// data[i] /= divisor for n contiguous elements of dtype dt: Avg's second half. Integers divide
// with truncation toward zero, as C++ does, so an int Avg is the truncated mean.
void divide(void* data, int64_t n, DType dt, int64_t divisor);

// The elements of `t` (non-negative strides) where they lie, as one committed datatype holding
// their absolute address: passed with the buffer MPI_BOTTOM, pieces of any storages, offsets and
// strides travel in one call without being packed by us first. Call under lock(); the caller
// frees it (PlacedTypes does).
MPI_Datatype placed_type(const Tensor& t);

// The datatypes one operation made, freed when it is destroyed: after the operation completed,
// since a non-blocking collective may read a datatype until then.
class PlacedTypes {
 public:
  PlacedTypes() = default;
  PlacedTypes(const PlacedTypes&) = delete;
  PlacedTypes& operator=(const PlacedTypes&) = delete;
  // Takes the lock itself: never destroy one while holding it.
  ~PlacedTypes();
  // placed_type(t), kept until destruction. Call under lock().
  MPI_Datatype add(const Tensor& t);
  // A committed type made elsewhere, freed with the others.
  MPI_Datatype adopt(MPI_Datatype t);

 private:
  std::vector<MPI_Datatype> types_;
};

// The arguments of one MPI_Ialltoallw and the datatypes they name, kept until the operation
// completes: Open MPI 4.1 reads the datatype arrays again when the collective completes, to
// release the types, so they must outlive the call, like the types themselves. A count of 0 with
// MPI_BYTE is a rank nothing goes to or comes from.
struct AllToAllW {
  explicit AllToAllW(size_t n)
      : send_counts(n, 0),
        recv_counts(n, 0),
        displs(n, 0),
        send_types(n, MPI_BYTE),
        recv_types(n, MPI_BYTE) {}
  std::vector<int> send_counts, recv_counts, displs;
  std::vector<MPI_Datatype> send_types, recv_types;
  PlacedTypes types;
};

}  // namespace tessera::mpi
