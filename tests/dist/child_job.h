#pragma once
// Starting a separate MPI job from a test, to watch it fail (hang, abort, mismatch) without the
// failure taking this job down. Needs the TESSERA_MPIEXEC* compile definitions
// (tests/dist/CMakeLists.txt).
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/shell_quote.h"

namespace tessera::test {

struct ChildResult {
  int exit_code = -1;
  double seconds = 0;
  std::string output;  // stdout and stderr of every rank
};

// Runs `command` (program and arguments, each a shell word: quote paths with shell_quoted) on
// `ranks` ranks under mpirun, killed after
// `limit_seconds`. The child gets a clean environment plus `settings` ("VAR=value ...", which
// may override PATH): an inherited one would make its ranks join this job instead of starting
// their own.
inline ChildResult run_child_job(int ranks, const std::string& command, const std::string& settings,
                                 int limit_seconds) {
  std::string env = "env -i PATH=" + shell_quoted(std::getenv("PATH") ? std::getenv("PATH") : "") +
                    " OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1";
  // The job runs on this machine only, so mpirun never starts a remote shell; but OpenMPI
  // refuses to start at all when its default agent (ssh or rsh) is not on the PATH. `false`
  // exists everywhere and is never run. An agent set in this environment is kept.
  const char* agent = std::getenv("OMPI_MCA_plm_rsh_agent");
  env += " OMPI_MCA_plm_rsh_agent=" + shell_quoted(agent ? agent : "false");
  // The sanitizers' settings too: a child built with them must behave as this job does.
  for (const char* var : {"HOME", "LD_LIBRARY_PATH", "TMPDIR", "ASAN_OPTIONS", "UBSAN_OPTIONS"})
    if (const char* v = std::getenv(var)) env += std::string(" ") + var + "=" + shell_quoted(v);
  // Last, so that the caller's settings win (env applies assignments in order).
  env += " " + settings;
  const std::string cmd = env + " timeout -k 5 " + std::to_string(limit_seconds) + " " +
                          shell_quoted(TESSERA_MPIEXEC) + " " + TESSERA_MPIEXEC_NUMPROC_FLAG + " " +
                          std::to_string(ranks) + " " + TESSERA_MPIEXEC_FLAGS + " " + command +
                          " 2>&1";
  ChildResult result;
  const auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    result.output = "popen failed for: " + cmd;
    return result;
  }
  std::array<char, 4096> buf{};
  size_t got = 0;
  while ((got = std::fread(buf.data(), 1, buf.size(), pipe)) > 0)
    result.output.append(buf.data(), got);
  const int status = pclose(pipe);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

}  // namespace tessera::test
