#pragma once
// One shell word for `s` (single-quoted, any ' inside escaped), for the commands tests hand to
// popen and system: paths with spaces or quotes stay one argument.
#include <string>

namespace tessera::test {

inline std::string shell_quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s)
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace tessera::test
