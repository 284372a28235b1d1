#pragma once
// TESSERA_DEBUG_COLLECTIVES: before a collective, every rank of the group sends what it is about
// to call to every other (one allgather on the group's debug communicator), and all ranks compare
// the same table, so a mismatch throws the same error on every rank instead of hanging or
// silently mixing data.
#include <cstdint>
#include <vector>

#include "call_info.h"
#include "work.h"

namespace tessera::mpi {

struct Signature {
  CallInfo call;
  // Element counts this rank sends to / receives from each group rank, for the uneven
  // collectives (empty when the op has none): the check pairs them up across ranks.
  std::vector<int64_t> send_counts;
  std::vector<int64_t> recv_counts;
  int64_t numel = 0;  // of call.shape
};

// Throws tessera::Error on every rank when the signatures of the group's ranks do not fit.
void check_signatures(const Communicator& debug_comm, const Signature& mine);

}  // namespace tessera::mpi
