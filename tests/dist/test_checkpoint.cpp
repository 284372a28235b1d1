// Checkpoint files: every dtype round trips bit for bit through any placements and meshes of
// this world size, with uneven and empty shards; a block held by several ranks is written once;
// h5py reads every dataset as the global tensor; and bad use is a clear error on every rank.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <cmath>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "common/shell_quote.h"
#include "dist/checkpoint_models.h"
#include "dist/checkpoint_util.h"
#include "plan.h"  // checkpoint/src: who writes each block
#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"

using namespace tessera;
using tessera::test::shell_quoted;
using tessera::testing::expect_error;
using tessera::testing::expect_identical;
using tessera::testing::index_tensor;
using tessera::testing::scratch_dir;

namespace {

constexpr const char* kNoH5py =
    "no python3 with h5py found at configure time (scripts/setup-deps installs python3-h5py)";

const std::vector<DType> kDTypes = {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16,
                                    DType::Int64,   DType::Int32,   DType::Bool};

// Shapes with uneven and empty pieces at every world size used here, a scalar and an empty one.
const std::vector<Shape> kShapes = {{7, 5}, {3, 11}, {1, 2}, {13}, {}, {0, 4}, {5, 3, 2}};

std::string file_in(const std::string& dir, const std::string& name) {
  return dir + "/" + name + ".h5";
}

// Every 1-D and 2-D layout of this world size that a tensor of `shape` admits.
std::vector<std::pair<DeviceMesh, Placements>> layouts(const Shape& shape) {
  std::vector<std::pair<DeviceMesh, Placements>> out;
  const int64_t n = world_size();
  DeviceMesh line(Shape{n}, {"x"});
  out.push_back({line, {Replicate()}});
  for (int64_t d = 0; d < int64_t(shape.size()); ++d)
    out.push_back({line, {Shard(d)}});
  if (n == 4 || n == 8) {
    DeviceMesh grid(Shape{2, n / 2}, {"a", "b"});
    out.push_back({grid, {Replicate(), Replicate()}});
    if (!shape.empty()) {
      out.push_back({grid, {Replicate(), Shard(0)}});
      out.push_back({grid, {Shard(0), Shard(0)}});
      out.push_back({grid, {StridedShard(0, n / 2), Shard(0)}});
      if (shape.size() >= 2) out.push_back({grid, {Shard(1), Shard(0)}});
    }
  }
  return out;
}

}  // namespace

// Every dtype and shape in one state dict, saved from each layout and loaded into each layout
// (a shape takes the layouts it admits in turn).
TEST(Checkpoint, EveryDtypeRoundTripsThroughEveryLayout) {
  const std::string path =
      file_in(scratch_dir("checkpoint_roundtrip"), "np" + std::to_string(world_size()));
  size_t rounds = 0;
  for (const Shape& shape : kShapes)
    rounds = std::max(rounds, layouts(shape).size());
  auto state = [&](size_t layout, int salt) {
    StateDict sd;
    for (DType dt : kDTypes)
      for (size_t s = 0; s < kShapes.size(); ++s) {
        const auto ls = layouts(kShapes[s]);
        const auto& [mesh, placements] = ls[layout % ls.size()];
        sd[std::string(dtype_name(dt)) + "/shape" + std::to_string(s)] =
            distribute_tensor(index_tensor(kShapes[s], dt, salt), mesh, placements);
      }
    return sd;
  };
  for (size_t a = 0; a < rounds; ++a) {
    save(state(a, 1), path);
    // Both readers: copies out of the mapped file, and HDF5 reads (collective for windows that
    // are not runs of the file). The file does not depend on the layout that saved it, so the
    // HDF5 reader (slow with 8 ranks on 2 cores) reads every layout from the first file only.
    for (bool mapped : {true, false})
      for (size_t b = 0; b < rounds && (mapped || a == 0); ++b) {
        StateDict sd = state(b, 2);
        const IncompatibleKeys k = load(sd, path, {.memory_map = mapped});
        EXPECT_TRUE(k.empty()) << k.str();
        for (const auto& [key, v] : sd) {
          const DTensor& d = std::get<DTensor>(v);
          expect_identical(d.full_tensor(), index_tensor(d.shape(), d.dtype(), 1),
                           key + " layout " + std::to_string(a) + " -> " + std::to_string(b) + " " +
                               placements_str(d.placements()) +
                               (mapped ? " (mapped)" : " (HDF5 reads)"));
        }
      }
  }
  if (world_rank() == 0)
    for (DType dt : kDTypes)
      for (size_t s = 0; s < kShapes.size(); ++s) {
        const std::string key = std::string(dtype_name(dt)) + "/shape" + std::to_string(s);
        expect_identical(read_checkpoint_tensor(path, key), index_tensor(kShapes[s], dt, 1), key);
      }
}

