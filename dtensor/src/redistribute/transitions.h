#pragma once
#include "tessera/dtensor/redistribute.h"

namespace tessera::redistribute_detail {

// One family per file; transition_table() orders them.
const Transition* shard_to_shard();
const Transition* shard_to_replicate();
const Transition* partial_to_replicate();
const Transition* partial_to_shard();
const Transition* replicate_to_shard();
const Transition* replicate_to_partial();

// Bytes of a rank's piece under `spec` for an even split (the same on every rank).
int64_t local_bytes(const DTensorSpec& spec);

}  // namespace tessera::redistribute_detail
