#include "tessera/core/error.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace tessera {

namespace {

std::atomic<int> g_rank{-1};

// The repository root as the compiler spelled it, taken from this file's own path, so that a
// location reads "dtensor/src/dtensor.cpp:120" wherever the tree was built.
std::string_view source_root() {
  constexpr std::string_view kSelf = "core/src/error.cpp";
  std::string_view path = __FILE__;
  if (path.size() >= kSelf.size() && path.substr(path.size() - kSelf.size()) == kSelf)
    return path.substr(0, path.size() - kSelf.size());
  return {};
}

bool show_locations() {
#ifndef NDEBUG
  constexpr bool kDebugBuild = true;
#else
  constexpr bool kDebugBuild = false;
#endif
  static const bool show = [] {
    const char* v = std::getenv("TESSERA_ERROR_LOCATION");
    if (v != nullptr && *v != '\0') return std::strcmp(v, "0") != 0;
    return kDebugBuild;
  }();
  return show;
}

}  // namespace

Error::Error(const std::string& what) : std::runtime_error(what) {}

Error::Error(const std::string& what, const char* file, int line)
    : std::runtime_error(what), file_(file), line_(line) {}

void set_error_rank(int rank) {
  g_rank.store(rank);
}
int error_rank() {
  return g_rank.load();
}

namespace detail {
void throw_error(const char* file, int line, const std::string& msg) {
  std::string_view where = file;
  const std::string_view root = source_root();
  if (!root.empty() && where.starts_with(root)) where.remove_prefix(root.size());
  const int r = error_rank();
  std::string text = r >= 0 ? "[rank " + std::to_string(r) + "] " + msg : msg;
  if (show_locations()) {
    text += " (raised at ";
    text += where;
    text += ":" + std::to_string(line) + ")";
  }
  throw Error(text, file, line);
}
}  // namespace detail

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string s;
  for (const std::string& p : parts) {
    if (!s.empty()) s += sep;
    s += p;
  }
  return s;
}

}  // namespace tessera