TEST(Checkpoint, ScalarsStringsAndPlainTensorsRoundTrip) {
  const std::string path =
      file_in(scratch_dir("checkpoint_scalars"), "np" + std::to_string(world_size()));
  StateDict sd = {{"extras/step", int64_t(42)},
                  {"extras/lr", 0.00125},
                  {"extras/config", std::string("{\"dim\": 64}")},
                  {"extras/empty", std::string()},
                  {"top", int64_t(-7)},
                  {"extras/rng", index_tensor({4}, DType::Int64)},
                  {"model/w", index_tensor({6, 2}, DType::Float32)}};
  save(sd, path);
  StateDict back = {{"extras/step", int64_t(0)},
                    {"extras/lr", 0.0},
                    {"extras/config", std::string()},
                    {"extras/empty", std::string("x")},
                    {"top", int64_t(0)},
                    {"extras/rng", zeros({4}, DType::Int64)},
                    {"model/w", zeros({6, 2}, DType::Float32)}};
  const IncompatibleKeys k = load(back, path);
  EXPECT_TRUE(k.empty()) << k.str();
  EXPECT_EQ(std::get<int64_t>(back["extras/step"]), 42);
  EXPECT_EQ(std::get<double>(back["extras/lr"]), 0.00125);
  EXPECT_EQ(std::get<std::string>(back["extras/config"]), "{\"dim\": 64}");
  EXPECT_EQ(std::get<std::string>(back["extras/empty"]), "");
  EXPECT_EQ(std::get<int64_t>(back["top"]), -7);
  expect_identical(std::get<Tensor>(back["extras/rng"]), index_tensor({4}, DType::Int64), "rng");
  expect_identical(std::get<Tensor>(back["model/w"]), index_tensor({6, 2}, DType::Float32), "w");
  if (world_rank() == 0) {
    const CheckpointInfo info = read_checkpoint_info(path);
    EXPECT_EQ(info.world_size, world_size());
    ASSERT_EQ(info.tensors.size(), 2u);
    EXPECT_EQ(info.tensors[0].key, "extras/rng");
    EXPECT_EQ(info.tensors[1].bytes, 48);
    EXPECT_EQ(std::get<int64_t>(info.scalars.at("extras/step")), 42);
    EXPECT_TRUE(verify_checkpoint(path).empty());
  }
}

// Loading converts between floating dtypes (a float32 checkpoint into a bfloat16 model), and
// non-strict loads report what the file lacks and load the rest.
TEST(Checkpoint, FloatConversionAndNonStrictLoad) {
  const std::string path =
      file_in(scratch_dir("checkpoint_convert"), "np" + std::to_string(world_size()));
  DeviceMesh mesh(Shape{world_size()}, {"x"});
  const Tensor g = index_tensor({9, 3}, DType::Float32);
  save({{"a", distribute_tensor(g, mesh, {Shard(0)})}}, path);
  DTensor bf = distribute_tensor(zeros({9, 3}, DType::BFloat16), mesh, {Shard(1)});
  StateDict sd = {{"a", bf}, {"b", zeros({2}, DType::Float32)}, {"c", int64_t(3)}};
  expect_error([&] { load(sd, path); }, {"does not match the state dict", "missing keys: b, c"});
  const IncompatibleKeys k = load(sd, path, {.strict = false});
  EXPECT_EQ(k.missing_keys, (std::vector<std::string>{"b", "c"}));
  expect_identical(bf.full_tensor(), g.to(DType::BFloat16), "float32 -> bfloat16");
  EXPECT_EQ(std::get<int64_t>(sd["c"]), 3);
  // A scalar the dict keeps where the file holds a tensor ("a/lr" against tensor "a") is a
  // mismatched key, not a failure to open a group.
  StateDict lr = {{"a/lr", 0.5}};
  const IncompatibleKeys m = load(lr, path, {.strict = false});
  ASSERT_EQ(m.mismatched_keys.size(), 1u) << m.str();
  EXPECT_NE(m.mismatched_keys[0].find("a/lr (expected a double in group '/a', which the file "
                                      "holds as a tensor)"),
            std::string::npos)
      << m.str();
  expect_error([&] { load(lr, path); }, {"mis-shaped keys: a/lr (expected a double"});
}

