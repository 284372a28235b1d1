// Damaged checkpoints and failing saves: flipped bytes in a dataset, a truncated file, a tampered
// checksum table, a missing dataset, an unknown version, an unfinished file, a damaged header —
// each a clear error naming what is wrong, never a crash or a wrong value, and the state dict
// left as it was. A save that fails on one rank fails on every rank and leaves the previous
// checkpoint in place; an asynchronous save snapshots its tensors and reports its failure.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "dist/checkpoint_util.h"
#include "fault.h"        // checkpoint/src: the hook the failure tests throw from
#include "mapped_file.h"  // checkpoint/src
#include "tessera/testing/expect_error.h"

using namespace tessera;
using namespace tessera::testing;
namespace fs = std::filesystem;

namespace {

const Shape kBig = {1024, 600};  // float32: 2.4 MB, three checksum tiles of 1 MiB

StateDict make_state(int salt) {
  DeviceMesh mesh(Shape{world_size()}, {"x"});
  return {
      {"model/big", distribute_tensor(index_tensor(kBig, DType::Float32, salt), mesh, {Shard(0)})},
      {"model/small",
       distribute_tensor(index_tensor({5, 3}, DType::BFloat16, salt), mesh, {Shard(1)})},
      {"extras/step", int64_t(salt)}};
}

// A state dict of zeros with the same keys, to load into.
StateDict zero_state() {
  DeviceMesh mesh(Shape{world_size()}, {"x"});
  return {{"model/big", distribute_tensor(zeros(kBig), mesh, {Replicate()})},
          {"model/small", distribute_tensor(zeros({5, 3}, DType::BFloat16), mesh, {Shard(0)})},
          {"extras/step", int64_t(0)}};
}

void expect_state(const StateDict& sd, int salt, const std::string& what) {
  if (salt == 0) {
    expect_identical(std::get<DTensor>(sd.at("model/big")).full_tensor(), zeros(kBig), what);
    return;
  }
  expect_identical(std::get<DTensor>(sd.at("model/big")).full_tensor(),
                   index_tensor(kBig, DType::Float32, salt), what + " big");
  expect_identical(std::get<DTensor>(sd.at("model/small")).full_tensor(),
                   index_tensor({5, 3}, DType::BFloat16, salt), what + " small");
  EXPECT_EQ(std::get<int64_t>(sd.at("extras/step")), salt) << what;
}

// File surgery on rank 0 with plain (serial) HDF5, then every rank goes on.
template <class F>
void on_rank0(F&& f) {
  if (world_rank() == 0) f();
  world_group()->barrier()->wait();
}

void copy(const std::string& from, const std::string& to) {
  fs::copy_file(from, to, fs::copy_options::overwrite_existing);
}

void flip_byte(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x5a);
  f.seekp(offset);
  f.write(&c, 1);
}

int64_t data_offset(const std::string& path, const std::string& dataset) {
  hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t ds = H5Dopen2(file, dataset.c_str(), H5P_DEFAULT);
  const haddr_t at = H5Dget_offset(ds);
  H5Dclose(ds);
  H5Fclose(file);
  return int64_t(at);
}

void edit(const std::string& path, const std::function<void(hid_t)>& f) {
  hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(file, 0) << path;
  f(file);
  H5Fclose(file);
}

std::string dir() {
  return scratch_dir("checkpoint_damage");
}

}  // namespace

TEST(CheckpointDamage, FlippedBytesInADatasetNameTheDatasetAndTheBlock) {
  const std::string good = dir() + "/good.h5", bad = dir() + "/flipped.h5";
  save(make_state(1), good);
  on_rank0([&] {
    copy(good, bad);
    // A byte in the third tile (elements from 2 * 262144) of model/big.
    flip_byte(bad, data_offset(bad, "/model/big") + 2 * (1 << 20) + 1000);
  });
  // Transactional: nothing changes. Otherwise the values read in place stay, and the error says
  // so. Both readers find it.
  for (bool mapped : {true, false}) {
    SCOPED_TRACE(mapped ? "mapped" : "HDF5 reads");
    StateDict sd = zero_state();
    expect_error([&] { load(sd, bad, {.transactional = true, .memory_map = mapped}); },
                 {"flipped.h5", "dataset 'model/big' block 2 of 3", "checksum mismatch"});
    expect_state(sd, 0, "nothing loaded");
    expect_error([&] { load(sd, bad, {.memory_map = mapped}); },
                 {"dataset 'model/big' block 2 of 3", "checksum mismatch",
                  "tensors read in place now hold the file's values"});
    EXPECT_EQ(std::get<int64_t>(sd.at("extras/step")), 0) << "scalars change only on success";
  }
  StateDict sd = zero_state();
  if (world_rank() == 0) {
    const auto problems = verify_checkpoint(bad);
    ASSERT_EQ(problems.size(), 1u);
    EXPECT_NE(problems[0].find("dataset 'model/big' block 2 of 3 (elements 524288 to 614399"),
              std::string::npos)
        << problems[0];
    EXPECT_TRUE(verify_checkpoint(good).empty());
  }
  load(sd, good);
  expect_state(sd, 1, "the intact file");
}

