#pragma once
// One parameter group (internal to fsdp/): the parameters of one fully_shard call that share a
// dtype, stored as views of one flat per-rank buffer, with what its hooks need to gather them
// before forward and backward and to reduce-scatter their gradients. A call makes one group per
// dtype; the public FSDPState holds them.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/autograd/node.h"
#include "tessera/comm/process_group.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/nn/module.h"

namespace tessera::detail {

struct FSDPSchedule;

class FSDPGroup : public std::enable_shared_from_this<FSDPGroup> {
 public:
  struct ParamInfo {
    Parameter* param = nullptr;
    // Other slots of the module that held the same tensor when it was sharded (weights tied by
    // assignment, `head->weight = emb->weight`): they follow `param` through every change
    // (sync_aliases), so the tie holds, as FSDP2 keeps a parameter shared by two modules one.
    std::vector<Parameter*> aliases;
    std::string name;
    Shape unsharded_shape;  // the global shape, or for FSDP x TP the TP-local shape
    int64_t rows = 0;       // unsharded_shape[0]
    int64_t row_numel = 1;
    int64_t chunk_rows = 0;  // ceil(rows / shard size): every rank's padded piece
    int64_t offset = 0;      // of this parameter's padded piece in the per-rank flat buffer
    int64_t base = 0;        // of the unsharded parameter in the gathered buffer
    // FSDP x TP: the TP DTensor's mesh, placements and global shape.
    std::optional<DeviceMesh> tp_mesh;
    Placements tp_placements;
    Shape tp_global_shape;
    Tensor leaf;           // the gathered leaf forward and backward use
    Tensor accum_grad;     // unsynced gradient sum (unsharded)
    bool grad_in = false;  // this backward has accumulated the leaf's gradient
    // The storage the parameter had before it was sharded: a slot that a later fully_shard call
    // finds still holding it is tied to this parameter.
    std::weak_ptr<StorageImpl> original;
  };

  // Copies each parameter to its aliases (after it was sharded, unsharded or resharded).
  static void sync_aliases(ParamInfo& i) {
    for (Parameter* a : i.aliases)
      *a = *i.param;
  }

  FSDPGroup() = default;
  // Leaves the registry of live groups (registry.h).
  ~FSDPGroup();
  FSDPGroup(const FSDPGroup&) = delete;
  FSDPGroup& operator=(const FSDPGroup&) = delete;

  // What fully_shard's module hooks and autograd hooks call.
  // "fully_shard(Decoder)": how errors name the group.
  std::string label() const;

  Tensor pre_forward(const Tensor& x);
  Tensor post_forward(const Tensor& y);
  void pre_backward();
  void on_grad_ready(size_t param);
  void on_input_grad();

