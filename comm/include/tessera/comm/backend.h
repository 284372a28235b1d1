#pragma once
// Communication backends per device type, as c10d chooses one per device ("cpu:gloo,cuda:nccl").
// The CPU's is the MPI world group, made by init(). Another device type gets a backend by
// registering how to make its world group; a DeviceMesh of that device type splits it.
#include <functional>
#include <string>

#include "tessera/comm/process_group.h"
#include "tessera/core/device.h"

namespace tessera {

// Makes the world group of a backend: every world rank, in world-rank order. Runs on first use
// of world_group(type), which is then collective over every world rank. The backend's group only
// moves data: world_group(type) wraps it (and every group split from it) with what every backend
// shares, as c10d's ProcessGroupWrapper does: argument checks on every rank before data moves,
// the numbering of collectives, the debug signature check (TESSERA_DEBUG_COLLECTIVES), the op
// counts, and the timeout watchdog with the departure protocol. Its split() must return groups of
// the same backend (or nullptr for a negative color).
using BackendFactory = std::function<ProcessGroupPtr()>;

// Registers `name`'s factory for `type`; replaces an earlier registration whose world group was
// not made yet (an error once it was). Not for the CPU, whose backend is MPI.
void register_backend(DeviceType type, const std::string& name, BackendFactory make_world);

// The name of the backend for `type` ("mpi" for the CPU), "" when none is registered.
std::string backend_name(DeviceType type);

// A group that runs `host_group`'s operations on tensors of any device by moving them through
// host memory: device inputs are copied to host tensors, the host group's operation runs on them,
// and device outputs are copied back when the work completes (wait(), is_completed(), or
// dropping the work). CPU tensors pass through untouched. Two copies over the host link per call
// make it slower than a device-native backend, but it runs wherever the CPU's backend does,
// several ranks sharing one GPU included (which NCCL refuses).
ProcessGroupPtr host_staged_group(ProcessGroupPtr host_group);
// The backend factory of such groups over the CPU's world:
// register_backend(DeviceType::CUDA, "mpi", host_staged_backend()).
BackendFactory host_staged_backend();

// The NCCL backend for CUDA tensors (c10d's "nccl"): one NCCL communicator per group, made over
// the CPU group with the same members (its rank 0's unique id, broadcast over MPI), on the device
// current_device(DeviceType::CUDA) names when the group is made; operations run on a stream of
// the group's own, ordered after the kernels queued before them, and wait() blocks until they
// are done. A timeout aborts the communicator before the job ends. NCCL needs a GPU per rank:
// making a group whose members share one is an error on every member. Where NCCL is usable
// (nccl_unavailable() is ""), world_group(DeviceType::CUDA) uses it unless another backend was
// registered first. Sends and receives match in issue order: NCCL has no tags.
BackendFactory nccl_backend();
// Why nccl_backend() cannot run here (no CUDA in this build, no libnccl.so.2), "" when it can.
std::string nccl_unavailable();

// The world group of the backend for `type` (made on first use, collectively; dropped at
// finalize()). CUDA with no backend registered takes NCCL where it is usable; otherwise an error
// naming the device type and the choices.
ProcessGroupPtr world_group(DeviceType type);

}  // namespace tessera
