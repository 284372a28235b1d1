#pragma once
// What fully_shard must know across calls (internal to fsdp/), for a program that shards and
// drops models for as long as it runs, from any thread: which groups are alive (so that a
// module or parameter is sharded once, and a new root finds the groups inside it), and the
// communicators FSDP duplicates for itself. Both hold only live entries: a group leaves when
// it is destroyed (with its module's hooks), a communicator when nothing uses it. Each is
// guarded by a mutex.
#include <memory>
#include <string>
#include <vector>

#include "tessera/comm/process_group.h"

namespace tessera {
class Module;
class Parameter;
}  // namespace tessera

namespace tessera::detail {

class FSDPGroup;

void register_group(const std::shared_ptr<FSDPGroup>& group);
void unregister_group(const FSDPGroup* group);
std::vector<std::shared_ptr<FSDPGroup>> live_groups();
// Those of `groups` made by fully_shard(module) (one per dtype).
std::vector<std::shared_ptr<FSDPGroup>> groups_of(
    const std::vector<std::shared_ptr<FSDPGroup>>& groups, const Module& module);
// Those of `groups` made for modules strictly inside `module`.
std::vector<std::shared_ptr<FSDPGroup>> groups_inside(
    const std::vector<std::shared_ptr<FSDPGroup>>& groups, Module& module);
// Whether one of `groups` holds `p`: p's stored shard is a view of that group's flat buffer. By
// storage rather than address, so a parameter that replaced a sharded one at the same address
// (or in a new module where a dead one was) is not mistaken for it.
bool held_by(const std::vector<std::shared_ptr<FSDPGroup>>& groups, const Parameter& p);

// A duplicate of `pg` for one kind of FSDP collective, shared by every group on `pg` while any
// holds it. Creating one is collective over `pg`; every rank shards the same modules in the same
// order, so every rank finds or creates the same duplicates.
ProcessGroupPtr dedicated_group(const ProcessGroupPtr& pg, const std::string& role);
// reshard_after_forward = n: the sub-group of `pg` holding this rank, its ranks split into
// consecutive runs of n (PyTorch's post-forward mesh, the ranks viewed as (-1, n)), shared like
// dedicated_group's duplicates. Collective over `pg`.
ProcessGroupPtr post_forward_group(const ProcessGroupPtr& pg, int64_t n);

}  // namespace tessera::detail
