// A job that test_checkpoint_crash starts to kill one of its ranks in the middle of a save:
//   checkpoint_crash_child <path> <mode> <step> <rank>
//   mode overwrite: save version 1 to <path>, then save version 2 over it
//   mode fresh:     save version 2 to <path> (which does not exist yet)
//   mode async:     save version 1, then async_save version 2 over it
// Rank <rank> kills itself with SIGKILL when the save of version 2 reaches step <step> (a step
// name of the checkpoint layer: "creating", "writing 'model/b'", "closing", "renaming", ...).
// Reaching the end prints "child finished".
#include <csignal>
#include <cstdio>
#include <string>

#include "dist/checkpoint_util.h"
#include "fault.h"

using namespace tessera;

int main(int argc, char** argv) {
  Runtime runtime(argc, argv);
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s PATH overwrite|fresh|async STEP RANK\n", argv[0]);
    return 2;
  }
  const std::string path = argv[1], mode = argv[2], step = argv[3];
  const int victim = std::stoi(argv[4]);
  DeviceMesh mesh(Shape{world_size()}, {"x"});
  auto state = [&](int version) {
    return StateDict{
        {"model/a",
         distribute_tensor(tessera::testing::index_tensor({64, 33}, DType::Float32, version), mesh,
                           {Shard(0)})},
        {"model/b",
         distribute_tensor(tessera::testing::index_tensor({17, 40}, DType::BFloat16, version), mesh,
                           {Shard(1)})},
        {"extras/version", int64_t(version)}};
  };
  if (mode != "fresh") save(state(1), path);
  ckpt::set_fault_hook([&](const std::string& s) {
    if (s == step && world_rank() == victim) std::raise(SIGKILL);
  });
  if (mode == "async") {
    AsyncSave pending = async_save(state(2), path);
    pending.wait();
  } else {
    save(state(2), path);
  }
  if (world_rank() == 0) std::printf("child finished\n");
  return 0;
}
