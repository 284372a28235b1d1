// An async_save nobody waited for, its handle kept past the end of main (in a static), is
// finished when the runtime finalizes, while MPI still works. `ok`: the file is written.
// `differ`: the ranks' replicas of a plain tensor differ, an error found only when the save
// finishes, and the job ends with it instead of exiting 0 with no file. `hook-throws`: a
// finalize hook that throws something not derived from std::exception still ends the job.
// Run by async_save_at_finalize.cmake.
#include <cstdio>
#include <optional>
#include <string>

#include "tessera/tessera.h"

namespace {
std::optional<tessera::AsyncSave> g_pending;
}  // namespace

int main(int argc, char** argv) {
  tessera::Runtime runtime(argc, argv);
  if (argc != 3) {
    std::fprintf(stderr, "usage: async_save_at_finalize ok|differ|hook-throws PATH\n");
    return 2;
  }
  const std::string mode = argv[1];
  if (mode == "hook-throws") {
    tessera::detail::at_finalize([] { throw 42; });
    return 0;
  }
  const float last = mode == "differ" ? float(tessera::world_rank()) : 0.0f;
  tessera::StateDict sd{{"w", tessera::from_vector<float>({1.0f, 2.0f, last}, {3})}};
  g_pending.emplace(tessera::async_save(sd, argv[2]));
  return 0;  // ~Runtime finalizes while g_pending still holds the save
}