TEST(CheckpointDamage, TruncatedAndDamagedHeadersAreErrorsNamingTheFile) {
  const std::string good = dir() + "/good.h5";
  save(make_state(1), good);
  const std::string cut = dir() + "/truncated.h5", head = dir() + "/header.h5";
  on_rank0([&] {
    copy(good, cut);
    fs::resize_file(cut, fs::file_size(cut) * 6 / 10);
    copy(good, head);
    for (int64_t at = 40; at < 48; ++at)
      flip_byte(head, at);  // inside the superblock, which carries a checksum
  });
  StateDict sd = zero_state();
  for (bool mapped : {true, false}) {
    expect_error([&] { load(sd, cut, {.memory_map = mapped}); }, {"truncated.h5"});
    expect_error([&] { load(sd, head, {.memory_map = mapped}); },
                 {"header.h5", "cannot be opened"});
  }
  expect_state(sd, 0, "nothing loaded");
  if (world_rank() == 0) {
    EXPECT_FALSE(verify_checkpoint(cut).empty());
    EXPECT_FALSE(verify_checkpoint(head).empty());
  }
}

// HDF5 refuses a file shorter than its metadata says before any data is read; the mapping checks
// each range against the file's size again, since a page mapped past the end would raise SIGBUS.
TEST(CheckpointDamage, MappedRangesPastTheEndOfTheFileAreErrorsNamingIt) {
  const std::string path = dir() + "/short.bin";
  on_rank0([&] { std::ofstream(path, std::ios::binary) << std::string(5000, 'x'); });
  const ckpt::MappedFile file(path);
  EXPECT_EQ(file.size(), 5000);
  const ckpt::MappedRange r = file.map(4106, 784, "the tail");  // not page-aligned
  EXPECT_EQ(r.data()[0], 'x');
  expect_error([&] { file.map(4000, 1001, "dataset 'model/w'"); },
               {"short.bin", "dataset 'model/w' lies at bytes [4000, 5001)",
                "the file has 5000 bytes (truncated?)"});
}

TEST(CheckpointDamage, TamperedTableMissingDatasetVersionAndCompletion) {
  const std::string good = dir() + "/good.h5";
  save(make_state(1), good);
  const std::string table = dir() + "/table.h5", missing = dir() + "/missing.h5",
                    version = dir() + "/version.h5", unfinished = dir() + "/unfinished.h5";
  on_rank0([&] {
    for (const auto& p : {table, missing, version, unfinished})
      copy(good, p);
    edit(table, [](hid_t f) {
      hid_t ds = H5Dopen2(f, "/_tessera/checksums", H5P_DEFAULT);
      uint64_t v[8] = {};
      H5Dread(ds, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, v);
      v[1] ^= 1;
      H5Dwrite(ds, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, v);
      H5Dclose(ds);
    });
    edit(missing, [](hid_t f) { H5Ldelete(f, "/model/small", H5P_DEFAULT); });
    edit(version, [](hid_t f) {
      hid_t a = H5Aopen(f, "tessera.format_version", H5P_DEFAULT);
      const int64_t v = 99;
      H5Awrite(a, H5T_NATIVE_INT64, &v);
      H5Aclose(a);
    });
    edit(unfinished, [](hid_t f) { H5Adelete(f, "tessera.complete"); });
  });
  StateDict sd = zero_state();
  expect_error([&] { load(sd, table); }, {"table.h5", "the checksum table", "is damaged"});
  expect_error([&] { load(sd, missing); }, {"missing.h5", "missing keys: model/small"});
  expect_error([&] { load(sd, version); }, {"has format version 99; this Tessera reads version 1"});
  expect_error([&] { load(sd, unfinished); }, {"unfinished.h5' is incomplete"});
  expect_state(sd, 0, "nothing loaded");
  if (world_rank() == 0) {
    EXPECT_FALSE(verify_checkpoint(table).empty());
    EXPECT_TRUE(verify_checkpoint(good).empty());
    const std::vector<std::string> gap = verify_checkpoint(missing);
    ASSERT_EQ(gap.size(), 1u);
    EXPECT_NE(gap[0].find("of the table belong to no dataset"), std::string::npos) << gap[0];
    expect_error([&] { read_checkpoint_info(version); }, {"format version 99"});
  }
}

