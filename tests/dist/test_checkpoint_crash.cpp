// Crash safety: a rank killed with SIGKILL at any step of a save (in child jobs) leaves the
// previous checkpoint loadable and intact, and never a file under the new path.
#include <gtest/gtest.h>

#include <filesystem>

#include "child_job.h"
#include "dist/checkpoint_util.h"

using namespace tessera;
using namespace tessera::testing;
namespace fs = std::filesystem;

namespace {

const std::vector<std::string> kSteps = {"creating",
                                         "creating datasets",
                                         "writing 'model/a'",
                                         "writing 'model/b'",
                                         "writing the checksum table",
                                         "flushing",
                                         "closing",
                                         "renaming"};

std::string run(const std::string& path, const std::string& mode, const std::string& step,
                int ranks, int victim) {
  const test::ChildResult r = tessera::test::run_child_job(
      ranks,
      tessera::test::shell_quoted(TESSERA_CRASH_CHILD) + " " + tessera::test::shell_quoted(path) +
          " " + mode + " " + tessera::test::shell_quoted(step) + " " + std::to_string(victim),
      "TESSERA_COLLECTIVE_TIMEOUT=60", 120);
  EXPECT_NE(r.exit_code, 0) << mode << " killed at " << step << ":\n" << r.output;
  EXPECT_EQ(r.output.find("child finished"), std::string::npos) << r.output;
  return r.output;
}

// Loads `path` here (one rank: whatever mesh saved it) and checks it is version 1, intact.
void expect_version_one(const std::string& path, const std::string& what) {
  ASSERT_TRUE(fs::exists(path)) << what;
  EXPECT_TRUE(verify_checkpoint(path).empty()) << what;
  StateDict sd = {{"model/a", zeros({64, 33})},
                  {"model/b", zeros({17, 40}, DType::BFloat16)},
                  {"extras/version", int64_t(0)}};
  load(sd, path);
  EXPECT_EQ(std::get<int64_t>(sd["extras/version"]), 1) << what;
  expect_identical(std::get<Tensor>(sd["model/a"]), index_tensor({64, 33}, DType::Float32, 1),
                   what);
  expect_identical(std::get<Tensor>(sd["model/b"]), index_tensor({17, 40}, DType::BFloat16, 1),
                   what);
}

}  // namespace

TEST(CheckpointCrash, AKilledRankLeavesThePreviousCheckpointIntact) {
  const std::string dir = scratch_dir("checkpoint_crash");
  for (const std::string& step : kSteps) {
    const int victim = step == "renaming" ? 0 : 1;  // only rank 0 renames
    const std::string path = dir + "/overwrite.h5";
    fs::remove(path);
    run(path, "overwrite", step, 2, victim);
    expect_version_one(path, "overwrite, rank " + std::to_string(victim) + " killed at " + step);
  }
}

TEST(CheckpointCrash, AKilledRankLeavesNoFileUnderANewPath) {
  const std::string dir = scratch_dir("checkpoint_crash");
  for (const char* step : {"creating datasets", "writing 'model/b'", "closing", "renaming"}) {
    const std::string path = dir + "/fresh.h5";
    fs::remove(path);
    run(path, "fresh", step, 3, std::string(step) == "renaming" ? 0 : 2);
    EXPECT_FALSE(fs::exists(path)) << "a file appeared after a kill at " << step;
  }
}

TEST(CheckpointCrash, AKilledWriterThreadLeavesThePreviousCheckpointIntact) {
  const std::string dir = scratch_dir("checkpoint_crash");
  for (const char* step : {"writing 'model/a'", "closing"}) {
    const std::string path = dir + "/async.h5";
    fs::remove(path);
    run(path, "async", step, 2, 1);
    expect_version_one(path, std::string("async, killed at ") + step);
  }
}
