#pragma once
// What the parameter groups under one root share (internal to fsdp/): the order their forwards
// ran, which prefetch follows, and the order their backward collectives go out in.
//
// Every rank must issue the same collectives in the same order on each communicator, even when
// a group's backward runs on some ranks and not on others (its output unused in that rank's
// loss). So the backward all-gathers and the reduce-scatters each follow one fixed order, the
// reverse of the forward order, on a communicator of their own: a group whose turn comes before
// it is ready holds the later ones back (gathers are issued ahead for it; reduce-scatters wait),
// and at the end of backward every group still owing a collective issues it.
//
// A rank never blocks on a reduce-scatter while backward runs: before issuing one it retires
// those issued before it that have completed, and waits for the rest only at the end of backward,
// once the autograd engine has run every node of this rank's graph. Blocking earlier could
// deadlock whenever ranks disagree on which groups got gradients: a group that got none on one
// rank is reduce-scattered there only at the end of backward, and that rank may meanwhile wait
// for an all-gather (or a collective of the application's backward) that the blocked rank has not
// reached. Which parameters got a gradient on any rank travels inside the reduce-scatter (one
// flag per parameter, summed), so the ranks agree on it without another collective; so does
// whether a rank wrote a group's shards between its forward and its backward, which every rank
// then refuses at the end of backward, none earlier (the others would wait for its collectives).
// Neither the result nor termination depends on timing; only memory does: the packed gradients of
// reduce-scatters still in flight (the progress thread moves them meanwhile, and every later
// hook retires those that completed).
#include <deque>
#include <memory>
#include <vector>

#include "fsdp_group.h"

namespace tessera::detail {

struct FSDPSchedule : std::enable_shared_from_this<FSDPSchedule> {
  using Group = std::shared_ptr<FSDPGroup>;

  // Each group once, in the order its forward started in this step, and in the previous step.
  std::vector<std::weak_ptr<FSDPGroup>> order, last_order;
  // The groups whose backward is expected, in reverse forward order; the next to all-gather for
  // backward and the next to reduce-scatter.
  std::vector<std::weak_ptr<FSDPGroup>> backward_order;
  size_t next_gather = 0, next_reduce = 0;
  // The all-gathers this step's forward prefetched (issued by another group's forward, before
  // the group's own; under another root too): see drop_unused_prefetches.
  struct Prefetch {
    std::weak_ptr<FSDPGroup> group;
    uint64_t gather = 0;  // PendingGather::id
  };
  std::vector<Prefetch> forward_prefetched;
  // The groups that kept gradient sums of a backward for a later one (set_requires_gradient_sync
  // or, for HSDP, set_requires_all_reduce off), in the order they kept them, the same on every
  // rank: the backward that reduces those sums takes each in its order, also one whose forward
  // did not run in its step (a block skipped, a task head the last micro-batch did not use), or
  // they would miss the step they belong to and be added to a later one's.
  std::vector<std::weak_ptr<FSDPGroup>> holding_sums;
  // Issued reduce-scatters, oldest first; retired in this order.
  std::deque<std::weak_ptr<FSDPGroup>> in_flight;
  bool backward_running = false;
  uint64_t backward_id = 0;  // of the pass that queued finalize()

  // From each group's pre-forward; the root's starts a new step.
  void record_forward(const Group& group);
  // At the end of backward, and when the root's next forward starts (a step without backward):
  // an all-gather this step prefetched that the group's forward did not use (a block skipped, a
  // tower of another root that did not run) is dropped: it holds the shards as they were, and
  // the group's next forward, after an optimizer step or a load, must gather them anew. Not at
  // the end of the root's forward: modules under the root may run after it (heads applied to
  // its output). Whatever else is in flight (the user's unshard(async_op), another root's
  // prefetch) is left alone.
  void drop_unused_prefetches();
  // The group after `g` in the previous step's forward order, and the one after it in this
  // step's backward order; null when none.
  Group next_in_forward(const FSDPGroup* g) const;
  Group next_in_backward(const FSDPGroup* g) const;
  void hold_sums(const Group& group);
  // The first backward hook of any group: fixes the backward order and queues finalize().
  void begin_backward(const Group& caller);
  // Sums kept for a later all-reduce (set_requires_all_reduce(false)) were packed for the
  // parameters trainable then: a change since is refused here, before this backward issues any
  // collective, so every rank (requires_grad is the same on all) throws at the same point, with
  // backward_running set: the next forward or backward runs abandon(), which drops the sums.
  void refuse_unfit_partial_reduces() const;
  // Issues the backward all-gathers of every group up to and including `g` in backward order.
  void gather_through(const FSDPGroup* g);
  // Issues the reduce-scatters of the ready groups at the front of the backward order, and
  // retires those that completed.
  void issue_ready_reduces();
  // Retires issued reduce-scatters in issue order: those that completed, or (block) all.
  void retire(bool block);
  // End of backward: the groups left reduce (with zeros where no gradient came), the
  // collectives are waited for, and every group is resharded; then a write to shards between
  // forward and backward, on any rank, is refused.
  void finalize();
  // Throws, on every rank alike, for the groups whose reduce said a rank wrote their shards
  // between forward and backward; the sums kept for later backwards go (they hold this one's).
  void refuse_written_shards(const std::vector<Group>& written);
  // Drops the gradient sums kept for a later backward (unsynced, or waiting for the all-reduce
  // across replicas) by every group it knows.
  void drop_kept_sums();
  // A backward that threw never ran finalize(): wait for what it left in flight, discard it
  // and reshard, so that the next backward starts clean.
  void abandon();
};

}  // namespace tessera::detail