// Attributes another tool added to a checkpoint may hold several values (h5py stores a list as
// an array attribute). They were read into one value, writing past it: `tessera-ckpt ls` and
// verify crashed on such a file, and a load of the key overwrote memory. Now the inspection
// skips them, and a load of a key that holds one is a mismatched key.
TEST(CheckpointDamage, AttributesOfSeveralValuesAreNeverReadAsOne) {
  const std::string good = dir() + "/good.h5", lists = dir() + "/lists.h5",
                    step = dir() + "/step_array.h5";
  save(make_state(1), good);
  const auto add_lists = [](hid_t f, const char* ints) {
    hid_t g = H5Gopen2(f, "/extras", H5P_DEFAULT);
    const hsize_t three = 3, four = 4;
    const char* tags[3] = {"alpha", "beta", "gamma"};
    hid_t st = H5Tcopy(H5T_C_S1);
    H5Tset_size(st, H5T_VARIABLE);
    hid_t space = H5Screate_simple(1, &three, nullptr);
    hid_t a = H5Acreate2(g, "tags", st, space, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, st, tags);
    H5Aclose(a);
    H5Sclose(space);
    H5Tclose(st);
    const int64_t values[4] = {7, 8, 9, 10};
    space = H5Screate_simple(1, &four, nullptr);
    if (H5Aexists(g, ints) > 0) H5Adelete(g, ints);
    a = H5Acreate2(g, ints, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, values);
    H5Aclose(a);
    H5Sclose(space);
    H5Gclose(g);
  };
  on_rank0([&] {
    copy(good, lists);
    copy(good, step);
    edit(lists, [&](hid_t f) { add_lists(f, "history"); });
    edit(step, [&](hid_t f) { add_lists(f, "step"); });
  });
  // What the state dict does not ask for is ignored.
  StateDict sd = zero_state();
  load(sd, lists);
  expect_state(sd, 1, "a file with list attributes");
  // A key the file holds as a list is mismatched, and nothing is loaded.
  sd = zero_state();
  expect_error([&] { load(sd, step); },
               {"step_array.h5",
                "extras/step (expected an integer, the file holds an array of "
                "values)"});
  expect_state(sd, 0, "nothing loaded");
  const IncompatibleKeys k = load(sd, step, {.strict = false});
  ASSERT_EQ(k.mismatched_keys.size(), 1u) << k.str();
  EXPECT_EQ(std::get<int64_t>(sd.at("extras/step")), 0);
  if (world_rank() == 0) {
    const CheckpointInfo info = read_checkpoint_info(lists);
    EXPECT_EQ(info.scalars.count("extras/tags"), 0u);
    EXPECT_EQ(info.scalars.count("extras/history"), 0u);
    EXPECT_EQ(std::get<int64_t>(info.scalars.at("extras/step")), 1);
    EXPECT_TRUE(verify_checkpoint(lists).empty());
    EXPECT_EQ(read_checkpoint_info(step).scalars.count("extras/step"), 0u);
  }
}

// Options that decide collective steps are one decision for all ranks: a flush asked for by
// rank 0 alone (the rank that renames the file) and a verification asked for by one rank were
// each run by those ranks only, which then waited inside them for the others.
TEST(CheckpointDamage, OptionsThatDifferBetweenRanksAreOneDecision) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const std::string good = dir() + "/options.h5", bad = dir() + "/options_flipped.h5";
  save(make_state(1), good, {.fsync = world_rank() == 0});
  on_rank0([&] {
    copy(good, bad);
    flip_byte(bad, data_offset(bad, "/model/big") + 1000);
  });
  StateDict sd = zero_state();
  expect_error([&] { load(sd, bad, {.verify = world_rank() == 0, .transactional = true}); },
               {"options_flipped.h5", "dataset 'model/big' block 0 of 3", "checksum mismatch"});
  expect_state(sd, 0, "nothing loaded");
  load(sd, good, {.verify = world_rank() != 0});
  expect_state(sd, 1, "verified by some ranks");
}

