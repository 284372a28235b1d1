#include "schedule.h"

#include "tessera/autograd/engine.h"

namespace tessera::detail {

namespace {

using Groups = std::vector<std::weak_ptr<FSDPGroup>>;

ptrdiff_t index_of(const Groups& groups, const FSDPGroup* g) {
  for (size_t i = 0; i < groups.size(); ++i)
    if (groups[i].lock().get() == g) return ptrdiff_t(i);
  return -1;
}

template <class F>
void for_each_live(const Groups& groups, F&& f) {
  for (const auto& w : groups)
    if (auto s = w.lock()) f(s);
}

}  // namespace

void FSDPSchedule::record_forward(const Group& group) {
  if (group->is_root_ && group->starts_step_) {
    if (backward_running) abandon();
    drop_unused_prefetches();
    if (!order.empty()) last_order = std::move(order);
    order.clear();
    // Other all-gathers still in flight are the user's unshard(async_op) of this step, or another
    // root's prefetches of its step (the prefetches of the last step that its forward did not
    // use are dropped above; its backward left none): the groups' forwards use them, as
    // PyTorch's forward uses the gather behind an UnshardHandle.
  }
  if (index_of(order, group.get()) < 0) order.push_back(group);
}

void FSDPSchedule::drop_unused_prefetches() {
  for (const Prefetch& p : forward_prefetched) {
    auto s = p.group.lock();
    // Used, it is gone; a group's later gathers (its backward's, the user's) have other ids.
    if (s && s->pending_gather_ && s->pending_gather_->id == p.gather) s->drop_pending_gather();
  }
  forward_prefetched.clear();
}

FSDPSchedule::Group FSDPSchedule::next_in_forward(const FSDPGroup* g) const {
  const ptrdiff_t i = index_of(last_order, g);
  if (i < 0 || size_t(i + 1) >= last_order.size()) return nullptr;
  return last_order[size_t(i + 1)].lock();
}

FSDPSchedule::Group FSDPSchedule::next_in_backward(const FSDPGroup* g) const {
  const ptrdiff_t i = index_of(backward_order, g);
  if (i < 0 || size_t(i + 1) >= backward_order.size()) return nullptr;
  return backward_order[size_t(i + 1)].lock();
}

void FSDPSchedule::hold_sums(const Group& group) {
  if (index_of(holding_sums, group.get()) < 0) holding_sums.push_back(group);
}

void FSDPSchedule::begin_backward(const Group& caller) {
  if (backward_running && backward_id == autograd::backward_id()) return;
  if (backward_running) abandon();
  backward_running = true;
  backward_id = autograd::backward_id();
  backward_order.clear();
  next_gather = next_reduce = 0;
  for (auto it = order.rbegin(); it != order.rend(); ++it)
    if (auto s = it->lock(); s && s->backward_pending_) backward_order.push_back(s);
  if (index_of(backward_order, caller.get()) < 0 && caller->backward_pending_)
    backward_order.push_back(caller);
  // After the groups that ran: reduced at the end of backward (no gradient of this backward can
  // come to them), on every rank alike.
  std::erase_if(holding_sums, [&](const std::weak_ptr<FSDPGroup>& w) {
    auto s = w.lock();
    if (!s) return true;
    if (!s->reduces_waiting_sums()) return !s->unsynced_sums_ && !s->partial_reduce_;
    if (index_of(backward_order, s.get()) < 0) backward_order.push_back(s);
    return true;  // listed again if it keeps this backward's sums for a later one
  });
  refuse_unfit_partial_reduces();
  for_each_live(backward_order, [](const Group& s) { s->mark_grads_pending(true); });
  std::weak_ptr<FSDPSchedule> weak = weak_from_this();
  autograd::queue_callback([weak] {
    if (auto s = weak.lock()) s->finalize();
  });
}

void FSDPSchedule::refuse_unfit_partial_reduces() const {
  for (const auto& w : backward_order) {
    auto s = w.lock();
    if (!s || s->partial_reduce_fits()) continue;
    TESSERA_FAIL(s->label(),
                 ": which parameters require gradients changed while earlier micro-batches' "
                 "gradients waited for their all-reduce across replicas "
                 "(set_requires_all_reduce(false)); the waiting sums of this step's groups are "
                 "dropped. Change it only after a backward that all-reduces");
  }
}

void FSDPSchedule::gather_through(const FSDPGroup* g) {
  const ptrdiff_t last = index_of(backward_order, g);
  for (ptrdiff_t i = ptrdiff_t(next_gather); i <= last; ++i)
    if (auto s = backward_order[size_t(i)].lock(); s && s->needs_backward_gather())
      s->start_gather();
  if (last >= ptrdiff_t(next_gather)) next_gather = size_t(last + 1);
}

void FSDPSchedule::issue_ready_reduces() {
  while (next_reduce < backward_order.size()) {
    Group s = backward_order[next_reduce].lock();
    if (s && !s->grads_ready_for_reduce_) break;
    ++next_reduce;
    if (!s) continue;
    retire(/*block=*/false);  // see schedule.h: never wait while backward runs
    s->start_reduce();
    if (s->pending_reduce_) in_flight.push_back(s);
  }
  retire(/*block=*/false);
}

void FSDPSchedule::retire(bool block) {
  while (!in_flight.empty()) {
    Group s = in_flight.front().lock();
    if (s && !s->advance_reduce(block)) return;
    in_flight.pop_front();
  }
}

void FSDPSchedule::finalize() {
  // Groups whose backward did not run here still take part in the collectives of this
  // backward: their all-gather (then dropped) and their reduce-scatter, with zeros where no
  // gradient came.
  if (!backward_order.empty()) gather_through(backward_order.back().lock().get());
  for (size_t i = next_reduce; i < backward_order.size(); ++i)
    if (auto s = backward_order[i].lock()) s->grads_ready_for_reduce_ = true;
  issue_ready_reduces();
  // This rank's backward is over, and every other rank issues these reduce-scatters by the end
  // of its own.
  retire(/*block=*/true);
  drop_unused_prefetches();
  std::vector<Group> written;
  for_each_live(backward_order, [&](const Group& s) {
    if (s->ranks_that_wrote_ > 0) written.push_back(s);
  });
  auto settle = [](const Group& s) {
    s->drop_pending_gather();
    s->backward_pending_ = false;
    s->grads_ready_for_reduce_ = false;
    s->clear_grads_in();
    s->mark_grads_pending(false);
    // Kept gathered (set_reshard_after_backward(false)): finish_backward freed what it read.
    if (s->reshard_after_backward_ || !s->unsharded_) s->reshard();
  };
  for_each_live(order, settle);
  for_each_live(backward_order, settle);
  backward_order.clear();
  next_gather = next_reduce = 0;
  backward_running = false;
  if (!written.empty()) refuse_written_shards(written);
}

void FSDPSchedule::refuse_written_shards(const std::vector<Group>& written) {
  const Group& s = written.front();
  const int64_t others = s->ranks_that_wrote_ - (s->wrote_here_ ? 1 : 0);
  std::string where = s->wrote_here_ ? "on this rank" : "";
  if (s->writing_rank_ >= 0 && !s->wrote_here_)
    where = "on rank " + std::to_string(s->writing_rank_) + " (not this one)";
  else if (others > 0)
    where += (s->wrote_here_ ? " and on " : "on ") + std::to_string(others) + " other rank(s)";
  for (const Group& g : written) {
    g->ranks_that_wrote_ = 0;
    g->wrote_here_ = false;
  }
  drop_kept_sums();
  std::string names;
  for (const auto& i : s->params_)
    names += (names.empty() ? "" : ", ") + i.name;
  TESSERA_FAIL(s->label(), ": its parameters (", names,
               ") were modified by an in-place operation (an optimizer step, a load) between a "
               "forward and its backward, ",
               where,
               "; this backward's gradients do not fit the values now stored (zero them), and "
               "the sums kept for later backwards were dropped. Run backward before changing "
               "the parameters");
}

void FSDPSchedule::drop_kept_sums() {
  auto drop = [](const Group& s) {
    // The flag of a write on this rank that the sums held goes with them: a later write must
    // flag the next reduce anew.
    if (s->partial_reduce_) s->wrote_here_ = false;
    s->partial_reduce_.reset();
    for (auto& i : s->params_)
      i.accum_grad = Tensor();
    s->unsynced_sums_ = false;
  };
  for_each_live(order, drop);
  for_each_live(backward_order, drop);
  for_each_live(holding_sums, drop);
  holding_sums.clear();
}

void FSDPSchedule::abandon() {
  auto drop = [](const Group& s) {
    s->drop_pending_gather();
    if (s->pending_reduce_) {
      if (s->pending_reduce_->work) s->pending_reduce_->work->wait();
      s->pending_reduce_.reset();
    }
    s->shards_written_ = s->wrote_here_ = false;
    s->ranks_that_wrote_ = 0;
    s->backward_pending_ = false;
    s->grads_ready_for_reduce_ = false;
    s->clear_grads_in();
    s->mark_grads_pending(false);
    s->free_leaves_after_backward();
    s->reshard();
  };
  for_each_live(order, drop);
  for_each_live(backward_order, drop);
  // Sums kept for a later all-reduce (set_requires_all_reduce(false)) go too: some groups' were
  // already merged into the reduces just dropped, and the next backward must not add the others'
  // to gradients of another step. So do the sums of micro-batches accumulated without sync: the
  // groups whose backward ended before the throw hold part of the failed micro-batch, the others
  // none of it; dropped whole, no group keeps a share of it. Also those of groups this backward
  // had not reached (its forward skipped them).
  drop_kept_sums();
  in_flight.clear();
  backward_order.clear();
  next_gather = next_reduce = 0;
  backward_running = false;
}

}  // namespace tessera::detail