// A dataset another tool rewrote chunked and compressed (h5py) has no one place in the file to
// map: the memory-mapped load reads it through HDF5 instead, with the same values.
TEST(Checkpoint, ADatasetRewrittenChunkedByAnotherToolStillLoads) {
  const std::string python = TESSERA_H5PY_PYTHON;
  if (python.empty()) GTEST_SKIP() << kNoH5py;
  const std::string path =
      file_in(scratch_dir("checkpoint_chunked"), "np" + std::to_string(world_size()));
  DeviceMesh mesh(Shape{world_size()}, {"x"});
  const Tensor g = index_tensor({9, 5}, DType::Float32);
  save({{"model/w", distribute_tensor(g, mesh, {Shard(0)})}}, path);
  int rc = 0;
  if (world_rank() == 0) {
    const std::string script =
        "import h5py, sys\n"
        "f = h5py.File(sys.argv[1], 'r+')\n"
        "d = f['model/w']; data = d[()]; attrs = dict(d.attrs); del f['model/w']\n"
        "n = f.create_dataset('model/w', data=data, chunks=(2, 5), compression='gzip')\n"
        "for k, v in attrs.items(): n.attrs[k] = v\n";
    const std::string cmd =
        shell_quoted(python) + " -c " + shell_quoted(script) + " " + shell_quoted(path);
    rc = std::system(cmd.c_str());
  }
  Tensor flag = from_vector<int64_t>({rc});
  world_group()->broadcast(flag, 0)->wait();
  ASSERT_EQ(flag.item<int64_t>(), 0) << "h5py could not rewrite the dataset";
  DTensor w = distribute_tensor(zeros({9, 5}), mesh, {Shard(1)});
  StateDict sd = {{"model/w", w}};
  load(sd, path, {.memory_map = true});
  expect_identical(w.full_tensor(), g, "the chunked dataset, mapped load");
}

TEST(Checkpoint, BadUseIsAClearErrorOnEveryRank) {
  const std::string dir = scratch_dir("checkpoint_bad_use");
  const std::string path = file_in(dir, "np" + std::to_string(world_size()));
  DeviceMesh mesh(Shape{world_size()}, {"x"});
  DTensor d = distribute_tensor(index_tensor({8, 4}, DType::Float32), mesh, {Shard(0)});
  save({{"model/w", d}}, path);

  // A model of another shape.
  StateDict other = {{"model/w", distribute_tensor(zeros({8, 5}), mesh, {Shard(0)})}};
  expect_error([&] { load(other, path); },
               {"model/w (expected [8, 5] float32, the file holds [8, 4] float32)"});
  // A dtype that does not convert.
  StateDict ints = {{"model/w", zeros({8, 4}, DType::Int64)}};
  expect_error([&] { load(ints, path); }, {"model/w (expected [8, 4] int64"});
  // A file that does not exist; the temporary file of a save.
  StateDict sd = {{"model/w", distribute_tensor(zeros({8, 4}), mesh, {Shard(0)})}};
  expect_error([&] { load(sd, dir + "/nothing.h5"); }, {"nothing.h5' does not exist"});
  if (world_rank() == 0)
    std::filesystem::copy_file(path, path + ".tessera-tmp",
                               std::filesystem::copy_options::overwrite_existing);
  world_group()->barrier()->wait();
  expect_error([&] { load(sd, path + ".tessera-tmp"); },
               {"is the temporary file of a checkpoint save that never committed"});
  // Keys: empty parts, reserved names, a tensor under a tensor.
  expect_error([&] { save({{"a//b", d}}, path); }, {"key 'a//b' has an empty"});
  expect_error([&] { save({{"_tessera/x", d}}, path); }, {"reserves"});
  expect_error(
      [&] {
        save({{"a", d}, {"a/b", int64_t(1)}}, path);
      },
      {"key 'a/b' lies under the tensor key 'a'"});
  // A destination that cannot be written.
  expect_error([&] { save({{"a", d}}, dir + "/no/such/dir/x.h5"); }, {"does not exist"});
  expect_error([&] { save({{"a", d}}, dir); }, {"is not a regular file"});
  // The failed saves left the checkpoint as it was.
  StateDict back = {{"model/w", distribute_tensor(zeros({8, 4}), mesh, {Replicate()})}};
  load(back, path);
  expect_identical(std::get<DTensor>(back["model/w"]).full_tensor(),
                   index_tensor({8, 4}, DType::Float32), "after failed saves");
}