  // async_op only issues the all-gather; the next unshard() or forward finishes it.
  void unshard(bool async_op = false);
  void reshard();
  // The user's reshard() (FSDPState::reshard): reshard(), and the piece kept since forward under
  // reshard_after_forward = N freed too, as PyTorch's reshard() takes a group from its
  // post-forward state to the sharded one; the backward then gathers over the whole shard group.
  void reshard_fully();
  void set_unsharded_params();
  void drop_leaves();
  void free_leaves_after_backward();
  // After this group's backward: its gathered weights and unsharded gradients freed and the
  // parameters back on their shards, or with set_reshard_after_backward(false) only the
  // gradients freed: the next forward finds the weights gathered.
  void finish_backward();
  // Issues the all-gather of the stored shards (no-op when one is in flight).
  void start_gather();
  // Finishes it into fresh leaves, or into the existing ones whose storage reshard() released.
  void finish_gather(bool fresh);
  void drop_pending_gather();
  // A gather that another root's forward prefetched lives until that root's next forward or
  // the end of its backward; an evaluation under no_grad has no backward, so this group's own
  // root may run next, after an optimizer step or a load. Before it is used, the ranks agree
  // (a 4-byte all-reduce on the gather group, once per such prefetch) whether any wrote the
  // shards since it was issued, and if so it is dropped, to be gathered anew.
  void drop_stale_prefetch();
  // Frees the gathered buffer's bytes while its leaves stay referenced (by the autograd graph).
  void release_unsharded();
  // reshard_after_forward as this group takes it: an int 1 is false and the shard group size
  // true (PyTorch); a value <= 0 or one that does not divide the shard group size is refused
  // with an error naming it, the size and the module. The same on every rank.
  ReshardAfterForward resolve_reshard_after_forward(const ReshardAfterForward& r) const;
  // Takes a resolved value; the int form creates its sub-group (collective over the shard group).
  void apply_reshard_after_forward(const ReshardAfterForward& r);
  // After a forward with a backward to come, under the int form: copies this rank's piece for
  // its sub-group out of the gathered buffer, which reshard() then frees.
  void keep_post_forward_piece();
  void prefetch(bool forward);
  bool needs_backward_gather() const;
  // Whether every trainable leaf's gradient is in, or, once this group's backward began (its
  // backward gather issued, in the order every rank issues them), can no longer come because no
  // live graph refers to the leaf (a parameter this forward did not use: an inactive LoRA slot,
  // a branch not taken). Waiting for those would hold the group, and every group after it in
  // backward order, gathered until the end of backward. Before its backward began, the group
  // must not reduce early: the end of backward still issues its gather on this rank.
  bool all_grads_in() const;
  void clear_grads_in();
  // Collective over the gather group: whether any rank's shards changed since the leaves were
  // gathered.
  bool shards_written_since_gather() const;
  // Collective over the gather group: whether `here` holds on any rank.
  bool on_any_rank(bool here) const;
  // Packs this backward's gradients and issues their reduce-scatter. advance_reduce moves it on
  // (reduce-scatter, then for HSDP the all-reduce across replicas, then the averaged shards into
  // the stored parameters' gradients), waiting for each step when `block`, else only testing
  // it; false when it is still in flight.
  void start_reduce();
  // Without gradient sync: adds this backward's gradients to the unsynced sums (accum_grad).
  void accumulate_unsynced(DType reduce_dtype);
  // For a group that did not run in this step: issues the all-reduce across replicas of the sums
  // kept for it, when those are all it has to reduce; false when it must reduce-scatter.
  bool all_reduce_kept_sums();
  // Before a reduce: a backward all-gather this rank owes or still has in flight for this group
  // is issued or finished (see the .cpp).
  void settle_backward_gather();
  // A pending backward whose graphs were all dropped is over: the next forward starts afresh.
  void forget_dropped_forward();
  bool advance_reduce(bool block);
  // HSDP, once the reduce-scatter is done: adds the sums kept from earlier backwards; then true
  // when the all-reduce across replicas is to follow, false when these sums are kept instead
  // (set_requires_all_reduce(false)) and the reduce is over.
  bool merge_partial_reduce();
  // Where each parameter's padded piece lies in a rank's reduce block for the parameters that
  // require gradients now (-1 for frozen ones), and their total.
  std::vector<int64_t> reduce_offsets(int64_t& size) const;
  // Whether sums kept for a later all-reduce were packed for the parameters trainable now.
  bool partial_reduce_fits() const;
  // Whether its backward all-gathers (resharded after forward): the same on every rank.
  bool gathers_for_backward() const;
  // Whether this group holds sums of earlier micro-batches (unsynced, or kept for a later
  // all-reduce across replicas) that a backward starting now, with its settings, would reduce:
  // such a backward reduces the group even if its forward did not run in the step.
  bool reduces_waiting_sums() const;
  // New leaves over gathered_ (no communication), when kept ones no longer match which
  // parameters require gradients.
  void refresh_leaves();
  void make_leaves();
  void mark_grads_pending(bool pending);
  void begin_backward();

  // Both in flight between issue and use.
  struct PendingGather {
    uint64_t id = 0;  // this group's count of gathers started: which one a prefetch issued
    WorkPtr work;
    Tensor send, target;
    bool reuse = false;  // target is the released buffer the saved leaves view
    // reuse: the buffer's version before the gather. The gather refills what the graph saved,
    // so it is no in-place change backward must refuse (some backends count it as one: a generic
    // all_gather_runs copies out, a staged group copies back). When the shards changed since the
    // forward's gather (an optimizer step in between) the refill brings other values: that is
    // refused at the end of backward, on every rank alike (shards_written_), not here by the
    // engine on the writing rank alone.
    uint32_t saved_version = 0;
    uint32_t shards_version = 0;  // flat_'s when the gather started
    // Prefetched by another root's forward: see drop_stale_prefetch.
    bool other_root = false;
    // From the piece kept after forward, over its sub-group (reshard_after_forward = N).
    bool from_post_forward = false;
    int64_t group_size = 0;  // the ranks it runs over
  };
  // After a gather into the released buffer: its version as before.
  void settle_refill_version(const PendingGather& g);
  struct PendingReduce {
    WorkPtr work;
    Tensor send, reduced;
    // Where each trainable parameter's padded piece lies in a rank's block (frozen ones: -1),
    // and the pieces' total, after which come the flags (one per parameter, then kWrittenSlots):
    // frozen parameters take no room, so a LoRA group reduces and keeps the adapters' gradients
    // only.
    std::vector<int64_t> offsets;
    int64_t size = 0;
    bool across_replicas = false;  // HSDP: `work` is the all-reduce that follows
  };
  // The send buffer of this backward's reduce-scatter: every rank's block of the trainable
  // parameters' gradients (with the unsynced sums), then the flags; the sums and shards_written_
  // are consumed.
  PendingReduce pack_gradients(DType reduce_dtype);
  // The flag slot of a reduce that completed (after the all-reduce across replicas, when one
  // follows): how many ranks wrote their shards between a forward and its backward.
  void read_written_flag(const PendingReduce& pr);

