#include "context.h"

#include "tessera/comm/mpi_interop.h"
#include "tessera/comm/runtime.h"

namespace tessera::ckpt {

namespace {

std::mutex& pending_mutex() {
  static std::mutex m;
  return m;
}
std::shared_ptr<AsyncSave::State>& pending() {
  static auto* p = new std::shared_ptr<AsyncSave::State>();
  return *p;
}

}  // namespace

const Context& context() {
  static const Context* c = [] {
    auto* ctx = new Context;
    ProcessGroupPtr world = world_group();
    ctx->group = world->split(0, world->rank(), "checkpoint");
    ctx->file_comm = duplicate_world_communicator();
    // A save still in flight when the runtime finalizes (a Runtime going out of scope, the
    // program ending) is finished first, on every rank, while MPI still works; if it failed and
    // nobody waited for it, the job ends with its error instead of exiting as if it were saved.
    detail::at_finalize([] { wait_for_pending_save(); });
    return ctx;
  }();
  return *c;
}

void wait_for_pending_save() {
  std::shared_ptr<AsyncSave::State> p;
  {
    std::lock_guard<std::mutex> g(pending_mutex());
    p = std::move(pending());
    pending().reset();
  }
  if (!p) return;
  p->finish();
  std::lock_guard<std::mutex> g(p->mutex);
  if (!p->error || p->error_reported) return;
  p->error_reported = true;
  try {
    std::rethrow_exception(p->error);
  } catch (const std::exception& e) {
    throw Error(std::string("an earlier async_save to '") + p->path +
                "' failed and nobody waited for it: " + e.what());
  }
}

void wait_for_pending_writer() {
  std::shared_ptr<AsyncSave::State> p;
  {
    std::lock_guard<std::mutex> g(pending_mutex());
    p = pending();
  }
  if (p) p->join_writer();
}

void set_pending_save(std::shared_ptr<AsyncSave::State> s) {
  std::lock_guard<std::mutex> g(pending_mutex());
  pending() = std::move(s);
}

}  // namespace tessera::ckpt