// A failure on one rank, in the middle of writing, is an error on every rank; the previous
// checkpoint stays, and no temporary file is left.
TEST(CheckpointDamage, ASaveFailingOnOneRankFailsOnEveryRankAndKeepsThePreviousFile) {
  const std::string path = dir() + "/kept.h5";
  save(make_state(1), path);
  const int victim = world_size() - 1;
  ckpt::set_fault_hook([victim](const std::string& step) {
    if (step == "writing 'model/small'" && world_rank() == victim)
      TESSERA_FAIL("injected disk error");
  });
  expect_error([&] { save(make_state(2), path); },
               {"checkpoint save to", "[rank " + std::to_string(victim) + "] injected disk error"});
  ckpt::set_fault_hook(nullptr);
  StateDict sd = zero_state();
  load(sd, path);
  expect_state(sd, 1, "previous checkpoint");
  EXPECT_FALSE(fs::exists(path + ".tessera-tmp"));
}

// Staging copies a rank's owned pieces (all of them, for async_save): running out of memory
// there on one rank is an error on every rank, not the others waiting in the next step.
TEST(CheckpointDamage, AStagingFailureOnOneRankFailsOnEveryRank) {
  const std::string path = dir() + "/staging.h5";
  save(make_state(1), path);
  const int victim = world_size() - 1;
  ckpt::set_fault_hook([victim](const std::string& step) {
    if (step == "staging the values" && world_rank() == victim) throw std::bad_alloc();
  });
  for (bool async : {false, true}) {
    expect_error(
        [&] {
          if (async)
            async_save(make_state(2), path).wait();
          else
            save(make_state(2), path);
        },
        {"checkpoint save to", "[rank " + std::to_string(victim) + "]"});
  }
  ckpt::set_fault_hook(nullptr);
  StateDict sd = zero_state();
  load(sd, path);
  expect_state(sd, 1, "previous checkpoint");
}

// A plain tensor is one value for all ranks, written once, by one of them; so is each block of a
// Replicate placement. Replicas that differ (a per-rank RNG state stored as a plain tensor) are
// refused on every rank, naming the keys and the ranks, before anything is committed; equal ones
// save, and per-rank state saves as a DTensor sharded over the world.
TEST(CheckpointDamage, ReplicasThatDifferAreRefusedOnEveryRankAndKeepThePreviousFile) {
  if (world_size() < 2) GTEST_SKIP() << "replicas need two ranks";
  const std::string path = dir() + "/replicas.h5";
  save(make_state(1), path);
  DeviceMesh mesh(Shape{world_size()}, {"x"});
  // Rank `odd` holds other values than the rest; rank 0, first with the fewest bytes, writes
  // 'extras/rng'.
  const int odd = world_size() - 1;
  const int salt = world_rank() == odd ? 1 : 0;
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async_save" : "save");
    StateDict sd = make_state(2);
    sd["extras/rng"] = index_tensor({4, 3}, DType::Int64, salt);
    sd["model/norm"] =
        DTensor::from_local(index_tensor({8}, DType::Float32, salt), mesh, {Replicate()});
    expect_error(
        [&] {
          if (async)
            async_save(sd, path).wait();
          else
            save(sd, path);
        },
        {"checkpoint save to", "replicas differ",
         "'extras/rng' (rank " + std::to_string(odd) + " differs from rank 0)", "'model/norm' (",
         "rank " + std::to_string(odd)});
  }
  StateDict sd = zero_state();
  load(sd, path);
  expect_state(sd, 1, "previous checkpoint");
  EXPECT_FALSE(fs::exists(path + ".tessera-tmp"));

  // Equal replicas save; each rank's own state comes back to it as its row of a [world, 3].
  StateDict good = make_state(2);
  good["extras/rng"] = index_tensor({4, 3}, DType::Int64);
  good["extras/per_rank"] =
      DTensor::from_local(index_tensor({1, 3}, DType::Int64, world_rank()), mesh, {Shard(0)});
  save(good, path);
  StateDict back = zero_state();
  back["extras/rng"] = zeros({4, 3}, DType::Int64);
  back["extras/per_rank"] = DTensor::from_local(zeros({1, 3}, DType::Int64), mesh, {Shard(0)});
  load(back, path);
  expect_state(back, 2, "equal replicas");
  expect_identical(std::get<Tensor>(back.at("extras/rng")), index_tensor({4, 3}, DType::Int64),
                   "extras/rng");
  expect_identical(std::get<DTensor>(back.at("extras/per_rank")).to_local(),
                   index_tensor({1, 3}, DType::Int64, world_rank()), "this rank's own row");
}