// A load that reads straight into a tensor writes it as any in-place kernel does: its version
// counter moves, so a graph that saved the tensor before the load refuses backward instead of
// differentiating at values it never saw.
TEST(Checkpoint, ALoadInPlaceCountsAsAWriteOfEachTensor) {
  const std::string path =
      file_in(scratch_dir("checkpoint_version"), "np" + std::to_string(world_size()));
  DeviceMesh mesh(Shape{world_size()}, {"x"});
  const int64_t rows = 2 * world_size();  // no empty shard
  save({{"w", index_tensor({3, 4}, DType::Float32)},
        {"d", distribute_tensor(index_tensor({rows, 4}, DType::Float32), mesh, {Shard(0)})}},
       path);
  for (bool mapped : {true, false}) {
    SCOPED_TRACE(mapped ? "mapped" : "HDF5 reads");
    Tensor w = zeros({3, 4});
    w.set_requires_grad(true);
    DTensor d = distribute_tensor(zeros({rows, 4}), mesh, {Shard(0)});
    Tensor loss = sum(mul(w, w));  // saves w
    const uint32_t wv = w.version(), dv = d.to_local().version();
    StateDict sd = {{"w", w}, {"d", d}};
    load(sd, path, {.memory_map = mapped});
    expect_identical(w.detach(), index_tensor({3, 4}, DType::Float32), "read in place");
    EXPECT_EQ(w.version(), wv + 1);
    EXPECT_EQ(d.to_local().version(), dv + 1);
    expect_error([&] { backward(loss); }, {"modified by an in-place operation"});
  }
}

// Ranks that pass different state dicts get one error, on every rank, naming the difference.
TEST(Checkpoint, RanksWithDifferentStateDictsFailTogether) {
  if (world_size() == 1) GTEST_SKIP() << "needs two ranks";
  const std::string path =
      file_in(scratch_dir("checkpoint_mismatch"), "np" + std::to_string(world_size()));
  StateDict sd = {{"w", zeros({world_rank() == 1 ? 5 : 4})}};
  expect_error([&] { save(sd, path); }, {"every rank must pass the same state dict",
                                         "on rank 0 but a [5] float32 tensor on rank 1"});
  StateDict extra = {{"w", zeros({4})}};
  if (world_rank() == 1) extra["v"] = int64_t(1);
  expect_error([&] { save(extra, path); }, {"rank 1 has key 'v' that rank 0 lacks"});
  StateDict val = {{"n", int64_t(world_rank() == 1 ? 1 : 0)}};
  expect_error([&] { save(val, path); }, {"'n' has different values on rank 0 and rank 1"});
}

