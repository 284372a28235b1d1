// gtest main for tests run under mpirun: every rank runs every test; rank 0 prints gtest's usual
// report, the other ranks print only their failures (prefixed with their rank). After each test
// the ranks agree on its verdict, so that a test that failed on any rank is reported failed in
// rank 0's report too; every rank exits non-zero when any rank failed, so the job's exit status
// is the verdict.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tessera/comm/comm.h"
#include "tessera/core/factory.h"

namespace {

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::string line = "[rank " + std::to_string(rank_) + "] " +
                       (r.file_name() ? r.file_name() : "unknown file") + ":" +
                       std::to_string(r.line_number()) + ": Failure\n" + r.message() + "\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    std::fprintf(stderr, "[rank %d] [  FAILED  ] %s.%s\n", rank_, info.test_suite_name(),
                 info.name());
    std::fflush(stderr);
  }

 private:
  int rank_;
};

// Ends each test before the printer: every rank contributes whether the test
// failed on it (tests run in one order on every rank, so this collective lines up), and every
// rank adds a failure naming the other ranks where it failed, which rank 0's printer and summary
// then show. A failure added in OnTestEnd still belongs to the ending test, so the test has
// failed on every rank alike: --gtest_fail_fast then skips the same tests everywhere (a rank
// that went on alone would meet the others' collectives out of order).
class VerdictAgreement : public ::testing::EmptyTestEventListener {
 public:
  explicit VerdictAgreement(tessera::ProcessGroupPtr world) : world_(std::move(world)) {}

  void OnTestEnd(const ::testing::TestInfo& info) override {
    const bool failed_here = info.result()->Failed();
    failed_here_ = failed_here_ || failed_here;
    tessera::Tensor mine = tessera::full({1}, failed_here ? 1 : 0, tessera::DType::Int32);
    tessera::Tensor all = tessera::empty({world_->size()}, tessera::DType::Int32);
    world_->all_gather_into_tensor(all, mine)->wait();
    const std::vector<int32_t> flags = all.to_vector<int32_t>();
    std::string others;
    for (int r = 0; r < world_->size(); ++r)
      if (r != world_->rank() && flags[size_t(r)] != 0)
        others.append(others.empty() ? "" : ", ").append(std::to_string(r));
    if (!others.empty()) {
      added_ = true;
      ADD_FAILURE_AT(info.file(), info.line())
          << "failed on rank(s) " << others << " of " << world_->size()
          << " (their failures are printed above, prefixed with their rank)";
    }
  }
  // Whether a test failed on this rank by its own checks (not by the failures added above).
  bool failed_here() const { return failed_here_; }
  bool added_failures() const { return added_; }

 private:
  tessera::ProcessGroupPtr world_;
  bool failed_here_ = false;
  bool added_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  tessera::init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  // A test failing on one rank may leave the others waiting in a collective: the timeout turns
  // that into an abort with a message well before ctest's own timeout kills the job silently.
  if (std::getenv("TESSERA_COLLECTIVE_TIMEOUT") == nullptr) {
    tessera::set_collective_timeout_seconds(120);
  }
  tessera::ProcessGroupPtr world = tessera::world_group();
  const int rank = world->rank();

  // Every rank must run the same tests in the same order: a shuffle uses rank 0's seed.
  if (GTEST_FLAG_GET(shuffle)) {
    int seed = GTEST_FLAG_GET(random_seed);
    if (seed == 0) {
      seed = int(std::chrono::steady_clock::now().time_since_epoch().count() % 99999) + 1;
    }
    tessera::Tensor t = tessera::full({1}, seed, tessera::DType::Int32);
    world->broadcast(t, 0)->wait();
    GTEST_FLAG_SET(random_seed, t.item<int32_t>());
  }

  // GoogleTest calls OnTestEnd in the reverse order of appending: the agreement, appended last,
  // adds its failure before the printer reports the test.
  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  auto* agreement = new VerdictAgreement(world);
  listeners.Append(agreement);

  const int run_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  // The added failures name other ranks; what counts here is this rank's own (or a failure
  // outside any test, when it added none).
  const bool own = agreement->added_failures() ? agreement->failed_here() : run_failed != 0;
  const int local_failed = own ? 1 : 0;

  tessera::Tensor mine = tessera::full({1}, local_failed, tessera::DType::Int32);
  tessera::Tensor all = tessera::empty({world->size()}, tessera::DType::Int32);
  world->all_gather_into_tensor(all, mine)->wait();
  const std::vector<int32_t> flags = all.to_vector<int32_t>();
  std::string failed_ranks;
  for (int r = 0; r < world->size(); ++r) {
    if (flags[size_t(r)] == 0) continue;
    if (!failed_ranks.empty()) failed_ranks += ", ";
    failed_ranks += std::to_string(r);
  }
  if (rank == 0 && !failed_ranks.empty()) {
    std::fprintf(stderr, "[ tessera ] tests failed on rank(s) %s of %d\n", failed_ranks.c_str(),
                 world->size());
    std::fflush(stderr);
  }
  world.reset();
  tessera::finalize();
  return failed_ranks.empty() ? 0 : 1;
}
