#pragma once
// TESSERA_DEBUG_COLLECTIVES: before a collective, every rank of the group sends what it is about
// to call to every other (one all-gather on the group's debug group, a CPU group over the same
// ranks), and all ranks compare the same table, so a mismatch throws the same error on every rank
// instead of hanging or silently mixing data.
#include <cstdint>
#include <vector>

#include <functional>
#include <string>

#include "call_info.h"
#include "tessera/comm/process_group.h"

namespace tessera::detail {

struct Signature {
  CallInfo call;
  // Element counts this rank sends to / receives from each group rank, for the uneven
  // collectives (empty when the op has none): the check pairs them up across ranks.
  std::vector<int64_t> send_counts;
  std::vector<int64_t> recv_counts;
  int64_t numel = 0;  // of call.shape
  // One hash per group rank of a list every rank must pass alike (all_gather_runs' runs[r]),
  // empty when the op has none: the check compares them across ranks.
  std::vector<int64_t> list_hashes;
};

// A hash of every run's src, dst and length, in order, for Signature::list_hashes.
int64_t runs_hash(const std::vector<GatherRun>& runs);

// Throws tessera::Error on every rank when the signatures of the group's ranks do not fit. `debug`
// carries the exchange (CPU int64 tensors); `wait` waits for its work (with the timeout);
// `group` names the checked group in the messages.
void check_signatures(ProcessGroup& debug, const std::string& group, const Signature& mine,
                      const std::function<void(const WorkPtr&, const CallInfo&)>& wait);

}  // namespace tessera::detail
