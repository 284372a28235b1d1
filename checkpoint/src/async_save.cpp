// async_save: the collective parts on the calling thread, the writing on a thread of its own.
#include "context.h"
#include "h5/h5.h"
#include "save.h"
#include "tessera/comm/agree.h"
#include "watchdog.h"

namespace tessera {

void AsyncSave::State::join_writer() {
  std::lock_guard<std::mutex> g(mutex);
  if (!joined && thread.joinable()) thread.join();
  joined = true;
}

void AsyncSave::State::finish() {
  join_writer();
  std::lock_guard<std::mutex> g(mutex);
  if (finished) return;
  finished = true;
  const ckpt::Context& c = ckpt::context();
  const std::string ctx = "checkpoint save to '" + path + "'";
  auto session = ckpt::h5::h5_session();
  try {
    ckpt::Steps steps(c.group, ctx);
    try {
      agree(c.group, ctx, writer_error);
      ckpt::finish_save(*job, *file, c.group, steps);
    } catch (...) {
      file->abandon(c.group);
      throw;
    }
  } catch (...) {
    error = std::current_exception();
  }
  job.reset();  // the staged snapshot
  file.reset();
}

AsyncSave::State::~State() {
  // Only a save that was never finished gets here with its thread running (the program ended
  // without its atexit handlers); the thread must not outlive what it writes from.
  if (thread.joinable()) thread.join();
}

AsyncSave async_save(const StateDict& state, const std::string& path, const SaveOptions& options) {
  ckpt::wait_for_pending_save();
  const ckpt::Context& c = ckpt::context();
  auto s = std::make_shared<AsyncSave::State>();
  s->path = path;
  s->job = std::make_shared<ckpt::SaveJob>(
      ckpt::prepare_save(state, path, options, c.group, /*stage=*/true));
  s->file = std::make_shared<ckpt::SaveFile>();
  {
    auto session = ckpt::h5::h5_session();
    ckpt::Steps steps(c.group, "checkpoint save to '" + path + "'");
    try {
      ckpt::create_save_file(*s->job, *s->file, steps, c.file_comm);
    } catch (...) {
      s->file->abandon(c.group);
      throw;
    }
  }
  AsyncSave::State* raw = s.get();
  s->thread = std::thread([raw] {
    try {
      auto session = ckpt::h5::h5_session();
      ckpt::write_blocks(*raw->job, *raw->file, nullptr);
    } catch (...) {
      raw->writer_error = current_error_text();
    }
  });
  ckpt::set_pending_save(s);
  return AsyncSave(s);
}

AsyncSave& AsyncSave::operator=(AsyncSave&& other) noexcept {
  if (this != &other) {
    if (state_) state_->finish();
    state_ = std::move(other.state_);
  }
  return *this;
}

AsyncSave::~AsyncSave() {
  if (state_) state_->finish();
}

void AsyncSave::wait() {
  TESSERA_CHECK(state_ != nullptr, "AsyncSave::wait on a handle that holds no save");
  state_->finish();
  std::lock_guard<std::mutex> g(state_->mutex);
  if (!state_->error) return;
  state_->error_reported = true;
  std::rethrow_exception(state_->error);
}

}  // namespace tessera