// Every rank verifies what it reads: a rank reading a window that another rank accounts for in
// the checksum table (a replica) compares its sums with that rank's. Here each rank loads its
// own copy of the file (as ranks on different hosts would), and only a replica's copy is damaged.
TEST(CheckpointDamage, DamageOnlyAReplicaReadsIsAnErrorOnEveryRank) {
  if (world_size() < 2) GTEST_SKIP() << "replicas need two ranks";
  const std::string good = dir() + "/replica_good.h5";
  save(make_state(1), good);
  // zero_state's 'model/big' is Replicate: rank 0, first with the fewest bytes, accounts for it.
  const int victim = world_size() - 1;
  const std::string mine = dir() + "/replica_" + std::to_string(world_rank()) + ".h5";
  copy(good, mine);
  if (world_rank() == victim) flip_byte(mine, data_offset(mine, "/model/big") + 1000);
  world_group()->barrier()->wait();
  for (bool mapped : {true, false}) {
    SCOPED_TRACE(mapped ? "mapped" : "HDF5 reads");
    StateDict sd = zero_state();
    expect_error([&] { load(sd, mine, {.transactional = true, .memory_map = mapped}); },
                 {"dataset 'model/big' block 0 of 3", "checksum mismatch",
                  "rank " + std::to_string(victim) + " read other bytes than rank 0"});
    expect_state(sd, 0, "nothing loaded");
  }
  StateDict sd = zero_state();
  load(sd, good);
  expect_state(sd, 1, "the intact file");
}

// A newer checkpoint renamed over `path` while a load reads it (a save committing) is not seen:
// the load reads the file it opened, through the mapping and through HDF5 alike, never the
// offsets of one file and the bytes of the other.
TEST(CheckpointDamage, ACheckpointRenamedOverThePathAfterOpeningIsNotSeen) {
  const std::string path = dir() + "/replaced.h5", newer = dir() + "/newer.h5";
  for (bool mapped : {true, false}) {
    SCOPED_TRACE(mapped ? "mapped" : "HDF5 reads");
    save(make_state(1), path);
    save(make_state(2), newer);
    ckpt::set_fault_hook([&](const std::string& step) {
      if (step == "reading the metadata" && world_rank() == 0) fs::rename(newer, path);
    });
    StateDict sd = zero_state();
    const std::string error = error_of([&] { load(sd, path, {.memory_map = mapped}); });
    ckpt::set_fault_hook(nullptr);
    EXPECT_EQ(error, "");
    expect_state(sd, 1, "the file opened");
    load(sd, path, {.memory_map = mapped});
    expect_state(sd, 2, "the file renamed over it, loaded again");
  }
}

// Renamed over `path` after this rank opened it and before HDF5 did: HDF5 may hold the other
// file, so the load is an error on every rank naming the file, and nothing changes.
TEST(CheckpointDamage, ACheckpointRenamedOverThePathWhileOpeningIsAnErrorOnEveryRank) {
  const std::string path = dir() + "/replaced.h5", newer = dir() + "/newer.h5";
  save(make_state(1), path);
  save(make_state(2), newer);
  ckpt::set_fault_hook([&](const std::string& step) {
    if (step == "opening" && world_rank() == 0) fs::rename(newer, path);
  });
  StateDict sd = zero_state();
  const std::string error = error_of([&] { load(sd, path); });
  ckpt::set_fault_hook(nullptr);
  EXPECT_NE(error.find("replaced.h5' was replaced while it was being opened"), std::string::npos)
      << error;
  const auto all = all_gather_strings(world_group(), error);
  for (size_t r = 1; r < all.size(); ++r)
    EXPECT_EQ(all[r], all[0]) << "rank " << r;
  expect_state(sd, 0, "nothing loaded");
}

