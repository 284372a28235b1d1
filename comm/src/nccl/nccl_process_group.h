#pragma once
// The NCCL backend's groups (internal to comm/; users reach it through nccl_backend()).
#include "nccl_library.h"
#include "tessera/comm/process_group.h"

namespace tessera::detail {

// An NCCL group over the members of `host` (a CPU group, kept for bootstrapping the groups split
// from this one), on `device`, through `lib`. Collective over `host`: gathers the members'
// devices (an error on every member when two share a GPU), then rank 0's unique id makes the
// communicator. Unchecked: world_group(DeviceType::CUDA) wraps it as it wraps every backend.
ProcessGroupPtr nccl_group(ProcessGroupPtr host, Device device, NcclLibrary& lib);

}  // namespace tessera::detail
