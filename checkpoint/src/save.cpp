#include "save.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "agree.h"
#include "checksum.h"
#include "context.h"
#include "fault.h"
#include "file_format.h"
#include "h5/h5.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/core/factory.h"
#include "watchdog.h"

namespace tessera::ckpt {

namespace {

std::string parent_dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Before anything is written: the directory exists and is writable, and `path` is not a
// directory (a save replaces a file, never a directory).
void check_destination(const std::string& path) {
  const std::string dir = parent_dir(path);
  struct stat st {};
  TESSERA_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "the directory '", dir,
                "' does not exist");
  TESSERA_CHECK(::access(dir.c_str(), W_OK) == 0, "the directory '", dir,
                "' is not writable: ", std::strerror(errno));
  if (::stat(path.c_str(), &st) == 0)
    TESSERA_CHECK(S_ISREG(st.st_mode), "'", path, "' exists and is not a regular file");
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  TESSERA_CHECK(fd >= 0, "opening '", path, "' to flush it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TESSERA_CHECK(rc == 0, "fsync of '", path, "': ", std::strerror(err));
}

// Every tile's checksum: each rank adds up the blocks it writes, and the sums of all ranks are
// added (each element is written by exactly one rank). `first` receives each entry's first tile.
std::vector<uint64_t> checksum_table(const SaveJob& job, const ProcessGroupPtr& pg,
                                     std::vector<int64_t>& first) {
  int64_t total = 0;
  first.assign(job.entries.size(), 0);
  for (size_t i = 0; i < job.entries.size(); ++i) {
    const Entry& e = job.entries[i];
    if (e.kind != ValueKind::Tensor) continue;
    first[i] = total;
    total += tile_count(shape_numel(e.global_shape), tile_elements(element_size(e.dtype)));
  }
  Tensor mine = zeros({total}, DType::Int64);
  auto* sums = static_cast<uint64_t*>(mine.raw_data());
  for (size_t i = 0; i < job.entries.size(); ++i) {
    const Entry& e = job.entries[i];
    if (e.kind != ValueKind::Tensor || !job.blocks[i].defined()) continue;
    add_block_checksums(job.blocks[i].raw_data(), element_size(e.dtype), e.global_shape,
                        e.window.offset, e.window.shape, tile_elements(element_size(e.dtype)),
                        sums + first[i]);
  }
  Tensor all = empty({int64_t(pg->size()) * total}, DType::Int64);
  pg->all_gather_into_tensor(all, mine)->wait();
  std::vector<uint64_t> table(size_t(total), 0);
  const auto* a = static_cast<const uint64_t*>(all.raw_data());
  for (int r = 0; r < pg->size(); ++r)
    for (int64_t t = 0; t < total; ++t)
      table[size_t(t)] += a[size_t(r * total + t)];
  return table;
}

void write_scalar(const h5::Id& file, const Entry& e) {
  const std::string group = group_of(e.key);
  h5::Id g = h5::link_exists(file, group) || group == "/" ? h5::open_group(file, group)
                                                          : h5::create_group(file, group);
  const std::string name = attribute_of(e.key);
  if (const auto* i = std::get_if<int64_t>(&e.scalar))
    h5::write_attr(g, name, *i);
  else if (const auto* d = std::get_if<double>(&e.scalar))
    h5::write_attr(g, name, *d);
  else
    h5::write_attr(g, name, std::get<std::string>(e.scalar));
}

// The file under its temporary name: every step is the same collective HDF5 calls in the same
// order on every rank, and every rank learns after each step whether any failed.
void write_file(const SaveJob& job, const std::string& tmp, const std::vector<uint64_t>& table,
                const std::vector<int64_t>& first, const ProcessGroupPtr& pg, MPI_Comm comm,
                const std::string& ctx) {
  Steps steps(pg, ctx);
  h5::Id file;
  std::vector<h5::Id> datasets(job.entries.size());
  steps.run("creating", [&] {
    file = h5::create_file(tmp, comm);
    h5::write_attr(file, kAttrFormatVersion, kCheckpointFormatVersion);
    h5::write_attr(file, kAttrWorldSize, job.world_size);
    h5::write_attr(file, kAttrWriter, std::string("tessera"));
  });
  steps.run("creating datasets", [&] {
    for (size_t i = 0; i < job.entries.size(); ++i) {
      const Entry& e = job.entries[i];
      if (e.kind != ValueKind::Tensor) {
        write_scalar(file, e);
        continue;
      }
      datasets[i] = h5::create_dataset(file, dataset_path(e.key), e.dtype, e.global_shape);
      h5::write_attr(datasets[i], kAttrDtype, std::string(dtype_name(e.dtype)));
      if (!e.mesh.empty()) {
        h5::write_attr(datasets[i], kAttrMesh, e.mesh);
        h5::write_attr(datasets[i], kAttrPlacements, e.placements);
      }
      h5::write_attr(datasets[i], kAttrFirst, first[i]);
      h5::write_attr(datasets[i], kAttrTile, tile_elements(element_size(e.dtype)));
    }
  });
  for (size_t i = 0; i < job.entries.size(); ++i) {
    const Entry& e = job.entries[i];
    if (e.kind != ValueKind::Tensor || shape_numel(e.global_shape) == 0) continue;
    steps.run("writing '" + e.key + "'", [&] {
      const Tensor& b = job.blocks[i];
      h5::write_block(datasets[i], e.dtype, e.window.offset, e.window.shape,
                      b.defined() ? b.raw_data() : nullptr, b.defined(), h5::Transfer::Collective);
    });
  }
  steps.run("writing the checksum table", [&] {
    // An MPI-IO file closes only once nothing in it is open.
    for (size_t i = 0; i < datasets.size(); ++i)
      datasets[i].close("closing dataset '" + job.entries[i].key + "'");
    h5::Id t = h5::create_u64_dataset(file, kTableDataset, int64_t(table.size()));
    h5::write_u64(t, table, pg->rank() == 0);
    t.close("closing the checksum table");
    h5::write_attr_u64(file, kAttrTable, table_checksum(table));
    // Last: a file without it was never finished.
    h5::write_attr(file, kAttrComplete, int64_t(1));
  });
  if (job.options.fsync)
    steps.run("flushing", [&] { h5::flush_file(file, "flushing '" + tmp + "'"); });
  steps.run("closing", [&] { file.close("closing '" + tmp + "'"); });
}

}  // namespace

SaveJob prepare_save(const StateDict& state, const std::string& path, const SaveOptions& options,
                     const ProcessGroupPtr& pg, bool stage) {
  const std::string ctx = "checkpoint save to '" + path + "'";
  SaveJob job;
  job.path = path;
  job.options = options;
  job.world_size = pg->size();
  run_agreed(pg, ctx, [&] {
    job.entries = describe(state, "save to '" + path + "'", /*for_load=*/false);
    check_destination(path);
  });
  agree_on_entries(job.entries, pg, ctx);
  NoGradGuard no_grad;
  job.blocks.resize(job.entries.size());
  for (size_t i = 0; i < job.entries.size(); ++i) {
    const Entry& e = job.entries[i];
    if (e.kind != ValueKind::Tensor) continue;
    const StateValue& v = state.at(e.key);
    Tensor local;
    if (const auto* d = std::get_if<DTensor>(&v)) {
      DTensor dt = d->detach();
      if (dt.spec().has_partial()) {
        // The value is the reduction of the ranks' terms; ranks then hold it as replicas.
        Placements p = dt.placements();
        for (Placement& x : p)
          if (x.is_partial()) x = Replicate();
        dt = dt.redistribute(p);
      }
      local = dt.to_local();
    } else {
      local = std::get<Tensor>(v).detach();
    }
    if (!e.owner || shape_numel(e.window.shape) == 0) continue;
    job.blocks[i] = stage ? local.clone() : local.contiguous();
  }
  return job;
}

void write_checkpoint(const SaveJob& job, const ProcessGroupPtr& pg, MPI_Comm file_comm) {
  const std::string ctx = "checkpoint save to '" + job.path + "'";
  auto session = h5::h5_session();
  std::vector<int64_t> first;
  const std::vector<uint64_t> table = checksum_table(job, pg, first);
  const std::string tmp = temp_path(job.path);
  try {
    write_file(job, tmp, table, first, pg, file_comm, ctx);
  } catch (...) {
    // Every rank is here, after the same step, the file closed.
    if (pg->rank() == 0) std::remove(tmp.c_str());
    throw;
  }
  // Commit: one rename, atomic on a POSIX file system; the old checkpoint (if any) stays whole
  // until this instant and the new one is whole from it.
  std::string commit_error;
  if (pg->rank() == 0) {
    try {
      fault_point("renaming");
      TESSERA_CHECK(std::rename(tmp.c_str(), job.path.c_str()) == 0, "renaming '", tmp, "' to '",
                    job.path, "': ", std::strerror(errno));
      if (job.options.fsync) fsync_path(parent_dir(job.path), /*directory=*/true);
    } catch (...) {
      commit_error = current_error_text();
      std::remove(tmp.c_str());
    }
  }
  agree(pg, ctx, commit_error);
}

}  // namespace tessera::ckpt