// Reading makes no collective call, so no rank can wait inside it for another: a read slower
// than the collective timeout (slow storage) is not a hang, and must not abort the job.
TEST(CheckpointDamage, ReadsSlowerThanTheCollectiveTimeoutAreNotAHang) {
  const std::string path = dir() + "/slow.h5";
  save(make_state(1), path);
  const double timeout = collective_timeout_seconds();
  set_collective_timeout_seconds(0.2);
  ckpt::set_fault_hook([](const std::string& step) {
    if (step == "reading the tensors") std::this_thread::sleep_for(std::chrono::seconds(1));
  });
  StateDict sd = zero_state();
  load(sd, path);
  ckpt::set_fault_hook(nullptr);
  set_collective_timeout_seconds(timeout);
  expect_state(sd, 1, "slow load");
}

// Strings are stored as UTF-8 text: bytes that are not text are refused on every rank, naming
// the key, where they were truncated at a NUL or stopped the ranks' exchange of descriptions.
TEST(CheckpointDamage, StringValuesThatAreNotTextAreRefused) {
  const std::string path = dir() + "/strings.h5";
  for (const auto& [value, why] :
       {std::pair<std::string, std::string>{std::string("ab\0cd", 5), "holds a NUL byte"},
        {std::string("\xff\xfe"), "is not valid UTF-8"},
        {std::string("\xc0\x80"), "is not valid UTF-8"}}) {
    StateDict sd = make_state(1);
    sd["extras/name"] = value;
    expect_error([&] { save(sd, path); }, {"'extras/name'", why});
  }
  StateDict sd = make_state(1);
  sd["extras/name"] = std::string("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x99\x82");  // é € and an emoji
  save(sd, path);
  StateDict back = zero_state();
  back["extras/name"] = std::string();
  load(back, path);
  EXPECT_EQ(std::get<std::string>(back.at("extras/name")),
            std::get<std::string>(sd.at("extras/name")));
}

TEST(CheckpointDamage, AsyncSaveWritesTheSnapshotTakenAtTheCall) {
  const std::string path = dir() + "/async.h5";
  StateDict sd = make_state(1);
  AsyncSave pending = async_save(sd, path);
  // Training goes on: the tensors change and collectives run while the file is written, blocking
  // ones included (a mesh splits communicators; it once met the writer's collective file calls
  // in a deadlock).
  std::get<DTensor>(sd["model/big"]).copy_from_full(index_tensor(kBig, DType::Float32, 2));
  for (int i = 0; i < 20; ++i) {
    Tensor t = ones({1000});
    world_group()->all_reduce(t, ReduceOp::Sum)->wait();
    if (i % 5 == 0) DeviceMesh another(Shape{world_size()}, {"y"});
  }
  pending.wait();
  StateDict back = zero_state();
  load(back, path);
  expect_state(back, 1, "snapshot");
  // A second save waits for the first; both commit.
  AsyncSave a = async_save(make_state(3), dir() + "/async_a.h5");
  AsyncSave b = async_save(make_state(4), dir() + "/async_b.h5");
  b.wait();
  a.wait();
  load(back, dir() + "/async_a.h5");
  expect_state(back, 3, "first of two");
  load(back, dir() + "/async_b.h5");
  expect_state(back, 4, "second of two");
}

TEST(CheckpointDamage, AsyncSaveFailuresReachWaitOrTheNextOperation) {
  const std::string path = dir() + "/async_fail.h5";
  save(make_state(1), path);
  ckpt::set_fault_hook([](const std::string& step) {
    if (step == "writing 'model/big'" && world_rank() == 0) TESSERA_FAIL("injected async error");
  });
  AsyncSave pending = async_save(make_state(2), path);
  expect_error([&] { pending.wait(); }, {"[rank 0] injected async error"});
  {
    AsyncSave dropped = async_save(make_state(2), path);
  }  // waited for by its destructor, the error kept for the next operation
  ckpt::set_fault_hook(nullptr);
  StateDict sd = zero_state();
  expect_error(
      [&] { load(sd, path); },
      {"an earlier async_save to", "failed and nobody waited for it", "injected async error"});
  load(sd, path);
  expect_state(sd, 1, "previous checkpoint");
}