// h5py, with no Tessera code, reads every dataset as the global tensor: every dtype (bfloat16 as
// float32), uneven and empty pieces, and a sharded decoder with its optimizer state.
TEST(Checkpoint, H5pyReadsEveryDatasetAsTheGlobalTensor) {
  const std::string python = TESSERA_H5PY_PYTHON;
  if (python.empty()) GTEST_SKIP() << kNoH5py;
  const std::string dir = scratch_dir("checkpoint_h5py");
  StateDict sd;
  for (DType dt : kDTypes)
    for (size_t s = 0; s < kShapes.size(); ++s) {
      const auto ls = layouts(kShapes[s]);
      const auto& [mesh, placements] = ls[(s + 1) % ls.size()];
      sd[std::string(dtype_name(dt)) + "/shape" + std::to_string(s)] =
          distribute_tensor(index_tensor(kShapes[s], dt, 1), mesh, placements);
    }
  tessera::testing::Parallel p = tessera::testing::decoder_layouts().back().build(7);
  AdamW opt(p.model->parameters(), tessera::testing::checkpoint_adamw());
  tessera::testing::train_step(p, opt, 0);
  insert_state_dict(sd, "model", get_model_state_dict(*p.model));
  insert_state_dict(sd, "optim", get_optimizer_state_dict(*p.model, opt));
  const std::string path = dir + "/checkpoint.h5";
  save(sd, path);

  std::ofstream manifest;
  if (world_rank() == 0) manifest.open(dir + "/manifest.txt");
  int n = 0;
  for (const auto& [key, v] : sd) {
    if (!std::holds_alternative<DTensor>(v) && !std::holds_alternative<Tensor>(v)) continue;
    Tensor full = std::holds_alternative<DTensor>(v) ? std::get<DTensor>(v).full_tensor()
                                                     : std::get<Tensor>(v);
    if (world_rank() != 0) continue;
    if (full.dtype() == DType::BFloat16) full = full.to(DType::Float32);
    const char* np = full.dtype() == DType::Float32   ? "float32"
                     : full.dtype() == DType::Float64 ? "float64"
                     : full.dtype() == DType::Float16 ? "float16"
                     : full.dtype() == DType::Int64   ? "int64"
                     : full.dtype() == DType::Int32   ? "int32"
                                                      : "bool";
    std::string dims;
    for (int64_t d : full.shape())
      dims.append(dims.empty() ? "" : ",").append(std::to_string(d));
    manifest << key << " " << np << " " << dims << "\n";
    std::ofstream bin(dir + "/" + std::to_string(n++) + ".bin", std::ios::binary);
    const Tensor c = full.contiguous();
    bin.write(static_cast<const char*>(c.raw_data()), std::streamsize(c.nbytes()));
  }
  if (world_rank() == 0) {
    manifest.close();
    const std::string cmd =
        shell_quoted(python) + " " +
        shell_quoted(std::string(TESSERA_SOURCE_DIR) + "/tests/python/check_h5py.py") + " " +
        shell_quoted(path) + " " + shell_quoted(dir);
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
}

// A block held by several ranks is written once, by one of them, and the owners are spread.
// Replicas must hold equal values (a save refuses them otherwise), so the file cannot show who
// wrote a block: the plan the save follows says it (plan.h), each rank's choices gathered.
TEST(Checkpoint, ReplicatedBlocksAreWrittenOnceByOwnersSpreadOverTheRanks) {
  const int64_t n = world_size();
  if (n == 1) GTEST_SKIP() << "needs replicas";
  const std::string path = file_in(scratch_dir("checkpoint_owners"), "np" + std::to_string(n));
  DeviceMesh line(Shape{n}, {"x"});
  StateDict sd;
  for (int64_t e = 0; e < n; ++e)
    sd["replicated/" + std::to_string(e)] =
        distribute_tensor(index_tensor({16}, DType::Int64, int(e)), line, {Replicate()});
  const bool grid = n % 2 == 0;
  if (grid) {
    DeviceMesh hsdp(Shape{2, n / 2}, {"replicate", "shard"});
    for (int e = 0; e < 2; ++e)
      sd["hsdp/" + std::to_string(e)] = distribute_tensor(
          index_tensor({4 * n / 2}, DType::Int64, e), hsdp, {Replicate(), Shard(0)});
  }
  std::vector<ckpt::Entry> entries = ckpt::describe(sd, "owners", /*for_load=*/false);
  ckpt::agree_on_entries(entries, world_group(), "owners");
  std::vector<int64_t> mine;  // per entry: whether this rank writes its block
  for (const ckpt::Entry& e : entries)
    mine.push_back(e.owner ? 1 : 0);
  const auto m = int64_t(mine.size());
  Tensor all = empty({n * m}, DType::Int64);
  world_group()->all_gather_into_tensor(all, from_vector<int64_t>(mine, {m}))->wait();
  const std::vector<int64_t> owns = all.to_vector<int64_t>();
  std::vector<int64_t> writes(size_t(n), 0), hsdp_writes(size_t(n), 0);
  for (int64_t i = 0; i < m; ++i) {
    const bool replicated = entries[size_t(i)].key.rfind("replicated/", 0) == 0;
    std::vector<int64_t> blocks;  // of the owners: their shard coordinate
    for (int64_t r = 0; r < n; ++r) {
      if (owns[size_t(r * m + i)] == 0) continue;
      ++(replicated ? writes : hsdp_writes)[size_t(r)];
      blocks.push_back(replicated ? 0 : r % (n / 2));
    }
    std::sort(blocks.begin(), blocks.end());
    std::vector<int64_t> want(size_t(replicated ? 1 : n / 2));
    std::iota(want.begin(), want.end(), 0);
    EXPECT_EQ(blocks, want) << entries[size_t(i)].key << ": one writer per block";
  }
  // n whole tensors over n ranks: each rank writes exactly one.
  EXPECT_EQ(writes, std::vector<int64_t>(size_t(n), 1));
  if (grid) {
    EXPECT_EQ(hsdp_writes, std::vector<int64_t>(size_t(n), 1)) << "2 x n/2 blocks over n ranks";
  }
  // And the save follows it: every block arrives.
  save(sd, path);
  for (const auto& [key, v] : sd) {
    const Tensor want = std::get<DTensor>(v).full_tensor();  // collective
    if (world_rank() == 0) expect_identical(read_checkpoint_tensor(path, key), want, key);
  }
}

namespace {

// Runs tessera-ckpt with `args` (one process, no mpirun); its exit code and output.
std::pair<int, std::string> ckpt_cli(const std::string& args) {
  const std::string cmd = shell_quoted(TESSERA_CKPT_EXE) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t got = 0;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0)
    out.append(buf, got);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

}  // namespace

TEST(Checkpoint, TheCliListsVerifiesDiffsAndExports) {
  auto q = [](const std::string& s) { return shell_quoted(s); };
  const std::string dir = scratch_dir("checkpoint_cli");
  DeviceMesh mesh(Shape{world_size()}, {"dp"});
  auto state = [&](int salt) {
    return StateDict{{"model/w", distribute_tensor(index_tensor({6, 4}, DType::Float32, salt), mesh,
                                                   {Shard(0)})},
                     {"model/b", distribute_tensor(index_tensor({4}, DType::BFloat16, salt), mesh,
                                                   {Replicate()})},
                     {"optim/m", index_tensor({2}, DType::Float32, salt)},
                     // A seed past 2^53 (a double cannot tell it from its neighbour) and
                     // non-finite values alike in both files.
                     {"extras/rng", from_vector<int64_t>({(int64_t(1) << 53) + salt, 7}, {2})},
                     {"optim/mask", from_vector<float>({-INFINITY, NAN, 1.0f}, {3})},
                     {"extras/step", int64_t(salt)}};
  };
  const std::string a = dir + "/a.h5", b = dir + "/b.h5";
  save(state(1), a);
  save(state(2), b);
  if (world_rank() != 0) return;
  auto [rc, out] = ckpt_cli("ls " + q(a));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("model/w"), std::string::npos) << out;
  EXPECT_NE(out.find("[6, 4]"), std::string::npos) << out;
  EXPECT_NE(out.find("DeviceMesh(dp=" + std::to_string(world_size()) + ") [S(0)]"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("extras/step"), std::string::npos) << out;
  std::tie(rc, out) = ckpt_cli("verify " + q(a));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ok, 5 tensors verified"), std::string::npos) << out;
  std::tie(rc, out) = ckpt_cli("diff " + q(a) + " " + q(a));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out.find("differ"), std::string::npos) << out;
  std::tie(rc, out) = ckpt_cli("diff " + q(a) + " " + q(b));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("model/w"), std::string::npos) << out;
  EXPECT_NE(out.find("1 of 2 elements differ, max |a-b| 1"), std::string::npos) << out;
  EXPECT_NE(out.find("identical"), std::string::npos) << out;  // optim/mask
  EXPECT_NE(out.find("int64 1 vs int64 2"), std::string::npos) << out;
  std::tie(rc, out) = ckpt_cli("export-safetensors " + q(a) + " " + q(dir + "/model.safetensors"));
  EXPECT_EQ(rc, 0) << out;
  const SafetensorsFile st = load_safetensors(dir + "/model.safetensors");
  ASSERT_EQ(st.tensors.size(), 2u);
  expect_identical(st.tensors.at("w"), index_tensor({6, 4}, DType::Float32, 1), "exported w");
  expect_identical(st.tensors.at("b"), index_tensor({4}, DType::BFloat16, 1), "exported b");
  std::tie(rc, out) = ckpt_cli("frobnicate " + q(a));
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("unknown command 'frobnicate'"), std::string::npos) << out;
  std::tie(rc, out) = ckpt_cli("ls " + q(dir + "/none.h5"));
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("none.h5' does not exist"), std::string::npos) << out;
}