namespace tessera {

void save(const StateDict& state, const std::string& path, const SaveOptions& options) {
  ckpt::wait_for_pending_save();
  const ckpt::Context& c = ckpt::context();
  ckpt::SaveJob job = ckpt::prepare_save(state, path, options, c.group, /*stage=*/false);
  ckpt::write_checkpoint(job, c.group, c.file_comm);
}

AsyncSave async_save(const StateDict& state, const std::string& path, const SaveOptions& options) {
  ckpt::wait_for_pending_save();
  const ckpt::Context& c = ckpt::context();
  auto job = std::make_shared<ckpt::SaveJob>(
      ckpt::prepare_save(state, path, options, c.group, /*stage=*/true));
  auto s = std::make_shared<AsyncSave::State>();
  s->path = path;
  AsyncSave::State* raw = s.get();
  s->thread = std::thread([job, raw, group = c.async_group, comm = c.file_comm] {
    try {
      ckpt::write_checkpoint(*job, group, comm);
    } catch (...) {
      raw->error = std::current_exception();
    }
  });
  ckpt::set_pending_save(s);
  return AsyncSave(s);
}

AsyncSave& AsyncSave::operator=(AsyncSave&& other) noexcept {
  if (this != &other) {
    if (state_) state_->join();
    state_ = std::move(other.state_);
  }
  return *this;
}

AsyncSave::~AsyncSave() {
  if (state_) state_->join();
}

void AsyncSave::wait() {
  TESSERA_CHECK(state_ != nullptr, "AsyncSave::wait on a handle that holds no save");
  if (!state_->join()) return;
  {
    std::lock_guard<std::mutex> g(state_->mutex);
    state_->error_reported = true;
  }
  std::rethrow_exception(state_->error);
}

}  // namespace tessera
