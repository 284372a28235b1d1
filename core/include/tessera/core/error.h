#pragma once
// Errors are exceptions that say which rank raised them and what was wrong. The rank is
// process-wide context set by the communication layer once it knows it.
#include <sstream>
#include <stdexcept>
#include <string>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what);
};

// -1 until a runtime sets it; messages then carry "[rank r]".
void set_error_rank(int rank);
int error_rank();

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace tessera

#define TESSERA_CHECK(cond, ...)                                                                  \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      ::tessera::detail::throw_error(__FILE__, __LINE__, ::tessera::detail::concat(__VA_ARGS__)); \
    }                                                                                             \
  } while (0)

#define TESSERA_FAIL(...) \
  ::tessera::detail::throw_error(__FILE__, __LINE__, ::tessera::detail::concat(__VA_ARGS__))
