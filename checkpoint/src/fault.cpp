#include "fault.h"

namespace tessera::ckpt {

namespace {
std::function<void(const std::string&)>& hook() {
  static std::function<void(const std::string&)> h;
  return h;
}
}  // namespace

void set_fault_hook(std::function<void(const std::string& step)> h) {
  hook() = std::move(h);
}

void fault_point(const std::string& step) {
  if (hook()) hook()(step);
}

}  // namespace tessera::ckpt
