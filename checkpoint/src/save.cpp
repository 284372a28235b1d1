#include "save.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "checksum.h"
#include "context.h"
#include "durable.h"
#include "fault.h"
#include "file_format.h"
#include "h5/h5.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/comm/agree.h"
#include "tessera/core/factory.h"
#include "watchdog.h"

namespace tessera::ckpt {

namespace {

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

// Where each tensor entry's checksum words lie in the table.
void lay_out_table(SaveJob& job) {
  job.first.assign(job.entries.size(), 0);
  job.words.assign(job.entries.size(), 0);
  int64_t total = 0;
  for (size_t i = 0; i < job.entries.size(); ++i) {
    const Entry& e = job.entries[i];
    if (e.kind != ValueKind::Tensor) continue;
    job.first[i] = total;
    job.words[i] =
        checksum_words(shape_numel(e.global_shape) * int64_t(element_size(e.dtype)), kTileBytes);
    total += job.words[i];
  }
  job.replica_sums.assign(size_t(total), 0);
}

// A window this rank holds and another rank writes (a replica): its checksums, for finish_save
// to compare with the writer's, since the file keeps one copy for all the ranks that hold it.
void add_replica_sums(SaveJob& job, size_t i, const Tensor& local) {
  const Entry& e = job.entries[i];
  const Tensor host = local.device().is_cpu() ? local.contiguous() : local.to(Device::cpu());
  add_block_checksums(host.contiguous().raw_data(), element_size(e.dtype), e.global_shape,
                      e.window.offset, e.window.shape, kTileBytes,
                      job.replica_sums.data() + job.first[i]);
}

// Replicas that differ are refused: one of them would be saved as every rank's value (a per-rank
// RNG state stored as a plain tensor would come back as one rank's on all of them). Every rank
// sees the same mismatches and throws the same error.
void check_replicas(const SaveJob& job, const GatheredSums& g) {
  if (g.mismatches.empty()) return;
  std::vector<std::string> keys;
  for (size_t k = 0; k < g.mismatches.size(); ++k) {
    const ReplicaMismatch& m = g.mismatches[k];
    const bool first_of_key = k == 0 || g.mismatches[k - 1].entry != m.entry;
    if (first_of_key) keys.push_back("'" + job.entries[m.entry].key + "' (");
    keys.back() += std::string(first_of_key ? "" : ", ") + "rank " + std::to_string(m.rank) +
                   " differs from rank " + std::to_string(m.owner);
  }
  std::string list;
  for (size_t k = 0; k < keys.size() && k < 8; ++k)
    list += (k ? "), " : "") + keys[k];
  list += ")";
  if (keys.size() > 8) list += ", and " + std::to_string(keys.size() - 8) + " more";
  throw Error("checkpoint save to '" + job.path + "': replicas differ: " + list +
              ". A plain tensor is one value for all ranks, as is each block of a Replicate "
              "placement, and the file keeps one copy; save per-rank state (an RNG state, a data "
              "position) as a DTensor with Shard(0) over the world, of shape [world_size, ...]. "
              "Nothing was saved, the previous checkpoint is kept");
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
  // Flushing is a collective step: one decision for all ranks, a flush when any rank asks for
  // one (a rank that flushed alone would wait inside it for the others).
  Tensor fsync = full({1}, options.fsync ? 1.0 : 0.0, DType::Int64);
  pg->all_reduce(fsync, ReduceOp::Max)->wait();
  job.options.fsync = fsync.item<int64_t>() != 0;
  lay_out_table(job);
  NoGradGuard no_grad;
  // First what every rank does together (reducing Partial values), then each rank's own copies,
  // which can fail on one rank alone (out of memory while staging a large state): agreed, so
  // that the others learn of it instead of waiting for that rank in the next step.
  std::vector<Tensor> locals(job.entries.size());
  for (size_t i = 0; i < job.entries.size(); ++i) {
    const Entry& e = job.entries[i];
    if (e.kind != ValueKind::Tensor) continue;
    const StateValue& v = state.at(e.key);
    if (const auto* d = std::get_if<DTensor>(&v)) {
      DTensor dt = d->detach();
      if (dt.spec().has_partial()) {
        // The value is the reduction of the ranks' terms; ranks then hold it as replicas.
        Placements p = dt.placements();
        for (Placement& x : p)
          if (x.is_partial()) x = Replicate();
        dt = dt.redistribute(p);
      }
      locals[i] = dt.to_local();
    } else {
      locals[i] = std::get<Tensor>(v).detach();
    }
  }
  job.blocks.resize(job.entries.size());
  run_agreed(pg, ctx, [&] {
    fault_point("staging the values");
    for (size_t i = 0; i < job.entries.size(); ++i) {
      const Entry& e = job.entries[i];
      if (e.kind != ValueKind::Tensor || shape_numel(e.window.shape) == 0) continue;
      const Tensor& local = locals[i];
      if (!e.owner) {
        add_replica_sums(job, i, local);
        continue;
      }
      // HDF5 reads host memory: a device piece is copied to the host, which stages it as well.
      if (!local.device().is_cpu())
        job.blocks[i] = local.to(Device::cpu());
      else
        job.blocks[i] = stage ? local.clone() : local.contiguous();
    }
  });
  return job;
}

void SaveFile::abandon(const ProcessGroupPtr& pg) {
  datasets.clear();
  file = h5::Id();
  if (pg->rank() == 0 && !tmp.empty()) std::remove(tmp.c_str());
}

void create_save_file(const SaveJob& job, SaveFile& f, Steps& steps, MPI_Comm comm) {
  f.tmp = temp_path(job.path);
  f.datasets.resize(job.entries.size());
  f.sums = job.replica_sums;  // the words of the blocks this rank writes are added to them
  steps.run("creating", [&] {
    f.file = h5::create_file(f.tmp, comm);
    h5::write_attr(f.file, kAttrFormatVersion, kCheckpointFormatVersion);
    h5::write_attr(f.file, kAttrWorldSize, job.world_size);
    h5::write_attr(f.file, kAttrWriter, std::string("tessera"));
  });
  steps.run("creating datasets", [&] {
    for (size_t i = 0; i < job.entries.size(); ++i) {
      const Entry& e = job.entries[i];
      if (e.kind != ValueKind::Tensor) {
        write_scalar(f.file, e);
        continue;
      }
      h5::Id& ds = f.datasets[i];
      ds = h5::create_dataset(f.file, dataset_path(e.key), e.dtype, e.global_shape);
      h5::write_attr(ds, kAttrDtype, std::string(dtype_name(e.dtype)));
      if (!e.mesh.empty()) {
        h5::write_attr(ds, kAttrMesh, e.mesh);
        h5::write_attr(ds, kAttrPlacements, e.placements);
      }
      h5::write_attr(ds, kAttrFirst, job.first[i]);
      h5::write_attr(ds, kAttrTile, kTileBytes);
    }
  });
}

void write_blocks(const SaveJob& job, SaveFile& f, Steps* steps) {
  for (size_t i = 0; i < job.entries.size(); ++i) {
    const Entry& e = job.entries[i];
    if (e.kind != ValueKind::Tensor || shape_numel(e.global_shape) == 0) continue;
    const Tensor& b = job.blocks[i];
    auto write = [&, transfer = steps ? h5::Transfer::Collective : h5::Transfer::Independent] {
      if (!b.defined() && transfer == h5::Transfer::Independent) return;
      if (b.defined())
        add_block_checksums(b.raw_data(), element_size(e.dtype), e.global_shape, e.window.offset,
                            e.window.shape, kTileBytes, f.sums.data() + job.first[i]);
      h5::write_block(f.datasets[i], e.dtype, e.window.offset, e.window.shape,
                      b.defined() ? b.raw_data() : nullptr, b.defined(), transfer, e.key);
    };
    const std::string name = "writing '" + e.key + "'";
    if (steps) {
      steps->run(name, write);
    } else {
      fault_point(name);
      write();
    }
  }
}

void finish_save(const SaveJob& job, SaveFile& f, const ProcessGroupPtr& pg, Steps& steps) {
  // Each element was written, and added up, by exactly one rank; its replicas added up theirs.
  const GatheredSums gathered = gather_sums(pg, job.entries, job.first, job.words, f.sums);
  check_replicas(job, gathered);
  const std::vector<uint64_t>& table = gathered.total;
  const auto words = int64_t(table.size());
  steps.run("writing the checksum table", [&] {
    // An MPI-IO file closes only once nothing in it is open.
    for (size_t i = 0; i < f.datasets.size(); ++i)
      f.datasets[i].close("closing dataset '" + job.entries[i].key + "'");
    h5::Id t = h5::create_u64_dataset(f.file, kTableDataset, words);
    h5::write_u64(t, table, pg->rank() == 0);
    t.close("closing the checksum table");
    h5::write_attr_u64(f.file, kAttrTable, table_checksum(table));
    // Last: a file without it was never finished.
    h5::write_attr(f.file, kAttrComplete, int64_t(1));
  });
  if (job.options.fsync)
    steps.run("flushing", [&] { h5::flush_file(f.file, "flushing '" + f.tmp + "'"); });
  steps.run("closing", [&] { f.file.close("closing '" + f.tmp + "'"); });
  // Commit: one rename, atomic on a POSIX file system; the old checkpoint (if any) stays whole
  // until this instant and the new one is whole from it.
  steps.run("renaming", [&] {
    if (pg->rank() != 0) return;
    TESSERA_CHECK(std::rename(f.tmp.c_str(), job.path.c_str()) == 0, "renaming '", f.tmp, "' to '",
                  job.path, "': ", std::strerror(errno));
    if (job.options.fsync) fsync_path(parent_dir(job.path), /*directory=*/true);
  });
}

}  // namespace tessera::ckpt

namespace tessera {

void save(const StateDict& state, const std::string& path, const SaveOptions& options) {
  ckpt::wait_for_pending_save();
  const ckpt::Context& c = ckpt::context();
  ckpt::SaveJob job = ckpt::prepare_save(state, path, options, c.group, /*stage=*/false);
  auto session = ckpt::h5::h5_session();
  ckpt::Steps steps(c.group, "checkpoint save to '" + path + "'");
  ckpt::SaveFile f;
  try {
    ckpt::create_save_file(job, f, steps, c.file_comm);
    ckpt::write_blocks(job, f, &steps);
    ckpt::finish_save(job, f, c.group, steps);
  } catch (...) {
    // Every rank is here, after the same agreed step.
    f.abandon(c.group);
    throw;
  }
}

}  // namespace tessera