  std::weak_ptr<Module> module_;
  // The data-parallel groups, each duplicated for FSDP's own use: all-gathers, reduce-scatters
  // and (HSDP) the all-reduce across replicas each keep their own order (see schedule.h), and no
  // collective of the application on the mesh can come between them.
  ProcessGroupPtr gather_pg_;
  ProcessGroupPtr reduce_pg_;
  ProcessGroupPtr replicate_pg_;  // HSDP only
  ProcessGroupPtr shard_pg_;      // the mesh's, which the sub-groups of the int form split
  // reshard_after_forward = N: the sub-group of N ranks holding this rank, and where each of its
  // ranks' kept pieces land in the gathered buffer (a piece is the stored shards of S / N
  // consecutive ranks of the shard group, one after another, so the runs are theirs).
  struct PostForwardPlan {
    ProcessGroupPtr pg;
    std::vector<std::vector<GatherRun>> runs;
  };
  std::shared_ptr<const PostForwardPlan> post_forward_plan_;
  // The piece kept since forward, with the plan it was cut for (the option may change before
  // the backward that gathers it).
  struct PostForwardPiece {
    std::shared_ptr<const PostForwardPlan> plan;
    Tensor piece;
  };
  std::optional<PostForwardPiece> post_forward_piece_;
  FSDPOptions opts_;
  std::vector<ParamInfo> params_;
  Tensor flat_;
  int64_t padded_size_ = 0;  // per rank
  // The gathered parameters, one after another (the leaves are views of it), and where each
  // rank's pieces go in it.
  Tensor gathered_;
  uint32_t leaves_shards_version_ = 0;  // flat_'s version when the leaves' values were gathered
  // This rank's shards changed between the gather that made a step's leaves and the group's
  // backward (an optimizer step or a load in between): that backward differentiated at other
  // values than its forward. The writing rank alone knows it, and refusing there alone, in the
  // middle of backward, would leave the other ranks waiting for its collectives until the timeout
  // ends the job. So it travels in the slot after the flags of the next reduce-scatter, which
  // every rank issues anyway (and in the sums kept for a later all-reduce across replicas, until
  // that all-reduce), and every rank refuses at the end of the backward that completes it
  // (FSDPSchedule::finalize), once all its collectives are done.
  bool shards_written_ = false;
  bool wrote_here_ = false;       // this rank's flag in the reduce (or kept sums) carrying it
  int64_t ranks_that_wrote_ = 0;  // the flag's sum over the ranks, once that reduce completed
  int64_t writing_rank_ = -1;     // its world rank, when one rank wrote
  // The slots after the per-parameter flags: shards_written_, and the writing world rank + 1 in
  // base-256 digits, least significant first (a 16-bit reduce dtype holds integers exactly only
  // up to 256, bfloat16's case).
  static constexpr int64_t kRankDigits = 4;
  static constexpr int64_t kWrittenSlots = 1 + kRankDigits;
  int64_t unsharded_numel_ = 0;
  std::vector<std::vector<GatherRun>> gather_runs_;
  bool unsharded_ = false;
  bool is_root_ = true;
  // The first of one fully_shard call's groups (one per dtype): only its forward starts a root
  // step; the others run inside that step, in its order.
  bool starts_step_ = true;
  bool in_backward_ = false;  // pre_backward ran in this backward
  // set_reshard_after_forward was called: the option then holds for a root too.
  bool reshard_after_forward_set_ = false;
  std::optional<double> gradient_divide_factor_;  // default: the data-parallel size
  bool requires_gradient_sync_ = true;
  // HSDP, set_requires_all_reduce(false): each backward's reduce-scattered sums wait here (on
  // this rank's shard, not in the stored gradients) and join the next backward's before its
  // all-reduce across replicas, so micro-batches cost one all-reduce, as FSDP2's
  // partial_reduce_output.
  bool requires_all_reduce_ = true;
  bool reshard_after_backward_ = true;
  std::optional<PendingReduce> partial_reduce_;
  // Gradients of micro-batches run without sync wait in accum_grad (on some ranks only, where
  // they got any; this flag is the same on every rank).
  bool unsynced_sums_ = false;
  bool backward_pending_ = false;
  // The graph nodes of this step's outputs (where the pre-backward hook sits): when every one
  // is gone, no backward can come for them (a forward under grad mode whose result was dropped).
  std::vector<std::weak_ptr<autograd::Node>> pending_outputs_;
  bool leaves_released_ = false;  // resharded after forward: the graph holds empty storage
  bool grads_ready_for_reduce_ = false;
  // The forwards of this step whose input requires grad and whose input's gradient is not yet
  // computed: only then has this group's backward finished using its (frozen ones included)
  // gathered weights. More than one when the module runs more than once in a forward.
  int64_t input_grad_pending_ = 0;
  FSDPCommStats stats_;
  std::optional<PendingGather> pending_gather_;
  uint64_t gathers_started_ = 0;
  std::optional<PendingReduce> pending_reduce_;
  // Shared by every group under one root: forward order, prefetch, reduce-scatter order.
  std::shared_ptr<FSDPSchedule> schedule_;
  // Explicit prefetch targets (FSDPState::set_modules_to_*_prefetch); unset: the schedule's.
  std::optional<std::vector<std::weak_ptr<FSDPGroup>>> forward_prefetch_, backward_prefetch_;
};

}  // namespace tessera::detail
