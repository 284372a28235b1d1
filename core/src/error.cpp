#include "tessera/core/error.h"

#include <atomic>

namespace tessera {

namespace {
std::atomic<int> g_rank{-1};
}

Error::Error(const std::string& what) : std::runtime_error(what) {}

void set_error_rank(int rank) {
  g_rank.store(rank);
}
int error_rank() {
  return g_rank.load();
}

namespace detail {
void throw_error(const char* file, int line, const std::string& msg) {
  (void)file;
  (void)line;
  int r = error_rank();
  throw Error(r >= 0 ? "[rank " + std::to_string(r) + "] " + msg : msg);
}
}  // namespace detail

}  // namespace tessera
