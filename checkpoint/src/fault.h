#pragma once
// A hook called at every step of a checkpoint file operation (internal to checkpoint/): the crash
// tests kill a rank there. Steps are named as the watchdog names them ("creating", "writing
// 'model/w'", "closing", "renaming", ...). No hook is set outside tests.
#include <functional>
#include <string>

namespace tessera::ckpt {

void set_fault_hook(std::function<void(const std::string& step)> hook);
void fault_point(const std::string& step);

}  // namespace tessera::ckpt
